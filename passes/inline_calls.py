"""Inline `call` instructions, so every later pass sees one flat entry computation, and give
each loop and conditional computations of its own."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo import Module
from alpac.hlo.transforms import flatten_call_graph, inline_calls, remove_dead_code
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class InlineCallsPass(Pass):
    name = "inline-calls"
    description = ("inline call instructions (jax keeps library functions as calls); give "
                   "each loop and conditional its own computations; drop dead instructions")
    requires = (Module,)

    def run(self, ctx: CompileContext) -> None:
        ctx.stats["inlined_calls"] = inline_calls(ctx.get(Module))
        ctx.stats["copied_computations"] = flatten_call_graph(ctx.get(Module))
        # dead code (a gradient nobody uses) is removed by XLA before partitioning: it must
        # not be planned or priced either
        ctx.stats["dead_instructions"] = remove_dead_code(ctx.get(Module))
