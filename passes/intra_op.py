"""The sharding ILP for every stage on its logical mesh, within the device memory:
ShardedStages (alpac.interop.shard)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from alpac.interop.shard import ILP_GAP, ILP_TIME_LIMIT_S, shard_stages
from alpac.interop.stage import ShardedStages, StageAssignment
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class IntraOpShardingPass(Pass):
    name = "intra-op-sharding"
    description = "solve the sharding ILP (SCIP) of every stage on its logical mesh"
    requires = (StageAssignment,)
    provides = (ShardedStages,)
    time_limit: float = ILP_TIME_LIMIT_S  # seconds per stage
    gap: float = ILP_GAP  # relative optimality gap at which SCIP may stop

    def run(self, ctx: CompileContext) -> None:
        assignment = ctx.get(StageAssignment)
        if assignment.solved is not None and assignment.solved_with == (self.time_limit,
                                                                        self.gap):
            ctx.put(dataclasses.replace(assignment.solved, assignment=assignment))
            return  # solved while the stages were chosen, at these settings
        ctx.put(shard_stages(assignment, assignment.runs_on or ctx.cluster, ctx.budget,
                             self.time_limit, self.gap, ctx.progress))
