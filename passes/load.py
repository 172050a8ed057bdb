"""The first pass: read the model file into the IR."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo import Module
from alpac.passes.manager import CompileContext, Pass
from alpac.xla.loader import load_module


@dataclass(frozen=True)
class LoadPass(Pass):
    name = "load"
    description = "read the model (.hlo text, .pb HloModuleProto, .mlir StableHLO) into the IR"
    provides = (Module,)

    def run(self, ctx: CompileContext) -> None:
        ctx.put(load_module(ctx.model_path))
