"""Write the plan: one sharded HLO module per stage, its decisions, the program alpa-run runs
and the estimates: an EmittedPlan (alpac.interop.emit)."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo import Module
from alpac.interop.emit import EmittedPlan, emit_plan
from alpac.interop.stage import ShardedStages
from alpac.interop.unroll import Unrolled
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class EmitPass(Pass):
    name = "emit"
    description = "write the sharded HLO of every stage and the plan's stages and estimates"
    requires = (Module, ShardedStages)
    optional = (Unrolled,)  # the program's inputs and outputs are then the source's pieces
    provides = (EmittedPlan,)

    def run(self, ctx: CompileContext) -> None:
        emitted = emit_plan(ctx.get(Module), ctx.get(ShardedStages), ctx.cluster,
                            ctx.find(Unrolled))
        ctx.put(emitted)
        ctx.stats["stages"] = list(emitted.solve_seconds)
