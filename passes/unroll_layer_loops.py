"""Unroll the layer loops of a step that will be pipelined, and cut their stacked arrays per
layer (alpac.interop.unroll): a new Module, what it is of the old one (Unrolled), and its
costs and step split. A step that will not be pipelined (a given mesh, a one-stage strategy,
a step that cannot be microbatched) keeps its loops: one sharding per loop body is what XLA
wants there, and the ILP stays the size of one iteration."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.analysis.costs import CostTable
from alpac.analysis.step.batch import BatchInfo
from alpac.analysis.step.split import StepSplit
from alpac.hlo import Module
from alpac.interop.construct import SINGLE_STAGE_STRATEGIES
from alpac.interop.unroll import Unrolled, unroll_layer_loops
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class UnrollLayerLoopsPass(Pass):
    name = "unroll-layer-loops"
    description = ("unroll layer loops (scan) of a step that will be pipelined and cut their "
                   "stacked weights, optimizer state and gradients per layer")
    mesh: str = ""  # the compile's --mesh: one stage, which keeps the loops
    strategy: str = ""  # the compile's --strategy: one-stage strategies keep the loops
    requires = (Module, BatchInfo, CostTable)
    optional = (StepSplit,)
    provides = (Module, Unrolled, CostTable, StepSplit)

    def run(self, ctx: CompileContext) -> None:
        module, split = ctx.get(Module), ctx.find(StepSplit)
        pipelined = not (self.mesh or self.strategy in SINGLE_STAGE_STRATEGIES) and \
            split is not None and split.refusal is None and bool(split.backward)
        done = unroll_layer_loops(module) if pipelined else None
        if done is None:
            ctx.put(Unrolled(None, (), (), (), (), ()))
            return
        work, unrolled = done
        costs = CostTable(work)
        split = StepSplit(work, ctx.get(BatchInfo), costs)  # batch inputs are never cut
        for result in (work, unrolled, costs, split):
            ctx.put(result)
        ctx.stats["unrolled"] = {"instructions_before": module.instruction_count(),
                                 "instructions_after": work.instruction_count()}
        ctx.stats["step"] = {"refusal": split.refusal, "sizes": split.sizes}
