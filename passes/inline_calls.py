"""Inline `call` instructions, so every later pass sees one flat entry computation."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo import Module
from alpac.hlo.transforms import inline_calls, remove_dead_code
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class InlineCallsPass(Pass):
    name = "inline-calls"
    description = ("inline call instructions (jax keeps library functions as calls); drop "
                   "dead instructions")
    requires = (Module,)

    def run(self, ctx: CompileContext) -> None:
        ctx.stats["inlined_calls"] = inline_calls(ctx.get(Module))
        # dead code (a gradient nobody uses) is removed by XLA before partitioning: it must
        # not be planned or priced either
        ctx.stats["dead_instructions"] = remove_dead_code(ctx.get(Module))
