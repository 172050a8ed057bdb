"""Split the step into per-microbatch / accumulated / once-per-step parts: a StepSplit."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.analysis.costs import CostTable
from alpac.analysis.step.batch import BatchInfo
from alpac.analysis.step.split import StepSplit
from alpac.hlo import Module
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class StepSplitPass(Pass):
    name = "step-split"
    description = ("split the step for microbatching (per-microbatch part, accumulated "
                   "gradients, once-per-step update), mark forward/backward, or say why "
                   "microbatching would not be exact")
    requires = (Module, BatchInfo)
    optional = (CostTable,)
    provides = (StepSplit,)

    def run(self, ctx: CompileContext) -> None:
        split = StepSplit(ctx.get(Module), ctx.get(BatchInfo), ctx.find(CostTable))
        ctx.put(split)
        ctx.stats["step"] = {"refusal": split.refusal, "sizes": split.sizes}
