"""FLOPs, transcendentals and bytes of every instruction: a CostTable."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.analysis.costs import CostTable
from alpac.hlo import Module
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class CostAnalysisPass(Pass):
    name = "cost-analysis"
    description = "FLOPs, transcendentals and bytes per instruction (while bodies × trip count)"
    requires = (Module,)
    provides = (CostTable,)

    def run(self, ctx: CompileContext) -> None:
        ctx.put(CostTable(ctx.get(Module)))
