"""FLOPs, transcendentals and bytes of every instruction, attached as analysis "costs"."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.costs import CostTable
from alpac.passmanager import CompileContext, Pass


@dataclass
class CostAnalysisPass(Pass):
    name = "cost-analysis"
    description = "FLOPs, transcendentals and bytes per instruction (while bodies × trip count)"
    provides = ("costs",)

    def run(self, ctx: CompileContext) -> None:
        ctx.module.analyses["costs"] = CostTable(ctx.module)
