"""What a pipeline stage costs, for the stage DP: per layer and logical mesh, the sharding ILP
on that layer's share of the step.

A layer's share is its forward and backward (run once per microbatch, with its gradient
accumulation) and the update of the parameters it owns (run once per step), cut out of the
microbatched step exactly as a one-layer stage would be. Its ILP gives:

  t        seconds per microbatch (forward + backward + accumulation)
  apply    seconds per step (the update)
  static   bytes per device kept all step (weights, optimizer state, accumulators)
  transient   bytes per device of the largest temporary
  activation  bytes per device one microbatch keeps from its forward to its backward

A stage of layers i..j costs the sum over its layers (its temporaries: the largest of
theirs, one layer runs at a time). What it receives from the stages beside it is priced
beside (`transfer_prices`); the arrays its modules return, by the emitted plan
(`_launch_seconds`). Layers whose share is the same program up to names (the blocks of a
transformer) are solved once per logical mesh. The ILP runs at two microbatch counts; other
counts are interpolated as a + b/B (exact while the shardings stay the same: per-example
work scales with the microbatch, weight-sized work does not), at the counts where they still
divide (`dividing_counts`).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import NamedTuple

import numpy as np

from alpac.hlo.transforms import canonical_hash, canonical_order
from alpac.interop import pipeline as pl
from alpac.interop.remat import REMAT_MODES, Remat, RematSplit, remat_split, \
    split_for_backward
from alpac.intraop.autoshard import auto_shard
from alpac.intraop.memory import StageMemory
from alpac.intraop.rules import both, keep_to
from alpac.plan.mesh import LogicalMesh
from alpac.plan.program import Role
from alpac.plan.schedule import microbatches_in_flight
from alpac.procs import die_with


class LayerTask(NamedTuple):
    """One layer ILP: a layer's module on a logical mesh (see `layer_cost`)."""

    stage: "pl.StageModule"
    mesh: LogicalMesh
    cluster: object
    time_limit: float
    hint: list | None = None
    rule: object = None


@dataclass(frozen=True)
class LayerCost:
    t: float
    apply: float
    static_bytes: float
    activation_bytes: float
    transient_bytes: float

    @property
    def held_bytes(self) -> float:
        """Bytes per device before any microbatch's activations: static and a temporary."""
        return self.static_bytes + self.transient_bytes

    @staticmethod
    def fit(b1: int, c1: "LayerCost", b2: int, c2: "LayerCost", B: int) -> "LayerCost":
        """Per-microbatch time and activations at B microbatches, from the same shardings at
        b1 and b2, as a + b/B (the part that shrinks with the microbatch, and the part that
        does not)."""
        if b1 == b2:
            return LayerCost(c1.t * b1 / B, c1.apply, c1.static_bytes,
                             c1.activation_bytes * b1 / B, c1.transient_bytes)

        def at(y1, y2, b=B):
            slope = max((y1 - y2) / (1 / b1 - 1 / b2), 0.0)
            return max(y1 - slope / b1, 0.0) + slope / b

        def largest_temporary(y1, y2):
            """The larger of per-example and weight-sized temporaries: convex in 1/B, so the
            line through the two points bounds it between them, and past the larger count the
            value there does. (The larger of the two points, as before, hid plans with many
            microbatches: GPT-39B on 64 V100s as Megatron's dp=1 tp=4 pp=16, fitting at
            B=1024, was priced 1.8 GB over 16 GiB.)"""
            if (y1 - y2) * (b2 - b1) < 0:  # larger with the smaller microbatch: no trend
                return max(y1, y2)
            return at(y1, y2, min(B, max(b1, b2)))

        return LayerCost(at(c1.t, c2.t), c1.apply, c1.static_bytes,
                         at(c1.activation_bytes, c2.activation_bytes),
                         largest_temporary(c1.transient_bytes, c2.transient_bytes))

    def plus(self, per_microbatch: float, per_step: float) -> "LayerCost":
        """The stage's cost with what its ranks do beside its modules' work, per microbatch
        beside its forward and backward and per step beside its update: launching the
        modules (the stage DP: `launch_s` each; the emitted plan adds each module's arrays)
        and receiving from other stages (emit's `_receive_seconds`)."""
        return LayerCost(self.t + per_microbatch, self.apply + per_step, self.static_bytes,
                         self.activation_bytes, self.transient_bytes)

    def __add__(self, other: "LayerCost") -> "LayerCost":
        return LayerCost(self.t + other.t, self.apply + other.apply,
                         self.static_bytes + other.static_bytes,
                         self.activation_bytes + other.activation_bytes,
                         max(self.transient_bytes, other.transient_bytes))


