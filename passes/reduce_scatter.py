"""After the ILP: shard the weight update along the mesh (ZeRO-style).

Data-parallel gradients are all-reduced and every device then updates the same full weights
and optimizer state. Splitting the optimizer state over the mesh makes the ILP reduce-scatter
the gradients instead, update a slice on each device and all-gather the new weights: the
same bytes moved (an all-reduce is a reduce-scatter plus an all-gather), with the optimizer
state and the update's work divided by the number of devices. The pass re-solves each
stage's ILP with the optimizer state split and keeps the result when the step is no slower;
with zero=3 the weights are stored split too (gathered where used) and the result is always
kept, as asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from alpac.passmanager import CompileContext, Pass
from alpac.strategy_rules import both, roles_of_stage, roles_of_step, rule, update_rule
from passes.intra_op import shard_within


@dataclass
class ReduceScatterPass(Pass):
    name = "reduce-scatter"
    description = ("shard the optimizer state and the weight update (reduce-scatter + "
                   "all-gather, ZeRO-2; zero=3 also stores the weights sharded)")
    requires = ("stages", "sharded", "step")
    zero: int = 2
    time_limit: float = 60.0

    def run(self, ctx: CompileContext) -> None:
        module = ctx.module
        report = []
        for stage in module.analyses["stages"]:
            if stage.pipeline_stage is not None:
                graph = module.analyses["pipeline"][0]
                roles = roles_of_stage(stage.pipeline_stage, graph)
                repeats = stage.pipeline_stage.repeats
            else:
                roles = roles_of_step(stage.module, module.analyses["step"])
                repeats = None
            before = stage.sharding
            entry = {"stage": stage.index, "zero": self.zero, "applied": False,
                     "optimizer_state_params": len(roles.optimizer_state)}
            if not roles.optimizer_state and self.zero != 3:
                report.append(entry)
                continue
            if ctx.plan.get("strategy") in ("data-parallel", "zero2", "zero3"):
                # a forced data-parallel plan becomes the matching ZeRO stage
                kind = "zero3" if self.zero == 3 or ctx.plan["strategy"] == "zero3" else "zero2"
                allow = rule(kind, roles, stage.mesh.shape)
            else:
                allow = both(stage.allow, update_rule(roles, stage.mesh.shape, self.zero))
            after = shard_within(stage.module, stage.mesh, ctx.cluster, before.budget,
                                 self.time_limit, 1e-4, repeats, allow)
            old, new = before.solution, after.solution
            entry.update({"time_before_s": old.objective, "time_after_s": new.objective,
                          "peak_memory_before_bytes": old.peak_memory,
                          "peak_memory_after_bytes": new.peak_memory})
            if self.zero == 3 or new.objective <= old.objective * (1 + 1e-9):
                stage.sharding = after
                stage.allow = allow
                entry["applied"] = True
                entry["memory_saved_bytes"] = old.peak_memory - new.peak_memory
            report.append(entry)
        ctx.plan["reduce_scatter"] = report
