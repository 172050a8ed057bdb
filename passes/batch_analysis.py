"""Find the batch inputs (parameter and dim) of the entry computation: analysis "batch"."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.passmanager import CompileContext, Pass
from alpac.step.batch import batch_info_from_args, detect_batch, parse_batch_args


@dataclass
class BatchAnalysisPass(Pass):
    name = "batch-analysis"
    description = ("find the batch inputs and their batch dim (state comes back as outputs, "
                   "batch inputs reach the loss); option batch_args='5:0,6:0' overrides")
    provides = ("batch",)

    batch_args: str = ""

    def run(self, ctx: CompileContext) -> None:
        module = ctx.module
        if self.batch_args.strip():
            info = batch_info_from_args(module, parse_batch_args(self.batch_args))
        else:
            info = detect_batch(module)
        module.analyses["batch"] = info
        ctx.stats["batch"] = {"args": {a.param: a.dim for a in info.args}, "size": info.size,
                              "confidence": info.confidence}
