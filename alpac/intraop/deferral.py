"""Gradients reduced once per step: a pipeline stage's per-microbatch gradient accumulated
unreduced, its all-reduce moved to the update.

With microbatches, a data-parallel weight gradient is a partial sum on each device; reducing
it every microbatch moves B times the bytes that reducing the accumulated sum once does
(Megatron-LM and Alpa accumulate locally and all-reduce once per step). Where the ILP chose,
for a contraction whose result is accumulated (through converts or copies, each its only
user) into a gradient accumulator, an all-reduce of its partial sums and nothing else, and
the contraction, the chain, the accumulation and the accumulator all share one sharding, the
all-reduce is deferred: the contraction runs in a manual region without it, each device adds
its partial sum to its own copy of the accumulator (which XLA is told is replicated over the
reduced axes: only manual regions read it), and the update all-reduces the accumulator once,
before its first use (`alpac.intraop.annotate`). The ILP prices the all-reduce of such a
contraction once per step (`reduced_once`), so it prefers it to a reduce-scatter and an
all-gather every microbatch; the plan counts it in the update's time. Where the shardings
chosen do not allow the deferral after all, the estimate adds back the other microbatches'
all-reduces (`ShardingResult`).
"""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo.ir import Instruction

PARTIAL_SUMS = ("dot", "convolution", "reduce", "scatter")  # ops that can give partial sums
CHAIN = ("convert", "copy")


@dataclass(frozen=True)
class Deferral:
    """One accumulated gradient whose all-reduce runs once per step, in the update."""

    contraction: Instruction  # computes the microbatch's partial sums
    chain: tuple[Instruction, ...]  # converts/copies from it to the accumulation, in order
    accumulate: Instruction  # add(accumulator, chain's last)
    accumulator: Instruction  # the accumulator parameter
    first_update: str  # the update instruction the all-reduce is charged to
    axes: tuple[int, ...]  # mesh axes the all-reduce runs over


def find_deferrals(sg, choice, accumulations: dict[str, str]) -> list[Deferral]:
    """The accumulations (`accumulate node name -> the name of an update instruction that
    reads it`) whose gradient's all-reduce can run once per step (module docstring)."""
    out = []
    users = sg.module.entry.users()
    for instr in sg.plans:
        update = accumulations.get(instr.name)
        if update is None:
            continue
        found = _deferral(sg, choice, instr, update, users)
        if found is not None:
            out.append(found)
    return out


def undeferred(sg, deferred: list[Deferral], accumulations: dict[str, str]) -> set[str]:
    """The accumulations whose contraction the ILP priced once per step (`reduced_once`)
    that the chosen shardings do not defer."""
    done = {d.contraction for d in deferred}
    return {accumulate.name for accumulate, contraction in _contractions(sg.module, accumulations)
            if contraction in sg.reduced_once and contraction not in done}


def reduced_once(module, accumulations: dict[str, str], repeats: dict[str, float]
                 ) -> dict[Instruction, float]:
    """The contractions whose all-reduce the ILP prices once per step: those a microbatch
    runs whose result is accumulated (`_traced`), each with 1 / its runs per step."""
    out = {}
    for _, contraction in _contractions(module, accumulations):
        runs = repeats.get(contraction.name, 1.0)
        if runs > 1:
            out[contraction] = 1.0 / runs
    return out


def _contractions(module, accumulations: dict[str, str]):
    """(accumulation, the contraction it adds) of each of `accumulations` of that form."""
    users = module.entry.users() if accumulations else {}
    for accumulate in module.entry.instructions:
        if accumulate.name in accumulations and (traced := _traced(accumulate, users)):
            yield accumulate, traced[0]


def _traced(accumulate: Instruction, users: dict):
    """The contraction an accumulation adds, through converts and copies that are each
    their operand's only user (`users`: the entry's), and that chain (nearest the
    accumulation first); None where the accumulation is not of that form."""
    if accumulate.opcode != "add" or len(accumulate.operands) != 2:
        return None
    value, chain = accumulate.operands[1], []
    while value.opcode in CHAIN and len(users[value]) == 1:
        chain.append(value)
        value = value.operands[0]
    if value.opcode not in PARTIAL_SUMS or len(users[value]) != 1 or value.shape.is_tuple:
        return None
    return value, chain


def _deferral(sg, choice, accumulate: Instruction, update: str, users: dict
              ) -> Deferral | None:
    traced = _traced(accumulate, users)
    if traced is None or traced[0] not in sg.reduced_once:
        return None
    value, chain = traced
    plan = sg.plans.get(value)
    if plan is None or not plan.strategies:
        return None
    st = plan.strategy(choice)
    if len(st.collectives) != 1 or st.collectives[0].kind != "all-reduce":
        return None
    out = st.outputs[0]
    accumulator = accumulate.operands[0]
    same = [_sharding(sg, choice, x) for x in (*chain, accumulate, accumulator)]
    if out.partial or any(s != out for s in same):
        return None
    if any(_sharding_in(sg, choice, x) != out for x in (*chain, accumulate)):
        return None
    return Deferral(value, tuple(reversed(chain)), accumulate, accumulator, update,
                    tuple(st.collectives[0].axes))


def _sharding(sg, choice, x: Instruction):
    value = sg.values.get((x, ()))
    return value.sharding(choice) if value is not None else None


def _sharding_in(sg, choice, x: Instruction):
    """The sharding `x`'s strategy takes its operands in (all alike, or None)."""
    plan = sg.plans.get(x)
    if plan is None or not plan.strategies:
        return None
    inputs = set(plan.strategy(choice).inputs)
    return inputs.pop() if len(inputs) == 1 else None


def collective_index(collectives: list, deferral: Deferral) -> int:
    """The index, in a ShardingResult's `collectives`, of the deferral's all-reduce."""
    return next(k for k, (name, c, _) in enumerate(collectives)
                if name == deferral.contraction.name and c.kind == "all-reduce")
