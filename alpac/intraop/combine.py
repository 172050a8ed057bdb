"""The all-reduces XLA's combiner merges into one instruction, and what they cost so.

XLA merges a module's all-reduces over the same devices that do not depend on each other
into one (a step's gradient all-reduces, one per weight). The CPU runtime still runs each
operand as a collective of its own, but one after the other, without the work between them
that the calibrated `all-reduce` table has before each: there a combined operand is the
`combined-all-reduce` table's (an operand of an all-reduce of 8, timed so). At 4 ranks x 2
devices here an operand of 4-64 KiB took 5-10 ms against 11-13 ms after a dot each; at 2 x 4
5-7 ms against 7-8 (benchmarks/results/collective_forms_*.md). The sharding ILP prices every
all-reduce alone; the plan's estimate prices those XLA combines as combined.
"""

from __future__ import annotations

from alpac.intraop.collectives import Collective


def combined_sets(records: list[tuple[str, Collective, float]], instructions: dict,
                  group) -> list[list[int]]:
    """Indexes into `records` ((instruction name, collective, multiplier), in program order)
    of the all-reduces XLA combines, a list per combined instruction of two or more: those
    run once per step, of one `group(name)` (one module of a pipeline stage) and over the
    same mesh axes, in program order, until one depends on an earlier one of the set (it
    starts the next). `instructions`: name -> the instruction, in program order."""
    position = {name: k for k, name in enumerate(instructions)}
    open_sets: dict[tuple, list[int]] = {}
    done: list[list[int]] = []
    for i in sorted(range(len(records)), key=lambda i: position.get(records[i][0], -1)):
        name, c, multiplier = records[i]
        if c.kind != "all-reduce" or multiplier != 1 or name not in instructions:
            continue
        key = (group(name), tuple(c.axes))
        members = open_sets.get(key, [])
        if members and _depends(instructions[name], {records[j][0] for j in members},
                                instructions):
            done.append(members)
            members = []
        open_sets[key] = members + [i]
    return [s for s in done + list(open_sets.values()) if len(s) > 1]


def _depends(instr, names: set[str], instructions: dict) -> bool:
    """Whether `instr` is one of `names` or computed from one (its operands, transitively)."""
    seen, stack = set(), [instr]
    while stack:
        at = stack.pop()
        if at.name in names:
            return True
        for operand in at.operands:
            if id(operand) not in seen:
                seen.add(id(operand))
                stack.append(operand)
    return False


def savings(records: list[tuple[str, Collective, float]], instructions: dict, group,
            model) -> dict[int, float]:
    """Record index -> the seconds its all-reduce costs less combined than alone (negative
    where the combined form measured dearer), for the records `combined_sets` combines."""
    out = {}
    for members in combined_sets(records, instructions, group):
        for i in members:
            _, c, _ = records[i]
            out[i] = c.seconds(model) - model.combined_all_reduce(c.nbytes, c.axes)
    return out
