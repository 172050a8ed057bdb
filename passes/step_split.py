"""Split the step into per-microbatch / accumulated / once-per-step parts: analysis "step"."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.passmanager import CompileContext, Pass
from alpac.step.split import StepSplit


@dataclass
class StepSplitPass(Pass):
    name = "step-split"
    description = ("split the step for microbatching (per-microbatch part, accumulated "
                   "gradients, once-per-step update), mark forward/backward, or say why "
                   "microbatching would not be exact")
    requires = ("batch",)
    provides = ("step",)

    def run(self, ctx: CompileContext) -> None:
        module = ctx.module
        split = StepSplit(module, module.analyses["batch"], module.analyses.get("costs"))
        module.analyses["step"] = split
        ctx.stats["step"] = {"refusal": split.refusal, "sizes": split.sizes}
