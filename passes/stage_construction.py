"""Choose the pipeline stages, their submeshes and logical meshes, and the number of
microbatches: a StageAssignment (alpac.interop.construct)."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.analysis.costs import CostTable
from alpac.analysis.step.split import StepSplit
from alpac.hlo import Module
from alpac.interop.construct import StageOptions, construct_stages
from alpac.interop.stage import StageAssignment
from alpac.interop.unroll import Unrolled
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class StageConstructionPass(Pass, StageOptions):
    name = "stage-construction"
    description = "choose pipeline stages, their submeshes and logical meshes, and B"
    requires = (Module, CostTable)
    optional = (StepSplit, Unrolled)  # without a step split (or when it refuses): one stage
    provides = (StageAssignment,)

    def run(self, ctx: CompileContext) -> None:
        stats: dict = {}
        ctx.put(construct_stages(ctx.get(Module), ctx.find(StepSplit), ctx.get(CostTable),
                                 ctx.cluster, ctx.budget, self, ctx.progress, stats,
                                 ctx.find(Unrolled)))
        if stats:
            ctx.stats["stage_dp"] = stats
