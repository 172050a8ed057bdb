"""Shard the weight update along the mesh where no slower (ZeRO; alpac.interop.weight_update):
new ShardedStages and a WeightUpdate report."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.analysis.step.split import StepSplit
from alpac.interop.shard import ILP_TIME_LIMIT_S
from alpac.interop.stage import ShardedStages, WeightUpdate
from alpac.interop.weight_update import rewrite_weight_update
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class ReduceScatterPass(Pass):
    name = "reduce-scatter"
    description = ("shard the optimizer state and the weight update where no slower "
                   "(reduce-scatter + all-gather; zero=2 everywhere, zero=3 the weights too)")
    requires = (ShardedStages, StepSplit)
    provides = (ShardedStages, WeightUpdate)
    zero: str = "auto"  # auto | 2 | 3
    time_limit: float = ILP_TIME_LIMIT_S  # seconds per stage ILP solved again

    def run(self, ctx: CompileContext) -> None:
        stages = ctx.get(ShardedStages)
        sharded, report = rewrite_weight_update(stages, ctx.get(StepSplit),
                                                stages.assignment.runs_on or ctx.cluster,
                                                str(self.zero), self.time_limit)
        ctx.put(sharded)
        ctx.put(report)
