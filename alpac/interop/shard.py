"""The final sharding ILP of every stage, on its logical mesh, within the memory budget."""

from __future__ import annotations

from itertools import combinations
from typing import NamedTuple

from alpac.errors import UserError
from alpac.hlo.transforms import canonical_hash, canonical_order
from alpac.interop.pricing import pipelined_peak, stage_memory
from alpac.interop.remat import remat_split
from alpac.interop.stage import ShardedStage, ShardedStages, Stage, StageAssignment
from alpac.intraop.autoshard import auto_shard
from alpac.intraop.memory import StageMemory
from alpac.intraop.problem import Infeasible
from alpac.intraop.receiving import Receive
from alpac.intraop.rules import both, keep_to
from alpac.plan.schedule import microbatches_in_flight

ILP_TIME_LIMIT_S = 60.0  # seconds per stage, unless `--time-limit` says otherwise
ILP_GAP = 1e-4  # relative optimality gap at which SCIP may stop


def shard_stages(assignment: StageAssignment, cluster, budget: float, time_limit: float,
                 gap: float, progress=None) -> ShardedStages:
    """Solve each stage's ILP; pipeline stages of one structure on like meshes share their
    solutions (their ILPs are one ILP)."""
    known: dict[tuple, dict] = {}  # stage structure -> its solutions (see shard_within)
    sharded, peaks = [], []
    receives = received(assignment)
    for stage, receive in zip(assignment.stages, receives):
        if progress:
            progress(f"stage ILPs (stage {stage.index} on {stage.mesh})", stage.index,
                     len(assignment.stages))
        repeats = stage.pipeline_stage.repeats if stage.pipeline_stage else None
        # what it receives takes the sharding cheapest to receive, whatever its layer's chose
        hints = {k: v for k, v in (stage.hints or {}).items() if k not in receive}
        rule = both(stage.rule, keep_to(hints))
        same = None
        if stage.pipeline_stage:
            # instructions in canonical order, so that a solution reused between stages of
            # one structure matches them by position
            canonical_order(stage.module.entry)
            same = known.setdefault(_structure(stage, cluster, hints, receive), {})
        peak = peak_of(stage, len(assignment.stages), assignment.micro_batches)
        result = shard_within(stage.module, stage.mesh, cluster, budget, time_limit, gap,
                              repeats, rule, peak, same, _accumulations(stage), receive)
        sharded.append(ShardedStage(stage, result, rule))
        peaks.append(judged_peak(peak, result))
    return ShardedStages(assignment, tuple(sharded), budget, tuple(peaks))


def _structure(stage: Stage, cluster, hints: dict, receive: dict[str, Receive]) -> tuple:
    """What a stage's ILP depends on, up to names: its program, the shape of its mesh and
    which axes cross nodes, per instruction the hint and executions per step, and what it
    receives over which link."""
    entry = stage.module.entry
    repeats = stage.pipeline_stage.repeats
    axes = range(len(stage.mesh.shape))
    links = {name: (r.times, cluster.link_kind(r.src_device, stage.mesh.devices[0]))
             for name, r in receive.items()}
    return (canonical_hash(stage.module), tuple(stage.mesh.shape),
            tuple(stage.mesh.axis_crosses_nodes(group, cluster)
                  for k in range(1, len(axes) + 1) for group in combinations(axes, k)),
            tuple((str(hints.get(x.name)), repeats.get(x.name), links.get(x.name))
                  for x in entry.instructions),
            stage.weights_stored_split)


def received(assignment: StageAssignment) -> list[dict[str, Receive]]:
    """Per stage, the parameters it receives from another stage's mesh (as the plan moves
    them: from the first stage that makes the value, or, for a value of the step's inputs,
    the first that reads it), with how often per step."""
    modules = [stage.pipeline_stage for stage in assignment.stages]
    if any(m is None for m in modules):
        return [{} for _ in assignment.stages]
    home: dict[str, int] = {}
    for s, m in enumerate(modules):
        for value in m.output_values:
            home.setdefault(value, s)
    for s, m in enumerate(modules):
        for value in m.param_values:
            home.setdefault(value, s)
    out = []
    for s, m in enumerate(modules):
        out.append({
            p.name: Receive(p.shape.byte_size, assignment.micro_batches
                            if m.scope.get(value) == "microbatch" else 1.0,
                            assignment.stages[home[value]].mesh.devices[0])
            for p, value in zip(m.module.entry.parameters, m.param_values)
            if home[value] != s and not p.shape.is_tuple})
    return out


class StagePeak(NamedTuple):
    """How a pipeline stage's peak memory is judged (`pipelined_peak`: parameters, one
    temporary, the activations of its microbatches in flight), and the same count for its
    ILP to keep within the budget."""

    stage: object  # alpac.interop.pipeline.StageModule
    num_stages: int
    index: int
    num_micro_batches: int

    def __call__(self, result) -> float:
        return pipelined_peak(self.stage, result, self.num_stages, self.index,
                              self.num_micro_batches)[2]

    def memory(self) -> StageMemory:
        """The same count for the ILP, with the stage's own recomputation."""
        return stage_memory(self.stage, microbatches_in_flight(
            self.num_stages, self.index, self.num_micro_batches), remat_split(self.stage))


def peak_of(stage: Stage, num_stages: int, num_micro_batches: int) -> StagePeak | None:
    """A pipeline stage's peak as the stage DP priced it; a whole program's is the ILP's own
    liveness schedule (None)."""
    if stage.pipeline_stage is None:
        return None
    return StagePeak(stage.pipeline_stage, num_stages, stage.index, num_micro_batches)


def judged_peak(peak: StagePeak | None, result) -> float:
    return peak(result) if peak else result.solution.peak_memory


def _accumulations(stage: Stage) -> dict[str, str] | None:
    return stage.pipeline_stage.accumulations if stage.pipeline_stage else None


def shard_within(module, mesh, cluster, budget: float, time_limit: float, gap: float,
                 repeats=None, allow=None, peak: StagePeak | None = None,
                 known: dict | None = None, accumulations: dict[str, str] | None = None,
                 receive: dict[str, Receive] | None = None):
    """Solve without the memory constraint (its reductions are stronger); only when that plan
    does not fit (by `peak`, default the ILP's liveness peak), solve again with the ILP
    keeping that count within the budget. `known` holds the solutions (without, with the
    budget) of a module of the same structure, reused and filled in; `receive`: what the
    stage receives from other meshes (`receiving.Receive`)."""
    known = {} if known is None else known
    result = auto_shard(module, mesh, cluster, time_limit=time_limit, gap_limit=gap,
                        repeats=repeats, allow=allow, reuse=known.get("free"),
                        accumulations=accumulations, received=receive)
    known.setdefault("free", result.solution)
    if judged_peak(peak, result) <= budget:
        result.budget = budget
        return result
    memory = peak.memory() if peak else None
    # stages of one structure hold different numbers of microbatches: each its own constraint
    within = ("budget", memory.in_flight if memory else None)
    try:
        result = auto_shard(module, mesh, cluster, budget=budget, time_limit=time_limit,
                            gap_limit=gap, repeats=repeats, allow=allow,
                            reuse=known.get(within), memory=memory,
                            accumulations=accumulations, received=receive)
        known.setdefault(within, result.solution)
    except Infeasible as e:
        raise UserError(f"the program does not fit in {budget:,.0f} bytes per device on mesh "
                        f"{mesh}: the smallest per-device peak alpac can reach is "
                        f"{e.min_peak:,.0f} bytes") from None
    result.budget = budget
    return result
