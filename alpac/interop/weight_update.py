"""After the ILP: shard the weight update along the mesh (ZeRO-style).

Data-parallel gradients are all-reduced and every device then updates the same full weights
and optimizer state. Splitting the optimizer state over the mesh makes the ILP reduce-scatter
the gradients instead, update a slice on each device and all-gather the new weights: the
same bytes moved (an all-reduce is a reduce-scatter plus an all-gather), with the optimizer
state and the update's work divided by the number of devices.
By default (zero="auto") each stage's ILP is solved again letting every optimizer-state
parameter be split: the ILP rewrites exactly the chains where that is no slower (a small
gradient that a latency-bound all-reduce over fewer devices moves faster stays as it was),
and the old plan is still one of its choices, so the step never gets slower. zero="2" splits
every optimizer-state parameter (ZeRO-2) and zero="3" the weights too (gathered where used),
as asked, even where that costs time.

Pipeline stages are priced by per-layer ILPs that may already split the optimizer state
wherever that is no slower, so in auto mode their choice stands and only the report is made;
so too for a stage whose ILP had no filter (its choices already included every split).

With microbatches, a gradient whose all-reduce the ILP chose is accumulated unreduced and
reduced once per step where it can be (alpac.intraop.deferral); the others (scattered, when
rewritten) are reduced every microbatch before they are accumulated, and the plan says which.
"""

from __future__ import annotations

from dataclasses import replace

from alpac.interop.shard import judged_peak, peak_of, received, shard_within
from alpac.interop.stage import ShardedStage, ShardedStages, WeightUpdate
from alpac.intraop.rules import roles_of_stage, roles_of_step, rule, update_rule


def rewrite_weight_update(sharded: ShardedStages, split, cluster, zero: str,
                          time_limit: float) -> tuple[ShardedStages, WeightUpdate]:
    """The stages with their update sharded where asked (or where no slower), and a report
    per stage."""
    assignment = sharded.assignment
    stages, peaks, report = [], [], []
    for done, peak, receive in zip(sharded.stages, sharded.peaks, received(assignment)):
        after, entry = _rewrite_stage(done, assignment, split, cluster, zero, time_limit,
                                      sharded.budget, receive)
        stages.append(after)
        peaks.append(peak if after is done else entry["peak_memory_after_bytes"])
        report.append(entry)
    return replace(sharded, stages=tuple(stages), peaks=tuple(peaks)), WeightUpdate(
        tuple(report))


def _rewrite_stage(done: ShardedStage, assignment, split, cluster, zero: str,
                   time_limit: float, budget: float, receive: dict) -> tuple[ShardedStage, dict]:
    stage = done.stage
    if stage.pipeline_stage is not None:
        roles = roles_of_stage(stage.pipeline_stage, assignment.pipeline[0])
        repeats = stage.pipeline_stage.repeats
    else:
        roles = roles_of_step(stage.module, split)
        repeats = None
    entry = {"stage": stage.index, "zero": zero, "applied": False,
             "optimizer_state_params": len(roles.optimizer_state),
             "accumulation": _accumulation(done.sharding, repeats),
             "reduced_once_per_step": len(done.sharding.deferred)}
    if not roles.optimizer_state and zero != "3":
        return done, entry
    base = done.rule
    if assignment.strategy == "data-parallel":
        # a forced data-parallel plan keeps its data parallelism; the update may split
        base = rule("data-parallel", roles, stage.mesh.shape)
    names = roles.optimizer_state | (roles.weights if zero == "3" else frozenset())
    entry["already_split"] = len(_split_parameters(done.sharding, names))
    if entry["already_split"] == len(names) or (
            zero == "auto" and (stage.pipeline_stage is not None or base is None)):
        # the ILP split them all itself, or an ILP free to split the optimizer state (the
        # stage DP's layer ILPs, or this one: without a filter, update_rule's "auto" is the
        # same ILP) chose where it pays
        entry["rewritten"] = _split_parameters(done.sharding, names)
        return done, entry
    allow = update_rule(roles, stage.mesh.shape, zero, base)
    peak = peak_of(stage, len(assignment.stages), assignment.micro_batches)
    after = shard_within(stage.module, stage.mesh, cluster, budget, time_limit, 1e-4,
                         repeats, allow, peak, accumulations=stage.pipeline_stage.accumulations
                         if stage.pipeline_stage else None,
                         receive=receive)
    old, new = done.sharding.solution.objective, after.solution.objective
    peak_before, peak_after = judged_peak(peak, done.sharding), judged_peak(peak, after)
    chains = _split_parameters(after, names)
    entry.update({"time_before_s": old, "time_after_s": new,
                  "peak_memory_before_bytes": peak_before,
                  "peak_memory_after_bytes": peak_after, "rewritten": chains})
    gained = len(chains) > entry["already_split"]
    if gained and (zero != "auto" or new <= old * (1 + 1e-6)):
        entry["applied"] = True
        entry.update(accumulation=_accumulation(after, repeats),
                     reduced_once_per_step=len(after.deferred))
        entry["memory_saved_bytes"] = peak_before - peak_after
        return ShardedStage(stage, after, allow), entry
    return done, entry


def _accumulation(result, repeats) -> str:
    """How the stage's accumulated gradients are reduced: once per step where deferred
    (alpac.intraop.deferral), else every microbatch."""
    if not repeats or max(repeats.values(), default=1) <= 1:
        return "none"
    if not result.deferred:
        return "reduced per microbatch"
    return f"reduced once per step ({len(result.deferred)} all-reduces), the rest per microbatch"


def _split_parameters(result, names) -> list[str]:
    """The parameters among `names` that the solution stores split, in program order."""
    choice = result.solution.choice
    return [instr.name for (instr, idx), value in result.graph.values.items()
            if idx == () and instr.opcode == "parameter" and instr.name in names
            and value.producer is instr and not value.sharding(choice).is_replicated]
