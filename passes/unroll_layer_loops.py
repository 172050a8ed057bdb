"""Cut the layer loops of a step that will be pipelined, and its stacked arrays to match
(alpac.interop.unroll: one loop per stage of a forced pipeline where that splits into
microbatches, else every iteration unrolled): a new Module, what it is of the old one
(Unrolled), and its costs and step split. A step that will not be pipelined (a given mesh, a
one-stage strategy, a step that cannot be microbatched) keeps its loops: one sharding per
loop body is what XLA wants there, and the ILP stays the size of one iteration."""

from __future__ import annotations

from dataclasses import dataclass, replace

from alpac.analysis.costs import CostTable
from alpac.analysis.step.batch import BatchInfo
from alpac.analysis.step.rewrite import MicrobatchRefused
from alpac.analysis.step.split import StepSplit
from alpac.hlo import Module
from alpac.interop.construct import SINGLE_STAGE_STRATEGIES
from alpac.interop.unroll import Unrolled, unroll_layer_loops
from alpac.intraop.rules import parse_megatron
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class UnrollLayerLoopsPass(Pass):
    name = "unroll-layer-loops"
    description = ("cut the layer loops (scan) of a step that will be pipelined, one loop per "
                   "stage of a forced pipeline or else unrolled, and their stacked weights, "
                   "optimizer state and gradients to match")
    mesh: str = ""  # the compile's --mesh: one stage, which keeps the loops
    strategy: str = ""  # the compile's --strategy: one-stage strategies keep the loops whole,
    # a forced pipeline's (megatron:..,pp=P) keeps one per stage
    layers: int = 0  # the compile's --layers: a given number of layers unrolls the loops
    requires = (Module, BatchInfo, CostTable)
    optional = (StepSplit,)
    provides = (Module, Unrolled, CostTable, StepSplit)

    def run(self, ctx: CompileContext) -> None:
        module, split = ctx.get(Module), ctx.find(StepSplit)
        pipelined = not (self.mesh or self.strategy in SINGLE_STAGE_STRATEGIES) and \
            split is not None and split.refusal is None and bool(split.backward)
        stages = parse_megatron(self.strategy, ctx.cluster.num_devices)[2] \
            if self.strategy.startswith("megatron") else 0
        done = _cut_for_pipeline(module, ctx.get(BatchInfo), 0 if self.layers else stages) \
            if pipelined else None
        if done is None:
            ctx.put(Unrolled(None, (), (), (), (), ()))
            return
        work, unrolled, costs, split = done
        if self.layers and stages > 1:
            unrolled = replace(unrolled, why_unrolled=f"kept one per stage, each stage's loop "
                                                      f"would be a layer; --layers "
                                                      f"{self.layers} asks for that many")
        elif stages < 2:
            unrolled = replace(unrolled, why_unrolled="the stage DP chooses the stages, and may "
                                                      "cut between any two iterations")
        for result in (work, unrolled, costs, split):
            ctx.put(result)
        ctx.stats["unrolled"] = {"instructions_before": module.instruction_count(),
                                 "instructions_after": work.instruction_count()}
        ctx.stats["step"] = {"refusal": split.refusal, "sizes": split.sizes}


def _cut_for_pipeline(module: Module, batch: BatchInfo, stages: int):
    """The module with its layer loops cut (one per stage where the step then still splits
    into microbatches, else unrolled), what it is of `module`, its costs and its step split;
    None where they are not cut."""
    done = _analysed_cut(module, batch, stages)
    if done is None or not done[1].per_stage:
        return done
    why = _not_microbatched(done[3])
    if why is None:
        return done
    done = _analysed_cut(module, batch, 0)  # unrolled, the rewrite sees the bodies inlined
    if done is None:
        return None
    work, unrolled, costs, split = done
    return work, replace(unrolled, why_unrolled=f"kept one per stage, the step would not "
                                               f"split into microbatches: {why}"), costs, split


def _analysed_cut(module: Module, batch: BatchInfo, stages: int):
    """`unroll_layer_loops(module, stages)` with the cut module's costs and step split."""
    done = unroll_layer_loops(module, stages)
    if done is None:
        return None
    work, unrolled = done
    costs = CostTable(work)
    return work, unrolled, costs, StepSplit(work, batch, costs)  # batch inputs are never cut


def _not_microbatched(split: StepSplit) -> str | None:
    """Why the step would not split into microbatches (None: it would, into the fewest
    above one)."""
    if split.refusal is not None:
        return split.refusal
    size = split.batch.size
    fewest = next((b for b in range(2, size + 1) if size % b == 0), None)
    try:
        if fewest is not None:
            split.microbatch(fewest)
    except MicrobatchRefused as e:
        return str(e)
    return None
