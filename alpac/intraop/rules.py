"""Fixed strategies as filters on the sharding ILP's choices, priced by the same cost model.

A rule sees each source instruction's candidate strategy and says whether it may be chosen:

- data-parallel: batch inputs split over every mesh axis on their batch dimension, weights and
  optimizer state replicated;
- zero2: data parallel, the optimizer state split over every mesh axis (the ILP then
  reduce-scatters gradients and all-gathers the updated weights, ZeRO stage 2);
- zero3: zero2 with the weights stored split too (gathered where they are used);
- megatron: batch inputs split over the first axis (data parallel), weight matrices, their
  optimizer state and gradient accumulators split over the last axis on one of their
  dimensions (tensor parallel), vectors replicated; a stage's piece of a stacked array
  (several layers' rows) is its layers' matrices or vectors, never split on the layer axis;
  a layer's input from the layer before (an activation) replicated over the
  tensor-parallel axis and split at most over the data-parallel one, on its batch
  dimension, as each of Megatron's replicas holds its own examples.

What counts as a weight and what as optimizer state comes from the step's structure: a state
parameter the per-microbatch part reads is a weight; one only the update reads is optimizer
state.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from alpac.errors import UserError
from alpac.plan.program import Role

KINDS = ("data-parallel", "zero2", "zero3", "megatron")


@dataclass(frozen=True)
class Roles:
    """Parameter names by what they hold."""

    batch: dict[str, int]  # batch input -> batch dimension
    weights: frozenset[str]
    optimizer_state: frozenset[str]
    example_dims: dict[str, int] | None = None  # per-example instruction -> its batch dim
    accumulators: frozenset[str] = frozenset()  # a pipeline stage's gradient accumulators
    # a parameter holding several layers' rows of a stacked array -> its layer axis
    layer_axes: dict[str, int] | None = None
    # per-microbatch values computed by another layer or stage (activations, their gradients)
    # -> their batch dimension (None: not known)
    activations: dict[str, int | None] | None = None


def roles_of_step(module, split) -> Roles:
    """Roles of the entry parameters of a whole (unpipelined) step."""
    batch_dims = {a.param: a.dim for a in split.batch.args}
    per_microbatch = {id(x) for x in split.parts.get("microbatch", [])}
    users = module.entry.users()
    batch, weights, state = {}, set(), set()
    for p in module.entry.parameters:
        if p.parameter_number in batch_dims:
            batch[p.name] = batch_dims[p.parameter_number]
        elif any(id(u) in per_microbatch for u in users[p]):
            weights.add(p.name)
        else:
            state.add(p.name)
    return Roles(batch, frozenset(weights), frozenset(state), example_dims(module, split))


def example_dims(module, split) -> dict[str, int]:
    """Instruction name -> its batch dimension, for the per-example values of the step (a
    stage's modules keep their names)."""
    example = {}
    for x in module.entry.instructions:
        c = split.cls(x)
        if getattr(c, "kind", None) == "S":
            example[x.name] = c.dim
    return example


def roles_of_stage(stage_module, graph, layer_axes: dict[str, int] | None = None,
                   examples: dict[str, int] | None = None) -> Roles:
    """Roles of the parameters of one pipeline stage's module; `layer_axes`: program input
    value -> its layer axis, for a stage's piece of a stacked array (`Unrolled.layer_axes`);
    `examples`: the step's `example_dims`."""
    entry = stage_module.module.entry
    users = entry.users()
    batch, weights, state, accumulators, activations = {}, set(), set(), set(), {}
    microbatch = _microbatch_size(graph)
    for p in entry.parameters:
        value = stage_module.param_values[p.parameter_number]
        if value.startswith("acc"):
            accumulators.add(p.name)
            continue
        if value.endswith(".mb"):
            dim = next((d for v, _, d in graph.param_values.values() if v == value), None)
            if dim is not None:
                batch[p.name] = dim
            continue
        if not value.startswith("arg"):
            if stage_module.scope.get(value) == "microbatch":
                activations[p.name] = _batch_dim(p.shape.dims, microbatch)
            continue
        readers = {stage_module.role.get(u.name) for u in users[p]}
        (weights if readers & {Role.FORWARD, Role.BACKWARD} else state).add(p.name)
    stacked = {p.name: (layer_axes or {})[v] for p in entry.parameters
               if (v := stage_module.param_values[p.parameter_number]) in (layer_axes or {})}
    return Roles(batch, frozenset(weights), frozenset(state), examples,
                 frozenset(accumulators), stacked, activations)


def _microbatch_size(graph) -> int | None:
    """Examples in one microbatch: a microbatch slice's size on its batch dimension."""
    for p in graph.module.entry.parameters:
        dim = graph.param_values[p.name][2]
        if dim is not None:
            return p.shape.dims[dim]
    return None


def _batch_dim(dims, examples: int | None) -> int | None:
    """An activation's batch dimension: the first of the microbatch's size, else the first
    that holds whole microbatches (examples flattened with another dimension); None when
    neither or unknown."""
    if not examples:
        return None
    return next((d for d, n in enumerate(dims) if n == examples),
                next((d for d, n in enumerate(dims) if n % examples == 0), None))


def rule(kind: str, roles: Roles, mesh_shape):
    """allow(instr, leaf index, strategy) for `kind` (see the module docstring)."""
    if kind not in KINDS:
        raise UserError(f"unknown strategy '{kind}'; expected one of {', '.join(KINDS)} "
                        f"(megatron as megatron:dp=..,tp=..,pp=..)")
    axes = tuple(a for a, n in enumerate(mesh_shape) if n > 1)
    total = 1
    for a in axes:
        total *= mesh_shape[a]
    # Megatron's mesh is (dp,) or (dp, tp): the batch over the first axis, weights over the
    # second (an axis of size 1 splits nothing)
    dp_axes = (0,) if mesh_shape and mesh_shape[0] > 1 else ()
    tp_axes = (1,) if len(mesh_shape) == 2 and mesh_shape[1] > 1 else ()

    def allow(instr, idx, strategy) -> bool:
        if idx != ():
            return True
        s = strategy.outputs[0]
        name = instr.name
        if instr.opcode != "parameter":
            # data parallelism keeps every per-example value split on its batch dimension,
            # over every axis (Megatron's: over the data-parallel axis first)
            dim = (roles.example_dims or {}).get(name)
            if dim is None or instr.shape.is_tuple or dim >= instr.shape.rank:
                return True
            n = instr.shape.dims[dim]
            if kind == "megatron":
                return not dp_axes or n % mesh_shape[0] != 0 or \
                    s.dim_axes[dim][:1] == dp_axes
            return n % total != 0 or s.dim_axes[dim] == axes
        if name in roles.batch:
            dim = roles.batch[name]
            want_axes = dp_axes if kind == "megatron" else axes
            return s.dim_axes == tuple(want_axes if d == dim else ()
                                       for d in range(instr.shape.rank))
        if kind == "megatron":
            # weight matrices, their optimizer state and gradient accumulators split alike
            # over the last axis (a stack of them on a dimension of each matrix, never on the
            # layer axis)
            layer_axis = (roles.layer_axes or {}).get(name)
            rank = instr.shape.rank - (layer_axis is not None)
            held = roles.weights | roles.optimizer_state | roles.accumulators
            if name in held and rank >= 2 and tp_axes:
                return tuple(sorted(s.used_axes)) == tp_axes and \
                    sum(1 for a in s.dim_axes if a) == 1 and \
                    (layer_axis is None or not s.dim_axes[layer_axis])
            if name in (roles.activations or {}):
                dim = roles.activations[name]
                return s.is_replicated or not s.partial and \
                    tuple(sorted(s.used_axes)) == dp_axes and \
                    sum(1 for a in s.dim_axes if a) == 1 and (dim is None or s.dim_axes[dim])
            return s.is_replicated
        sharded = name in roles.optimizer_state and kind in ("zero2", "zero3") or \
            name in roles.weights and kind == "zero3"
        if sharded:
            return _split_everywhere(s, instr.shape, mesh_shape)
        return s.is_replicated

    return allow


def update_rule(roles: Roles, mesh_shape, zero: str, base=None):
    """The reduce-scatter rewrite's filter on top of `base` (a plan's own filter, or None).
    zero="auto": each optimizer-state parameter either as `base` allows or split as many ways
    as the mesh allows, so the ILP rewrites exactly the chains where that is no slower;
    "2": every optimizer-state parameter split (ZeRO-2); "3": the weights and gradient
    accumulators too (ZeRO-3: every step-long array divided over the mesh)."""
    forced = set(roles.optimizer_state) if zero in ("2", "3") else set()
    if zero == "3":
        forced |= set(roles.weights) | set(roles.accumulators)
    optional = set(roles.optimizer_state) - forced

    def allow(instr, idx, strategy) -> bool:
        name = instr.name
        if instr.opcode == "parameter" and idx == () and (name in forced or name in optional):
            split = _split_everywhere(strategy.outputs[0], instr.shape, mesh_shape)
            if split or name in forced:
                return split
        return base is None or base(instr, idx, strategy)

    return allow


def keep_to(hints: dict | None):
    """A filter keeping each hinted instruction (by name) to the sharding its hint names."""
    if not hints:
        return None

    def allow(instr, idx, strategy) -> bool:
        wanted = hints.get(instr.name)
        return wanted is None or idx != () or strategy.outputs[0] == wanted

    return allow


def both(first, second):
    """Both filters (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda instr, idx, strategy: first(instr, idx, strategy) and \
        second(instr, idx, strategy)


def _split_everywhere(sharding, shape, mesh_shape) -> bool:
    """Split as many ways as an array of this shape can be on the mesh."""
    return sharding.num_tiles(mesh_shape) == _most_tiles(tuple(shape.dims), tuple(mesh_shape))


@cache  # asked for every strategy of every parameter the rules look at
def _most_tiles(dims, mesh_shape) -> int:
    """The most ways an array of these dims can be split on this mesh (evenly)."""
    from alpac.intraop.space import array_shardings
    return max((s.num_tiles(mesh_shape) for s in array_shardings(tuple(dims), tuple(mesh_shape))),
               default=1)


MEGATRON_KEYS = ("dp", "tp", "pp", "distopt")


def parse_megatron(text: str, num_devices: int) -> tuple[int, int, int, bool]:
    """`megatron:dp=2,tp=4,pp=2[,distopt=1]` -> (dp, tp, pp, distributed optimizer),
    checked against the device count. The distributed optimizer (Megatron-LM's
    `--use-distributed-optimizer`) stores the optimizer state split over the stage's devices."""
    values = {}
    try:
        for part in text.split(":", 1)[1].split(","):
            key, _, value = part.partition("=")
            values[key.strip()] = int(value)
    except (IndexError, ValueError):
        raise UserError(f"strategy '{text}' should look like megatron:dp=2,tp=4,pp=1") from None
    unknown = set(values) - set(MEGATRON_KEYS)
    if unknown:
        raise UserError(f"strategy '{text}': unknown {', '.join(sorted(unknown))} (expected "
                        f"{', '.join(MEGATRON_KEYS)})")
    dp, tp, pp = values.get("dp", 1), values.get("tp", 1), values.get("pp", 1)
    if dp * tp * pp != num_devices:
        raise UserError(f"strategy '{text}': dp·tp·pp = {dp * tp * pp}, the cluster has "
                        f"{num_devices} devices")
    return dp, tp, pp, bool(values.get("distopt", 0))


def stage_rule(stage_module, graph, mesh, megatron: bool, lean: bool,
               distributed_optimizer: bool = False, layer_axes: dict[str, int] | None = None,
               examples: dict[str, int] | None = None):
    """The ILP filter of a stage (or layer) module: Megatron's when that strategy is forced
    (with its optimizer state split, if asked), weights and optimizer state stored split
    when the option is lean, else None. `examples`: the step's per-example values."""
    if not megatron and not lean:
        return None
    roles = roles_of_stage(stage_module, graph, layer_axes, examples)
    allow = rule("megatron", roles, mesh.shape) if megatron else None
    if lean or distributed_optimizer:
        return update_rule(roles, mesh.shape, "3" if lean else "2", allow)
    return allow