class RangeCosts:
    """The LayerCost of every layer range first..last (summed, temporaries the largest) of one
    mesh config at one B, tabulated at once: the stage DP asks for up to L²/2 ranges per
    config and B, and a Python sum per range made it cubic in L."""

    def __init__(self, layers: list[LayerCost]):
        fields = np.array([[c.t, c.apply, c.static_bytes, c.activation_bytes,
                            c.transient_bytes] for c in layers], dtype=np.float64)
        n = len(layers)
        self.table = np.zeros((n, n, 5))
        for first in range(n):  # cumsum adds left to right, as summing the layers would
            self.table[first, first:, :4] = np.cumsum(fields[first:, :4], axis=0)
            self.table[first, first:, 4] = np.maximum.accumulate(fields[first:, 4])

    def __call__(self, first: int, last: int) -> LayerCost:
        return LayerCost(*self.table[first, last].tolist())


class LayerModules:
    """Each layer's share of the step (of the layers in `only`), for a given number of
    microbatches."""

    def __init__(self, module, split, layer_of: dict[str, int], num_layers: int, B: int,
                 only: list[int] | None = None):
        self.B = B
        step = split.microbatch(B)
        self.graph = pl.step_graph(step, {x.name for x in split.forward}, layer_of,
                                   module.input_output_alias)
        # every layer a stage of its own: each module is then exactly what that layer holds
        # in any stage (the first one with the prologue), for one pass over the graph
        where, placed = pl.assign_stages(self.graph, list(range(num_layers)))
        wanted = list(range(num_layers)) if only is None else only
        self.layers: dict[int, tuple[pl.StageModule, str]] = {}
        for layer, stage in zip(wanted, pl.stage_modules(self.graph, where, placed, num_layers,
                                                         B, only=wanted)):
            canonical_order(stage.module.entry)
            self.layers[layer] = (stage, canonical_hash(stage.module))


