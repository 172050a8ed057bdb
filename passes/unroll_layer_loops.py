"""Unroll the layer loops of a step that will be pipelined, and cut their stacked arrays per
layer (alpac.interop.unroll): a new Module and what it is of the old one (Unrolled)."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo import Module
from alpac.interop.construct import SINGLE_STAGE_STRATEGIES
from alpac.interop.unroll import Unrolled, unroll_layer_loops
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class UnrollLayerLoopsPass(Pass):
    name = "unroll-layer-loops"
    description = ("unroll layer loops (scan) and cut their stacked weights, optimizer state "
                   "and gradients per layer, so that pipeline stages hold some of the layers")
    mesh: str = ""  # the compile's --mesh: one stage, which keeps the loops
    strategy: str = ""  # the compile's --strategy: one-stage strategies keep the loops
    requires = (Module,)
    provides = (Module, Unrolled)

    def run(self, ctx: CompileContext) -> None:
        module = ctx.get(Module)
        one_stage = self.mesh or self.strategy in SINGLE_STAGE_STRATEGIES
        done = None if one_stage else unroll_layer_loops(module)
        if done is None:
            ctx.put(Unrolled(None, (), (), (), (), ()))
            return
        ctx.put(done[0])
        ctx.put(done[1])
        ctx.stats["unrolled"] = {"instructions_before": module.instruction_count(),
                                 "instructions_after": done[0].instruction_count()}
