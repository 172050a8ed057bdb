"""What a pipeline stage costs, for the stage DP: per layer and logical mesh, the sharding ILP
on that layer's share of the step.

A layer's share is its forward and backward (run once per microbatch, with its gradient
accumulation) and the update of the parameters it owns (run once per step), cut out of the
microbatched step exactly as a one-layer stage would be. Its ILP gives:

  t        seconds per microbatch (forward + backward + accumulation)
  apply    seconds per step (the update)
  static   bytes per device kept all step (weights, optimizer state, accumulators)
  activation  bytes per device one microbatch keeps from its forward to its backward

A stage of layers i..j costs the sum over its layers plus sending its boundary activation
and gradient to the next stage. Layers whose share is the same program up to names (the
blocks of a transformer) are solved once per logical mesh. The ILP runs at two microbatch
counts; other counts are interpolated as a + b/B (exact while the shardings stay the same:
per-example work scales with the microbatch, weight-sized work does not).
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

from alpac import pipeline as pl
from alpac.autoshard import auto_shard
from alpac.hlo import print_module
from alpac.mesh import LogicalMesh


@dataclass(frozen=True)
class LayerCost:
    t: float
    apply: float
    static_bytes: float
    activation_bytes: float

    def __add__(self, other: "LayerCost") -> "LayerCost":
        return LayerCost(self.t + other.t, self.apply + other.apply,
                         self.static_bytes + other.static_bytes,
                         self.activation_bytes + other.activation_bytes)


def canonical_hash(module) -> str:
    """Identical for modules that differ only in names and metadata."""
    text = print_module(module)
    text = re.sub(r", metadata=\{[^{}]*\}", "", text)
    text = re.sub(r"^(ENTRY )?(%\S+) \(.*\) -> .* \{$", r"\1\2 {", text, flags=re.M)
    names: dict[str, str] = {}
    text = re.sub(r"%[\w.\-:]+", lambda m: names.setdefault(m.group(), f"%n{len(names)}"), text)
    return hashlib.sha256(text.encode()).hexdigest()


class LayerModules:
    """Each layer's share of the step, for a given number of microbatches."""

    def __init__(self, module, split, layer_of: dict[str, int], num_layers: int, B: int):
        self.B = B
        step = split.microbatch(B)
        self.graph = pl.step_graph(step, {x.name for x in split.forward}, layer_of,
                                   module.input_output_alias)
        self.layers: list[tuple[pl.StageModule, str]] = []
        for layer in range(num_layers):
            stage_of_layer = [0 if k < layer else 1 if k == layer else 2
                              for k in range(num_layers)]
            where, placed = pl.assign_stages(self.graph, stage_of_layer)
            stage = pl.stage_modules(self.graph, where, placed, 3, B, only=[1])[0]
            self.layers.append((stage, canonical_hash(stage.module)))


def layer_cost(stage: "pl.StageModule", mesh: LogicalMesh, cluster, time_limit: float
               ) -> LayerCost:
    result = auto_shard(stage.module, mesh, cluster, time_limit=time_limit,
                        repeats=stage.repeats)
    return stage_figures(stage, result)


def stage_figures(stage: "pl.StageModule", result) -> LayerCost:
    """Time per microbatch, update time, static and per-microbatch memory of a sharded stage
    module."""
    B = max(stage.repeats.values(), default=1.0)
    role = stage.role
    seconds = result.seconds_by(lambda name: role.get(name, "shared"))
    per_step = sum(v for k, v in seconds.items() if k in ("forward", "backward", "shared"))
    activation_names = _activations(stage)
    memory = result.bytes_by(lambda name: "activation" if name in activation_names else
                             "static" if role.get(name) in ("apply", None) else None)
    params = sum(_param_bytes(result, p) for p in result.graph.module.entry.parameters
                 if stage.scope.get(stage.param_values[p.parameter_number]) == "step")
    return LayerCost(per_step / B, seconds.get("apply", 0.0),
                     params + memory.get("static", 0.0), memory.get("activation", 0.0))


def _activations(stage) -> set[str]:
    """Forward nodes the backward reads: what a microbatch keeps between the two."""
    entry = stage.module.entry
    users = entry.users()
    return {x.name for x in entry.instructions if stage.role.get(x.name) == "forward"
            and any(stage.role.get(u.name) == "backward" for u in users[x])}


def _param_bytes(result, param) -> float:
    value = result.graph.values.get((param, ()))
    if value is None:
        return 0.0
    tile = value.sharding(result.solution.choice).tile_dims(value.shape.dims,
                                                             tuple(result.graph.mesh.shape))
    n = 1
    for d in tile:
        n *= d
    return (n * value.shape.element_bits + 7) // 8


# ---- parallel solves ------------------------------------------------------------------------

_TASKS: list = []  # filled before the pool forks, read by the workers


def _solve_task(k: int) -> LayerCost:
    stage, mesh, cluster, time_limit = _TASKS[k]
    return layer_cost(stage, mesh, cluster, time_limit)


def solve_all(tasks: list, jobs: int | None) -> list[LayerCost]:
    """layer_cost for every (stage, mesh, cluster, time_limit), on `jobs` processes."""
    global _TASKS
    jobs = jobs or os.cpu_count() or 1
    if jobs <= 1 or len(tasks) <= 1:
        return [layer_cost(*t) for t in tasks]
    _TASKS = tasks
    try:
        with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
            return list(pool.map(_solve_task, range(len(tasks))))
    finally:
        _TASKS = []
