"""XLA's all-reduce combiner: independent all-reduces over the same devices run as one.

After SPMD partitioning XLA merges all-reduces of one computation that reduce over the same
device groups and do not depend on each other into one all-reduce of their operands, up to a
size and a count (its AllReduceCombiner): a data-parallel step's gradient all-reduces, one per
weight, become one (the data-parallel GPT plan's 25 compile to 1 on CPU). Each pays one
collective's latency instead of one per weight, so the estimate prices each combined group as
one all-reduce of its bytes. The walk follows the combiner's: instructions in program order,
per key an open group, closed when the next one depends on a member or would pass the
limits. All-gathers and reduce-scatters stay separate (XLA's CPU pipeline does not combine
them: the same plan keeps its 45 all-gathers, a ZeRO-2 plan its 25 reduce-scatters).

Only CPU clusters are priced so (`combines_all_reduces`): there it was checked against the
compiled modules. XLA's GPU pipeline combines all-gathers and reduce-scatters as well, which
has not run here on several GPUs; GPU clusters keep every collective priced apart, as the
ILP prices them.
"""

from __future__ import annotations

from alpac.hlo import Module

COMBINE_BYTES, COMBINE_COUNT = 30 << 20, 256  # XLA's default limits per combined all-reduce


def combines_all_reduces(cluster) -> bool:
    """Whether the plan's modules run on CPU devices, where the combining is priced."""
    return cluster.device.name == "cpu"


def combined_all_reduces(module: Module, collectives: list) -> list[list[int]]:
    """Groups of positions in `collectives` ((instruction name, Collective, multiplier), as
    ShardingResult keeps them) whose all-reduces XLA runs as one; every all-reduce is in
    exactly one group."""
    by_instr: dict[str, list[int]] = {}
    for i, (name, c, _) in enumerate(collectives):
        if c.kind == "all-reduce":
            by_instr.setdefault(name, []).append(i)
    groups: list[list[int]] = []
    for comp in module.computations:
        groups += _walk(comp, by_instr, collectives)
    return groups


def _walk(comp, by_instr: dict[str, list[int]], collectives: list) -> list[list[int]]:
    """The combined groups of one computation (its instructions in program order)."""
    bit: dict[str, int] = {}  # an instruction with all-reduces -> its bit
    below: dict[object, int] = {}  # instruction -> the bits of the ones it depends on
    open_groups: dict[tuple, tuple[list[int], int, float]] = {}  # key -> group, bits, bytes
    done: list[list[int]] = []
    for instr in comp.instructions:
        deps = 0
        for op in instr.operands:
            deps |= below.get(op, 0) | bit.get(op.name, 0)
        below[instr] = deps
        if instr.name not in by_instr:
            continue
        mine = bit[instr.name] = 1 << len(bit)
        for i in by_instr[instr.name]:
            _, c, mult = collectives[i]
            key = (c.axes, mult)
            group, bits, nbytes = open_groups.get(key, ([], 0, 0.0))
            if group and (deps & bits or nbytes + c.nbytes > COMBINE_BYTES or
                          len(group) >= COMBINE_COUNT):
                done.append(group)
                group, bits, nbytes = [], 0, 0.0
            open_groups[key] = (group + [i], bits | mine, nbytes + c.nbytes)
    return done + [group for group, _, _ in open_groups.values() if group]