def dividing_counts(reference: LayerModules, probe: LayerModules, layer: int, chosen: list,
                    mesh_shape: tuple[int, ...], batch: int, counts: list[int]) -> frozenset[int]:
    """The microbatch counts at which the layer's shardings chosen at the reference count
    (`chosen`, by instruction) still split every dimension evenly. A dimension the microbatch
    rewrite shrinks is linear in the examples per microbatch: its size at any count follows
    from its sizes at the reference and at the probe's count. The DP prices the layer only at
    these counts: elsewhere the final ILP must choose other shardings (a fit through one
    example per microbatch, where GPT-18.4B's batch splits could not hold, had its one-stage
    plan on 256 A100s priced within 80 GiB and built at 151 GB)."""
    e1, e2 = batch // reference.B, batch // probe.B
    ones = reference.layers[layer][0].module.entry.instructions
    twos = probe.layers[layer][0].module.entry.instructions
    shrinking = []  # (size at e1, size at e2, ways split)
    for x, y, sharding in zip(ones, twos, chosen, strict=True):
        if sharding is None or x.shape.is_tuple:
            continue
        for d1, d2, axes in zip(x.shape.dims, y.shape.dims, sharding.dim_axes):
            if d1 != d2 and axes:
                shrinking.append((d1, d2, math.prod(mesh_shape[a] for a in axes)))

    def divides(e: int) -> bool:
        # size at e = d1 + (d2 - d1)(e - e1)/(e2 - e1): a whole multiple of the split
        return all((d1 * (e2 - e1) + (d2 - d1) * (e - e1)) % ((e2 - e1) * ways) == 0
                   for d1, d2, ways in shrinking)

    return frozenset(B for B in counts if divides(batch // B))


def layer_cost(stage: "pl.StageModule", mesh: LogicalMesh, cluster, time_limit: float,
               hint: list | None = None, rule=None) -> tuple[dict[Remat, LayerCost], list]:
    """The layer's figures under each recomputation mode, and the sharding the ILP chose
    for each instruction of its module (by position, None where it chose none): a hint for
    the final ILP of the stage that holds any layer of the same structure. With `hint` (such
    a list for a module of the same structure), the ILP keeps to it: the same shardings
    priced at another microbatch size."""
    allow = both(rule, keep_to(None if hint is None else {
        x.name: h for x, h in zip(stage.module.entry.instructions, hint) if h is not None}))
    result = auto_shard(stage.module, mesh, cluster, time_limit=time_limit, gap_limit=0.02,
                        repeats=stage.repeats, allow=allow, annotate=False,
                        accumulations=stage.accumulations)
    choice = result.solution.choice
    entry = result.graph.module.entry
    decided = {i.name: i for i in result.graph.plans if i.parent is entry}
    chosen = []
    for instr in stage.module.entry.instructions:
        twin = decided.get(instr.name)
        value = result.graph.values.get((twin, ())) if twin is not None else None
        chosen.append(value.sharding(choice) if value is not None else None)
    return remat_figures(stage, result), chosen


def stage_figures(stage: "pl.StageModule", result, choice: dict | None = None) -> LayerCost:
    """Time per microbatch, update time, static and per-microbatch memory of a sharded stage
    module, recomputing as `choice` says (layer -> Remat; the stage's own when None): the
    backward pays the recomputed instructions once more and the microbatch keeps less."""
    B = max(stage.repeats.values(), default=1.0)
    split = remat_split(stage, choice)
    seconds = role_seconds(stage, result, split)
    per_step = seconds[Role.FORWARD] + seconds[Role.BACKWARD] + seconds["shared"]
    memory = stage_memory(stage, 1, split)
    per_value = result.bytes_by(lambda name: name)
    activation = sum(v for k, v in per_value.items() if k in memory.kept)
    transient = max((v for k, v in per_value.items() if k not in memory.not_temporary),
                    default=0.0)
    params = sum(_param_bytes(result, p) for p in result.graph.module.entry.parameters
                 if p.name in memory.held)
    return LayerCost(per_step / B, seconds[Role.APPLY], params, activation, transient)


def role_seconds(stage: "pl.StageModule", result, split: RematSplit) -> dict:
    """Seconds per step of the stage's forward, backward (with what it recomputes under
    `split`), update, and of the instructions several roles compute ("shared")."""
    role = stage.role
    seconds = result.seconds_by(lambda name: role.get(name, "shared"))
    out = {key: seconds.get(key, 0.0)
           for key in (Role.FORWARD, Role.BACKWARD, Role.APPLY, "shared")}
    if split.again:
        out[Role.BACKWARD] += sum(v for k, v in result.seconds_by(lambda name: name).items()
                                  if k in split.again)
    return out


def stage_memory(stage: "pl.StageModule", in_flight: int, split: RematSplit) -> StageMemory:
    """What a stage's peak memory counts (`stage_figures`, and the ILP under a budget): the
    step-scope parameters (weights, optimizer state, accumulators), the values a microbatch
    keeps for its backward under `split` (fewer where it recomputes), and beside them about
    one temporary at a time (XLA fuses the elementwise chains into loops that write in
    place)."""
    parameters = stage.module.entry.parameters
    return StageMemory(
        held=frozenset(p.name for p in parameters
                       if stage.scope.get(stage.param_values[p.parameter_number]) == "step"),
        kept=frozenset(split.kept), in_flight=in_flight,
        not_temporary=frozenset(p.name for p in parameters)
        | frozenset(split_for_backward(stage, set()).kept))


def remat_figures(stage: "pl.StageModule", result) -> dict[Remat, LayerCost]:
    """The figures of a one-layer stage module under each recomputation mode."""
    layers = set(stage.layer_of.values())
    return {mode: stage_figures(stage, result, {layer: mode for layer in layers})
            for mode in REMAT_MODES}


def pipelined_peak(stage: "pl.StageModule", result, num_stages: int, index: int,
                   num_micro_batches: int) -> tuple[LayerCost, int, float]:
    """The stage's figures, the microbatches it holds under 1F1B, and its peak bytes per
    device: what the stage DP assumed and the plan reports."""
    figures = stage_figures(stage, result)
    in_flight = microbatches_in_flight(num_stages, index, num_micro_batches)
    return figures, in_flight, figures.held_bytes + in_flight * figures.activation_bytes


def _param_bytes(result, param) -> float:
    value = result.graph.values.get((param, ()))
    if value is None:
        return 0.0
    return value.sharding(result.solution.choice).tile_bytes(
        value.shape.dims, value.shape.element_bits, tuple(result.graph.mesh.shape))


# ---- parallel solves ------------------------------------------------------------------------

_TASKS: list = []  # filled before the pool forks, read by the workers


def _solve_task(k: int):
    return layer_cost(*_TASKS[k])


def solve_all(tasks: list[LayerTask], jobs: int | None, on_solved=None) -> list:
    """layer_cost of every task, on `jobs` processes (forked: the tasks, closures included,
    are inherited, not pickled); `on_solved()` after each. The workers die with this
    process, however it ends (SIGKILL included: a parent-death signal)."""
    global _TASKS
    jobs = jobs or os.cpu_count() or 1
    if jobs <= 1 or len(tasks) <= 1:
        out = []
        for t in tasks:
            out.append(layer_cost(*t))
            if on_solved:
                on_solved()
        return out
    _TASKS = tasks
    # the biggest first (2-D meshes have several times the strategies), so that no worker
    # is left with a long solve while the others idle
    order = sorted(range(len(tasks)), key=lambda k: -len(tasks[k].stage.module.entry.instructions)
                   * 4 ** sum(1 for n in tasks[k].mesh.shape if n > 1))
    out = [None] * len(tasks)
    try:
        with ProcessPoolExecutor(jobs, mp_context=get_context("fork"), initializer=die_with,
                                 initargs=(os.getpid(),)) as pool:
            for k, result in zip(order, pool.map(_solve_task, order)):
                out[k] = result
                if on_solved:
                    on_solved()
        return out
    finally:
        _TASKS = []
