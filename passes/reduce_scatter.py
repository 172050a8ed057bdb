"""After the ILP: shard the weight update along the mesh (ZeRO-style).

Data-parallel gradients are all-reduced and every device then updates the same full weights
and optimizer state. Splitting the optimizer state over the mesh makes the ILP reduce-scatter
the gradients instead, update a slice on each device and all-gather the new weights: the
same bytes moved (an all-reduce is a reduce-scatter plus an all-gather), with the optimizer
state and the update's work divided by the number of devices. 
By default (zero="auto") the pass re-solves each stage's ILP letting every optimizer-state
parameter be split: the ILP rewrites exactly the chains where that is no slower (a small
gradient that a latency-bound all-reduce over fewer devices moves faster stays as it was),
and the old plan is still one of its choices, so the step never gets slower. zero="2" splits
every optimizer-state parameter (ZeRO-2) and zero="3" the weights too (gathered where used),
as asked, even where that costs time.

Pipeline stages are priced by per-layer ILPs that may already split the optimizer state
wherever that is no slower, so in auto mode their choice stands and the pass only reports it.

With microbatches, each microbatch's gradient is reduced (scattered, when rewritten) before
it is accumulated; accumulating unreduced partial sums and reducing once per step is not
implemented, and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from alpac.passmanager import CompileContext, Pass
from alpac.strategy_rules import roles_of_stage, roles_of_step, rule, update_rule
from passes.intra_op import peak_of, shard_within


@dataclass
class ReduceScatterPass(Pass):
    name = "reduce-scatter"
    description = ("shard the optimizer state and the weight update where no slower "
                   "(reduce-scatter + all-gather; zero=2 everywhere, zero=3 the weights too)")
    requires = ("stages", "sharded", "step")
    zero: str = "auto"  # auto | 2 | 3
    time_limit: float = 60.0

    def run(self, ctx: CompileContext) -> None:
        module = ctx.module
        zero = str(self.zero)
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
            entry = {"stage": stage.index, "zero": zero, "applied": False,
                     "optimizer_state_params": len(roles.optimizer_state),
                     "accumulation": "reduced per microbatch"
                     if repeats and max(repeats.values(), default=1) > 1 else "none"}
            if not roles.optimizer_state and zero != "3":
                report.append(entry)
                continue
            base = stage.allow
            if ctx.plan.get("strategy") == "data-parallel":
                # a forced data-parallel plan keeps its data parallelism; the update may split
                base = rule("data-parallel", roles, stage.mesh.shape)
            names = roles.optimizer_state | (roles.weights if zero == "3" else frozenset())
            entry["already_split"] = len(_split_parameters(before, names))
            if entry["already_split"] == len(names) or (
                    zero == "auto" and stage.pipeline_stage is not None):
                # the ILP split them all itself, or the stage DP's layer ILPs, which were
                # free to split the optimizer state, chose where it pays
                entry["rewritten"] = _split_parameters(before, names)
                report.append(entry)
                continue
            allow = update_rule(roles, stage.mesh.shape, zero, base)
            peak = peak_of(ctx, stage, len(module.analyses["stages"]))
            after = shard_within(stage.module, stage.mesh, ctx.cluster, before.budget,
                                 self.time_limit, 1e-4, repeats, allow, peak)
            old, new = before.solution, after.solution
            peak = peak or (lambda result: result.solution.peak_memory)
            peak_before, peak_after = peak(before), peak(after)
            chains = _split_parameters(after, names)
            entry.update({"time_before_s": old.objective, "time_after_s": new.objective,
                          "peak_memory_before_bytes": peak_before,
                          "peak_memory_after_bytes": peak_after,
                          "rewritten": chains})
            gained = len(chains) > entry["already_split"]
            if gained and (zero != "auto" or new.objective <= old.objective * (1 + 1e-6)):
                stage.sharding = after
                stage.allow = allow
                entry["applied"] = True
                entry["memory_saved_bytes"] = peak_before - peak_after
            report.append(entry)
        ctx.plan["reduce_scatter"] = report


def _split_parameters(result, names) -> list[str]:
    """The parameters among `names` that the solution stores split, in program order."""
    choice = result.solution.choice
    return [instr.name for (instr, idx), value in result.graph.values.items()
            if idx == () and instr.opcode == "parameter" and instr.name in names
            and value.producer is instr and not value.sharding(choice).is_replicated]
