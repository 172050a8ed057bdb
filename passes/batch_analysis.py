"""Find the batch inputs (parameter and dim) of the entry computation: a BatchInfo."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.analysis.step.batch import BatchInfo, batch_info_from_args, detect_batch, \
    parse_batch_args
from alpac.hlo import Module
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class BatchAnalysisPass(Pass):
    name = "batch-analysis"
    description = ("find the batch inputs and their batch dim (state comes back as outputs, "
                   "batch inputs reach the loss); option batch_args='5:0,6:0' overrides")
    requires = (Module,)
    provides = (BatchInfo,)
    batch_args: str = ""

    def run(self, ctx: CompileContext) -> None:
        module = ctx.get(Module)
        if self.batch_args.strip():
            info = batch_info_from_args(module, parse_batch_args(self.batch_args))
        else:
            info = detect_batch(module)
        ctx.put(info)
        ctx.stats["batch"] = {"args": {a.param: a.dim for a in info.args}, "size": info.size,
                              "confidence": info.confidence}
