"""The first pass: read the model file into the IR."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.loader import load_module
from alpac.passmanager import CompileContext, Pass


@dataclass
class LoadPass(Pass):
    name = "load"
    description = "read the model (.hlo text, .pb HloModuleProto, .mlir StableHLO) into the IR"

    def run(self, ctx: CompileContext) -> None:
        ctx.module = load_module(ctx.model_path)
