"""Collectives XLA's CPU backend gets wrong across processes, rewritten before compiling.

XLA runs a `reduce-scatter` between processes on CPU with gloo's halving-doubling algorithm,
which sends a device's first half to its partner asynchronously and then, in the same call,
copies its own reduced half over that first half without waiting for the send to finish. When
the receiver drains the connection late (a loaded machine), the unsent tail of the message is
the overwritten data: the partner's result ends in a few hundred wrong elements, differently
from run to run. XLA's own CPU partitioning never emits a reduce-scatter (it all-reduces and
slices), and gloo's all-reduce waits for its sends.

alpac writes each reduce-scatter it plans as a manual region (`intraop/annotate.py`): the
operands to per-device tiles, the dot, convolution or reduce on the tiles, the reduce-scatter
of the partial sums, back to the full shape. For a module whose mesh spans processes on CPU,
`alpa-run` hands each such region back to XLA's partitioner as the op on the whole operands
with the region's output sharding: the same sums, which XLA computes as an all-reduce and a
slice. (Keeping the region and only replacing the collective by an all-reduce and a
dynamic-slice, or leaving the region replicated, each trips a check of XLA's CPU partitioner
for some of the shardings around the region.) Only the bytes on the wire double, on a CPU run.
"""

from __future__ import annotations

from alpac.hlo import parse_hlo, print_module
from alpac.hlo.ir import Instruction
from alpac.hlo.transforms import replace_uses


def rejoin_reduce_scatters(text: str) -> str:
    """The module with every manual reduce-scatter region alpac writes replaced by its op on
    the whole operands, sharded as the region's result (the text as given when there is
    none). A reduce-scatter of another form is left as it is."""
    if "reduce-scatter(" not in text:
        return text
    module = parse_hlo(text)
    changed = False
    for comp in module.computations:
        regions = _regions(comp)
        for local, full in regions:
            whole = comp.append(Instruction(
                module.unique_name(f"{local.name}.whole"), local.opcode, full.shape,
                [o.operands[0] for o in local.operands],
                {**{k: v for k, v in local.attrs.items() if k != "sharding"},
                 "sharding": full.attrs["sharding"]}, local.payload, local.line))
            replace_uses(comp, full, whole)
        if regions:
            comp.topological_sort()
            comp.remove_dead()
            changed = True
    return print_module(module) if changed else text


def _regions(comp) -> list[tuple[Instruction, Instruction]]:
    """(op on the tiles, its exit to the full shape) of each manual reduce-scatter region."""
    users, out = comp.users(), []
    for rs in comp.instructions:
        if rs.opcode != "reduce-scatter" or len(rs.operands) != 1:
            continue
        local, exits = rs.operands[0], users.get(rs, [])
        if len(exits) == 1 and exits[0].custom_call_target == "SPMDShardToFullShape" \
                and local.operands and all(o.custom_call_target == "SPMDFullToShardShape"
                                           for o in local.operands):
            out.append((local, exits[0]))
    return out
