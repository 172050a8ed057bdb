"""Inline `call` instructions, so every later pass sees one flat entry computation."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo.transforms import inline_calls
from alpac.passmanager import CompileContext, Pass


@dataclass
class InlineCallsPass(Pass):
    name = "inline-calls"
    description = "inline call instructions (jax keeps library functions as calls)"

    def run(self, ctx: CompileContext) -> None:
        ctx.stats["inlined_calls"] = inline_calls(ctx.module)
