"""The sharding ILP for every stage: a sharding for every instruction of the stage's program
on its logical mesh, within the device memory."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from alpac.autoshard import auto_shard
from alpac.errors import UserError
from alpac.hlo.transforms import canonical_hash, canonical_order
from alpac.ilp import Infeasible
from alpac.passmanager import CompileContext, Pass
from alpac.stage_costs import pipelined_peak
from alpac.strategy_rules import both, keep_to


@dataclass
class IntraOpShardingPass(Pass):
    name = "intra-op-sharding"
    description = "solve the sharding ILP (SCIP) of every stage on its logical mesh"
    requires = ("stages",)
    provides = ("sharded",)
    time_limit: float = 60.0  # seconds per stage
    gap: float = 1e-4  # relative optimality gap at which SCIP may stop

    def run(self, ctx: CompileContext) -> None:
        budget = ctx.budget
        stages = ctx.module.analyses["stages"]
        known: dict[tuple, dict] = {}  # stage structure -> its solutions (see shard_within)
        for stage in stages:
            ctx.progress(f"stage ILPs (stage {stage.index} on {stage.mesh})", stage.index,
                         len(stages))
            repeats = stage.pipeline_stage.repeats if stage.pipeline_stage else None
            stage.allow = both(stage.allow, keep_to(stage.hints))
            same = None
            if stage.pipeline_stage:
                # instructions in canonical order, so that a solution reused between stages
                # of one structure matches them by position
                canonical_order(stage.module.entry)
                same = known.setdefault(_structure(stage, ctx.cluster), {})
            stage.sharding = shard_within(stage.module, stage.mesh, ctx.cluster, budget,
                                          self.time_limit, self.gap, repeats, stage.allow,
                                          peak_of(ctx, stage, len(stages)), same)
        ctx.plan["memory_budget_bytes"] = budget
        ctx.module.analyses["sharded"] = True


def _structure(stage, cluster) -> tuple:
    """What a stage's ILP depends on, up to names: its program, the shape of its mesh and
    which axes cross nodes, and per instruction the hint and executions per step. Pipeline
    stages of repeated layers on like submeshes share one (their ILPs are one ILP)."""
    entry = stage.module.entry
    hints, repeats = stage.hints or {}, stage.pipeline_stage.repeats
    axes = range(len(stage.mesh.shape))
    return (canonical_hash(stage.module), tuple(stage.mesh.shape),
            tuple(stage.mesh.axis_crosses_nodes(group, cluster)
                  for k in range(1, len(axes) + 1) for group in combinations(axes, k)),
            tuple((str(hints.get(x.name)), repeats.get(x.name)) for x in entry.instructions),
            stage.weights_stored_split)


def peak_of(ctx: CompileContext, stage, num_stages: int):
    """How a stage's peak memory is judged: a pipeline stage's as the stage DP priced it
    (parameters, one temporary, the activations of its microbatches in flight), a whole
    program's by the ILP's own liveness schedule (None)."""
    if stage.pipeline_stage is None:
        return None
    B = ctx.plan["num_micro_batches"]
    return lambda result: pipelined_peak(stage.pipeline_stage, result, num_stages,
                                         stage.index, B)[2]


def shard_within(module, mesh, cluster, budget: float, time_limit: float, gap: float,
                 repeats=None, allow=None, peak=None, known: dict | None = None):
    """Solve without the memory constraint (its reductions are stronger); only when that plan
    does not fit (by `peak(result)`, default the ILP's liveness peak), solve again under the
    budget. `known` holds the solutions (without, with the budget) of a module of the same
    structure, reused and filled in."""
    known = {} if known is None else known
    result = auto_shard(module, mesh, cluster, time_limit=time_limit, gap_limit=gap,
                        repeats=repeats, allow=allow, reuse=known.get("free"))
    known.setdefault("free", result.solution)
    if (peak(result) if peak else result.solution.peak_memory) <= budget:
        result.budget = budget
        return result
    try:
        result = auto_shard(module, mesh, cluster, budget=budget, time_limit=time_limit,
                            gap_limit=gap, repeats=repeats, allow=allow,
                            reuse=known.get("budget"))
        known.setdefault("budget", result.solution)
    except Infeasible as e:
        raise UserError(f"the program does not fit in {budget:,.0f} bytes per device on mesh "
                        f"{mesh}: the smallest per-device peak alpac can reach is "
                        f"{e.min_peak:,.0f} bytes") from None
    result.budget = budget
    return result
