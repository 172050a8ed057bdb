"""Split the program into pipeline stages and give each a submesh and a logical mesh.

With a mesh given, one stage runs the whole step on it (intra-operator parallelism only).
Otherwise (Alpa's inter-operator algorithm): cluster the forward pass into layers, price each
layer on every submesh and logical mesh with the sharding ILP (identical layers once, in
parallel), let the stage DP choose the stages, their meshes and the number of microbatches,
and build each stage's module for the final ILP. A step that cannot be microbatched exactly
runs as one stage with B = 1, and the assignment says why.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import NamedTuple

from alpac.analysis.costmodel import launch_seconds
from alpac.analysis.layerloops import find_layer_loops
from alpac.analysis.tripcount import while_trip_count
from alpac.errors import UserError
from alpac.hlo.opcodes import CONTRACTIONS
from alpac.interop import pipeline as pl
from alpac.interop.layers import choose_num_layers, cluster_layers, layer_owned
from alpac.interop.pricing import LayerModules, LayerTask, dividing_counts, solve_all
from alpac.interop.remat import REMAT_MODES, Remat
from alpac.interop.shard import ILP_GAP, ILP_TIME_LIMIT_S, shard_stages
from alpac.interop.stage import Stage, StageAssignment
from alpac.interop.stage_dp import NoFeasiblePlan, StagePlan, stage_dp
from alpac.interop.stage_prices import StageConfig, StagePrices, remat_variants
from alpac.interop.submesh import grid_shape, logical_shapes, pinned_submeshes, stage_submesh, \
    submesh_shapes
from alpac.interop.transfer_prices import TransferPrices
from alpac.interop.unroll import Unrolled
from alpac.intraop.rules import example_dims, parse_megatron, roles_of_step, rule, stage_rule
from alpac.plan.mesh import LogicalMesh


@dataclass(frozen=True)
class StageOptions:
    """How stages are chosen (the stage-construction pass's options)."""

    mesh: str = ""  # e.g. 2x4: one stage on that logical mesh, intra-op parallelism only
    micro_batches: int = 0  # number of microbatches (0: chosen among divisors of the batch)
    layers: int = 0  # number of layers (0: chosen)
    stages: str = ""  # pinned layer ranges, e.g. "0-3,4-7"
    stage_meshes: str = ""  # pinned submesh per stage, e.g. "1x2,1x2,1x4" (nodes x devices),
    # each optionally with its logical mesh, e.g. "1x4:2x2"
    jobs: int = 0  # parallel ILP solves (0: all cores)
    layer_time_limit: float = 5.0  # seconds per layer ILP (the DP needs costs, not proofs)
    max_micro_batches: int = 0  # the most microbatches to consider (0: up to the batch)
    strategy: str = ""  # data-parallel | zero2 | zero3 | megatron:dp=..,tp=..,pp=..
    remat: str = "auto"  # auto (the stage DP's choice per stage) | none | selective | full
    # seconds per stage ILP where candidate plans are solved whole to be compared (the
    # automatic plan on a shared host): `--time-limit`, as the intra-op pass's
    time_limit: float = ILP_TIME_LIMIT_S


class MeshConfig(NamedTuple):
    """A logical mesh shape for a submesh, and whether its weights and optimizer state are
    stored split (ZeRO-3: "lean", slower, for stages that do not fit otherwise)."""

    shape: tuple[int, ...]
    lean: bool


SINGLE_STAGE_STRATEGIES = ("data-parallel", "zero2", "zero3")
LOOPED_LAYERS = ("fewer than two dots or convolutions of the forward pass sit outside loops "
                 "(layers applied by a while/scan loop that is not a layer loop alpac can "
                 "unroll): pipeline stages cannot be cut inside it, so the step runs as one "
                 "stage")


def looped_layers(module) -> str:
    """Why a step whose layers a loop applies runs as one stage, naming the layer loops."""
    loops = find_layer_loops(module).loops
    if not loops:
        return LOOPED_LAYERS
    return (f"the layers are applied by loops ({'; '.join(x.describe() for x in loops)}) "
            f"that were not unrolled (alpac unrolls a forward layer loop with the backward "
            f"that reads it, in a step whose outputs are a flat tuple and whose cut arrays "
            f"alias alike): pipeline stages cannot be cut inside them, so the step runs as "
            f"one stage")


def construct_stages(module, split, costs, cluster, budget: float, options: StageOptions,
                     progress=None, stats: dict | None = None,
                     unrolled: Unrolled | None = None) -> StageAssignment:
    """The stages of the step (module docstring); a pipeline's figures and where its time
    goes are put in `stats`. `unrolled`: how `unroll-layer-loops` cut the layer loops (those
    kept one per stage of a forced pipeline are a layer each)."""
    per_stage = frozenset(unrolled.per_stage) if unrolled else frozenset()
    whole = _whole_program(module, cluster)
    if options.remat not in ("auto", *REMAT_MODES):
        raise UserError(f"--remat '{options.remat}' should be one of auto, "
                        f"{', '.join(REMAT_MODES)}")
    if options.remat not in ("auto", Remat.NONE) and (
            options.mesh or options.strategy in SINGLE_STAGE_STRATEGIES):
        raise UserError(f"--remat {options.remat} recomputes in the backward of pipeline "
                        f"stages; with --mesh or --strategy {options.strategy or 'given'} the "
                        f"step runs as one module (leave --remat out)")
    if options.strategy in SINGLE_STAGE_STRATEGIES:
        mesh = _mesh(options.mesh, cluster)
        stage = whole(mesh, rule(options.strategy, roles_of_step(module, split), mesh.shape))
        return StageAssignment((stage,), strategy=options.strategy)
    if options.strategy and not options.strategy.startswith("megatron"):
        rule(options.strategy, None, ())  # says what is expected
    if options.mesh:
        mesh = _mesh(options.mesh, cluster)
        cut = cluster.cut(mesh.num_devices)
        return StageAssignment((whole(mesh),), runs_on=None if cut is cluster else cut)
    reason = None if split is None else split.refusal
    if split is None or reason is not None or not split.backward:
        return StageAssignment((whole(_mesh("", cluster)),),
                               microbatching_refused=reason or "no training step found")
    if sum(heaviness(x, per_stage) for x in layer_anchored(split)) < 2:
        return StageAssignment((whole(_mesh("", cluster)),),
                               pipelining_refused=looped_layers(module))
    stats = {} if stats is None else stats
    searched = options.strategy or options.stages or options.stage_meshes
    if searched or not _shares_compute(cluster):
        return _whole_if_one(_Pipeliner(module, split, costs, cluster, budget, options,
                                        progress, stats, unrolled).run(), whole)
    return _fewer_devices(module, split, costs, cluster, budget, options, progress, stats,
                          unrolled)


def _whole_if_one(assignment: StageAssignment, whole) -> StageAssignment:
    """A pipeline of one stage and one microbatch that recomputes nothing is the whole step
    on that stage's mesh: one module per step (the `--mesh` plan of that mesh) instead of a
    forward, a backward and an update module with accumulators between them, which alpa-run
    runs 1.3-2.8x slower on small steps (`benchmarks/results/fidelity.md`)."""
    if len(assignment.stages) != 1 or assignment.micro_batches != 1 or assignment.strategy:
        return assignment
    stage = assignment.stages[0]
    if any(mode != Remat.NONE for mode in stage.pipeline_stage.remat.values()):
        return assignment  # the recomputation is what makes it fit
    return StageAssignment((whole(stage.mesh),), runs_on=assignment.runs_on)


def _shares_compute(cluster) -> bool:
    """Whether the cluster's devices share their hosts' cores (`devices_share_cores`)."""
    return cluster.calibration is not None and cluster.calibration.devices_share_cores


def _fewer_devices(module, split, costs, cluster, budget, options, progress, stats,
                   unrolled):
    """The automatic plan where devices share a host: Alpa's stage DP covers every device,
    but with fewer working each is faster, and a small model runs fastest on a few. The DP
    runs on the cluster cut to 1, 2, 4, ... devices and to all of them, and each of its
    assignments is priced as the plan it makes (its stages' ILPs, the plan's estimate): the
    DP's objective leaves out the host's work between stages and prices one stage as a
    forward, a backward and an update module where the plan runs the whole step as one (it
    chose two stages of one device each for the MLP at 4 ranks, estimated 1.6 ms against
    0.65 ms on one device). The least estimate wins (ties: more devices)."""
    from alpac.interop.emit import emit_plan
    best, tried = None, {}
    counts = sorted({d for d in (2 ** i for i in range(cluster.num_devices.bit_length()))
                     if cluster.cut(d) is not None} | {cluster.num_devices}, reverse=True)
    for devices in counts:
        cut, figures = cluster.cut(devices), {}
        try:
            assignment = _whole_if_one(_Pipeliner(module, split, costs, cut, budget, options,
                                                  progress, figures).run(),
                                       _whole_program(module, cut))
            sharded = shard_stages(assignment, cut, budget, options.time_limit, ILP_GAP,
                                   progress)
        except UserError:
            if devices == cluster.num_devices:
                raise
            continue  # does not fit on so few
        estimate = emit_plan(module, sharded, cut, unrolled).entries["estimate"]
        tried[devices] = estimate["iteration_time_s"]
        if best is None or tried[devices] < best[0]:
            best = (tried[devices], assignment, figures, sharded)
    _, assignment, figures, sharded = best
    stats.update(figures, devices_tried=tried)
    devices = sum(s.mesh.num_devices for s in assignment.stages)
    return dataclasses.replace(
        assignment, runs_on=None if devices == cluster.num_devices else cluster.cut(devices),
        solved=sharded, solved_with=(options.time_limit, ILP_GAP))


def _mesh(text: str, cluster) -> LogicalMesh:
    devices = range(cluster.num_devices)
    return LogicalMesh.parse(text, devices) if text else \
        LogicalMesh((cluster.num_devices,), tuple(devices))


def _whole_program(module, cluster):
    def whole(mesh: LogicalMesh, stage_rule=None) -> Stage:
        nodes = {cluster.node_of(d) for d in mesh.devices}
        return Stage(0, mesh, module, None, (len(nodes), mesh.num_devices // len(nodes)),
                     rule=stage_rule)
    return whole


def is_heavy(x) -> bool:
    """An instruction that anchors a layer: Alpa's layers are cut around dots and convolutions."""
    return x.opcode in CONTRACTIONS


def heaviness(x, per_stage: frozenset[str] = frozenset()) -> int:
    """How many layer anchors `x` counts for: a dot or a convolution one, a layer loop kept
    for one stage (`per_stage`) those of its body times its trip count."""
    if x.name in per_stage:
        body = x.called("body").instructions
        return sum(map(is_heavy, body)) * while_trip_count(x)[0]
    return int(is_heavy(x))


def layer_anchored(split) -> list:
    """The forward instructions that layers own (`layer_owned`), in order."""
    batch = {a.param for a in split.batch.args}
    owned = layer_owned(split.module.entry, lambda p: p.parameter_number in batch)
    return [x for x in split.forward if x in owned]


def cluster_into_layers(split, costs, num_layers: int = 0, multiple_of: int = 1,
                        per_stage: frozenset[str] = frozenset()) -> tuple[dict[str, int], int]:
    """Forward activations into layers (Alpa's layer construction), backward ones paired
    with the layer they differentiate; a chosen number of layers is a multiple of
    `multiple_of` (a forced pipeline's stages hold equally many). Values computed from inputs
    alone (masks, one-hot labels) are left out: every stage recomputes them, so they cross no
    cut. Layer loops kept one per stage (`per_stage`) are one operation each, as heavy as
    their iterations."""
    forward = layer_anchored(split)
    index = {x: i for i, x in enumerate(forward)}
    flops = [costs[x].flops if x in costs else 0.0 for x in forward]
    heavy = [heaviness(x, per_stage) for x in forward]
    edges = [(index[o], index[x], o.shape.byte_size) for x in forward for o in x.operands
             if o in index]
    if num_layers:
        n, clustering = num_layers, cluster_layers(flops, heavy, edges, num_layers)
    else:
        n, clustering = _cheapest_to_price(forward, flops, heavy, edges, multiple_of)
    forward_layer = dict(zip(forward, clustering.layer_of_op))
    for x in forward:  # an element of a tuple (a loop's results) goes with the tuple
        if x.opcode == "get-tuple-element" and x.operands[0] in forward_layer:
            forward_layer[x] = forward_layer[x.operands[0]]
    backward_layer = split.backward_layers(forward_layer)
    layer_of = {x.name: layer for x, layer in {**forward_layer, **backward_layer}.items()}
    return layer_of, n


_SOLVE_OVERHEAD_OPS = 50


def _cheapest_to_price(forward, flops, heavy, edges, multiple_of: int = 1):
    """The layer count near Alpa's choice whose layers cost the least to price. Layers that
    are the same program up to names are priced once; a layer's ILPs grow about
    quadratically with its size, plus a fixed cost per solve (counted as a layer of
    `_SOLVE_OVERHEAD_OPS` operations'): the least sum over the distinct layers, then more
    layers."""
    base = choose_num_layers(flops, heavy, edges)
    kinds: dict = {}  # (opcode, shape) -> a small number: a layer's signature is a run of them
    sig = [kinds.setdefault((x.opcode, x.shape.without_layout()), len(kinds)) for x in forward]
    best = None
    counts = [n for n in range(max(2, base // 2), min(sum(heavy), 2 * base, 128) + 1)
              if n % multiple_of == 0]
    if not counts:  # the largest multiple that has a heavy op per layer, if any
        counts = [max(multiple_of, sum(heavy) // multiple_of * multiple_of)]
    for n in counts:
        clustering = cluster_layers(flops, heavy, edges, n, least_largest=False)
        shapes = {tuple(sig[clustering.bounds[k]:clustering.bounds[k + 1]]) for k in range(n)}
        key = (sum(len(s) ** 2 + _SOLVE_OVERHEAD_OPS ** 2 for s in shapes), -n)
        if best is None or key < best[0]:
            best = (key, n)
    return best[1], cluster_layers(flops, heavy, edges, best[1])


class _Pipeliner:
    """Alpa's inter-operator pass over one training step, one method per phase: layers,
    mesh configs, layer ILPs (at two microbatch counts, and memory-lean variants), the stage
    DP, and the stages' modules."""

    def __init__(self, module, split, costs, cluster, budget, options: StageOptions, progress,
                 stats: dict, unrolled: Unrolled | None = None):
        self.module, self.split, self.costs, self.cluster = module, split, costs, cluster
        self.per_stage = frozenset(unrolled.per_stage) if unrolled else frozenset()
        self.layer_axes = unrolled.layer_axes() if unrolled else {}
        self.budget, self.options, self.on_progress = budget, options, progress
        self.stats, self.seconds, self.clock = stats, {}, time.perf_counter()
        self.forced = None  # (dp, tp, pp) of a forced Megatron strategy
        self.distributed_optimizer = False  # the forced strategy's optimizer state split
        self.launch = launch_seconds(cluster)
        self.solved, self.chosen, self.again = {}, {}, {}  # (layer hash, m, c) -> ...
        self.other_counts: dict[int, LayerModules] = {}  # B -> the distinct layers' modules

    def run(self) -> StageAssignment:
        self.cluster_layers()
        self.mesh_configs()
        self.price_layers()
        self.stats.update(self.figures())
        plan = self.stage_dp()
        return self.build(plan)

    def lap(self, what: str) -> None:
        now = time.perf_counter()
        self.seconds[what] = self.seconds.get(what, 0.0) + now - self.clock
        self.clock = now

    def cluster_layers(self) -> None:
        """Layers, the microbatch counts to consider, and each layer's module at a reference
        count."""
        strategy = self.options.strategy
        pp = parse_megatron(strategy, self.cluster.num_devices)[2] \
            if strategy.startswith("megatron") else 1
        self.layer_of, self.num_layers = cluster_into_layers(
            self.split, self.costs, pp if self.per_stage else self.options.layers, pp,
            self.per_stage)
        self.lap("layer clustering")
        batch = self.split.batch.size
        limit = min(batch, self.options.max_micro_batches or batch)
        self.candidates = [b for b in range(1, limit + 1) if batch % b == 0]
        if self.options.micro_batches:
            if batch % self.options.micro_batches:
                raise UserError(f"--micro-batches {self.options.micro_batches} does not divide "
                                f"the batch size {batch}")
            self.candidates = [self.options.micro_batches]
        self.reference = self.candidates[len(self.candidates) // 2]
        self.layers = LayerModules(self.module, self.split, self.layer_of, self.num_layers,
                                   self.reference)
        self.hashes = [self.layers.layers[k][1] for k in range(self.num_layers)]
        self.distinct = sorted(set(self.hashes))
        self.first_of = {h: self.hashes.index(h) for h in self.distinct}
        self.lap("layer modules")

    def mesh_configs(self) -> None:
        """Submesh shapes and the logical meshes of each (Megatron's grid only, if forced)."""
        cluster = self.cluster
        self.submeshes = submesh_shapes(cluster.nodes, cluster.devices_per_node)
        shapes = [logical_shapes(sm) for sm in self.submeshes]
        strategy = self.options.strategy
        self.examples = None
        if strategy.startswith("megatron"):
            self.examples = example_dims(self.split.module, self.split)
            dp, tp, pp, distributed = parse_megatron(strategy, cluster.num_devices)
            self.forced = (dp, tp, pp)
            self.distributed_optimizer = distributed
            # dp·tp devices on any number of whole nodes, or part of one (else no stage fits)
            forced = stage_submesh(dp * tp, cluster.devices_per_node)
            self.submeshes = [forced] if forced else [(1, 1)]
            shapes = [[g] if (g := grid_shape(sm, dp, tp)) else [] for sm in self.submeshes]
            if self.num_layers % pp:
                raise UserError(f"strategy {strategy}: {self.num_layers} layers do not split "
                                f"into {pp} equal stages (--layers sets the number)")
        self.pinned = _parse_ranges(self.options.stages, self.num_layers) \
            if self.options.stages else None
        if self.forced:
            size = self.num_layers // self.forced[2]
            self.pinned = [(k * size, (k + 1) * size - 1) for k in range(self.forced[2])]
        self.pinned_meshes = _pinned_meshes(self.options.stage_meshes, self.pinned)
        for extra in pinned_submeshes([p.submesh for p in self.pinned_meshes.values()],
                                      self.submeshes, cluster.nodes, cluster.devices_per_node):
            self.submeshes.append(extra)
            shapes.append(logical_shapes(extra))
        wanted = list(self.pinned_meshes.values())  # price only what some stage may use
        self.configs = [[MeshConfig(tuple(shape), False) for shape in cs
                         if not wanted or any(p.allows(sm, shape) for p in wanted)]
                        for sm, cs in zip(self.submeshes, shapes)]
        self.modes = (Remat(self.options.remat),) if self.options.remat != "auto" else REMAT_MODES

    def tasks(self, keys, layers: LayerModules, hint=None) -> list[LayerTask]:
        out = []
        for h, m, c in keys:
            stage = layers.layers[self.first_of[h]][0]
            config = self.configs[m][c]
            mesh = LogicalMesh(config.shape, tuple(range(self.submeshes[m][0]
                                                         * self.submeshes[m][1])))
            out.append(LayerTask(stage, mesh, self.cluster, self.options.layer_time_limit,
                                 hint[(h, m, c)] if hint else None,
                                 self.rule(stage, layers.graph, mesh, config.lean)))
        return out

    def rule(self, stage_module, graph, mesh, lean: bool):
        return stage_rule(stage_module, graph, mesh, self.forced is not None, lean,
                          self.distributed_optimizer, self.layer_axes, self.examples)

    def solve(self, keys, layers: LayerModules, what: str, hint=None) -> list:
        tasks = self.tasks(keys, layers, hint)
        done = iter(range(1, len(tasks) + 1))
        self.progress(f"layer ILPs ({what})", 0, len(tasks))
        return solve_all(tasks, self.options.jobs or None,
                         lambda: self.progress(f"layer ILPs ({what})", next(done), len(tasks)))

    def progress(self, what: str, done: int, total: int) -> None:
        if self.on_progress:
            self.on_progress(what, done, total)

    def price_layers(self) -> None:
        """Every distinct layer on every mesh config: at the reference microbatch count, its
        memory-lean variants where needed, and the same shardings at a second count."""
        self.keys = [(h, m, c) for h in self.distinct for m in range(len(self.submeshes))
                     for c in range(len(self.configs[m]))]
        self.record(self.keys, self.solve(self.keys, self.layers, f"{len(self.distinct)} "
                                          f"distinct layers, B={self.reference}"))
        self.lap("layer ILPs")
        if not self.forced:
            added = self.lean_variants()
            self.record(added, self.solve(added, self.layers, "memory-lean variants"))
            self.keys += added
            self.lap("memory-lean layer ILPs")
        self.price_second_point()

    def record(self, keys, results) -> None:
        self.solved.update({k: r[0] for k, r in zip(keys, results)})
        self.chosen.update({k: r[1] for k, r in zip(keys, results)})

    def lean_variants(self) -> list:
        """Lean configs where even a fair share of the model would not fit: the layers'
        static bytes times the config's share of the cluster, plus one microbatch's
        activations at the smallest microbatch."""
        added = []
        for m, (nodes, per_node) in enumerate(self.submeshes):
            share = nodes * per_node / self.cluster.num_devices
            for c in range(len(self.configs[m])):
                solved = [self.solved[(h, m, c)] for h in self.hashes]
                fair = sum(s[Remat.NONE].static_bytes * share + min(
                    s[mode].activation_bytes for mode in self.modes) * self.reference
                    / max(self.candidates) for s in solved) \
                    + max(s[Remat.NONE].transient_bytes for s in solved)
                if fair > self.budget and nodes * per_node > 1:
                    self.configs[m].append(MeshConfig(self.configs[m][c].shape, True))
                    added += [(h, m, len(self.configs[m]) - 1) for h in self.distinct]
        return added

    def price_second_point(self) -> None:
        """The counts at which each layer's shardings still divide (`dividing_counts`), and
        the same shardings at a second count, to interpolate what scales with the microbatch:
        the largest count above the reference at which they divide, else the smallest."""
        self.dividing = {k: frozenset([self.reference]) for k in self.keys}
        if len(self.candidates) == 1:
            return
        probe = self.layer_modules(min(self.candidates))  # never the reference
        seconds: dict[int, list] = {}
        for h, m, c in self.keys:
            counts = self.dividing[(h, m, c)] = dividing_counts(
                self.layers, probe, self.first_of[h], self.chosen[(h, m, c)],
                self.configs[m][c].shape, self.split.batch.size, self.candidates)
            second = max((B for B in counts if B > self.reference), default=probe.B)
            seconds.setdefault(second, []).append((h, m, c))
        self.lap("layer modules")
        for B, keys in sorted(seconds.items()):
            results = self.solve(keys, self.layer_modules(B), f"same shardings at B={B}",
                                 self.chosen)
            self.again.update({k: (B, r[0]) for k, r in zip(keys, results)})
            self.lap("second-point layer ILPs")

    def layer_modules(self, B: int) -> LayerModules:
        """The distinct layers' modules at B microbatches (built once per count)."""
        if B not in self.other_counts:
            self.other_counts[B] = LayerModules(self.module, self.split, self.layer_of,
                                                self.num_layers, B, sorted(self.first_of.values()))
        return self.other_counts[B]

    def figures(self) -> dict:
        """What the pricing did, and where the time goes (filled in until the end)."""
        return {"layers": self.num_layers, "distinct_layers": len(self.distinct),
                "layer_ilps": len(self.keys) * (2 if self.again else 1),
                "reference_micro_batches": self.reference, "seconds": self.seconds}

    def stage_dp(self) -> StagePlan:
        """The stage DP over the priced layers (pinned ranges when given or forced), each
        priced mesh config with each recomputation variant allowed."""
        n = self.num_layers
        variants = remat_variants(self.options.remat, min(n, self.cluster.num_devices,
                                                          max(self.candidates)))
        self.stage_configs = [[StageConfig(c, v) for c in range(len(cs)) for v in variants]
                              for cs in self.configs]
        transfers = TransferPrices(self.layers, self.hashes, self.chosen, self.configs,
                                   self.submeshes, self.cluster, self.reference)
        self.prices = StagePrices(self.hashes, self.solved, self.again, self.dividing,
                                  transfers, self.reference, self.budget, self.launch,
                                  [a * b for a, b in self.submeshes], self.cluster.num_devices)
        meshes = self.pinned_meshes

        def stage_cost(first, last, m, k, B):
            config = self.stage_configs[m][k]
            if meshes and not meshes[(first, last)].allows(
                    self.submeshes[m], self.configs[m][config.config].shape):
                return None
            return self.prices.stage_cost(first, last, m, config, B)

        cluster = self.cluster
        try:
            plan = stage_dp(n, self.submeshes, self.stage_configs, cluster.nodes,
                            cluster.devices_per_node, self.candidates, stage_cost,
                            fixed_stages=self.pinned,
                            admissible=self.prices.admissible(self.stage_configs))
        except NoFeasiblePlan as e:
            if e.min_memory is None:  # no stage may run anywhere (a forced grid that no
                # submesh has, e.g. tensor parallelism wider than a node)
                raise UserError(f"no stage assignment exists on cluster '{cluster.name}'"
                                + (f" for strategy {self.options.strategy}" if self.forced
                                   else "")) from None
            raise UserError(f"the model does not fit on cluster '{cluster.name}': the smallest "
                            f"memory per device alpac can reach is {e.min_memory:,.0f} bytes, "
                            f"the budget is {self.budget:,.0f} bytes") from None
        self.lap("stage DP")
        return plan

    def build(self, plan: StagePlan) -> StageAssignment:
        """The chosen stages' modules, meshes, hints from their layers' ILPs and filters."""
        B = plan.num_micro_batches
        chosen = [self.stage_configs[st.submesh][st.config] for st in plan.stages]
        configs = [self.configs[st.submesh][k.config] for st, k in zip(plan.stages, chosen)]
        remat = [self.prices.priced(st.first_layer, st.last_layer, st.submesh, k, B)[1]
                 for st, k in zip(plan.stages, chosen)]
        meshes = [LogicalMesh(cfg.shape, tuple(st.devices))
                  for st, cfg in zip(plan.stages, configs)]
        stage_of_layer = [next(s for s, st in enumerate(plan.stages)
                               if st.first_layer <= layer <= st.last_layer)
                          for layer in range(self.num_layers)]
        graph = self.layers.graph if B == self.reference else pl.step_graph(
            self.split.microbatch(B), {x.name for x in self.split.forward}, self.layer_of,
            self.module.input_output_alias)
        where, placed = pl.assign_stages(graph, stage_of_layer)
        modules = pl.stage_modules(graph, where, placed, len(meshes), B, remat=remat)
        stages = tuple(
            Stage(s, mesh, sm.module, (st.first_layer, st.last_layer),
                  self.submeshes[st.submesh], pipeline_stage=sm, hints=self.hints(st, k.config),
                  rule=self.rule(sm, graph, mesh, cfg.lean),
                  weights_stored_split=cfg.lean)
            for s, (st, mesh, sm, cfg, k) in enumerate(zip(plan.stages, meshes, modules,
                                                           configs, chosen)))
        self.lap("stage modules")
        summary = {"layers": self.num_layers, "objective_s": plan.objective,
                   "bubble_fraction": plan.bubble_fraction,
                   "stage_times_s": list(plan.stage_times),
                   "dp": {"calls": plan.stats.calls, "thresholds": plan.stats.thresholds}}
        return StageAssignment(stages, B, (graph, modules), summary,
                               self.options.strategy if self.forced else None)

    def hints(self, st, config: int) -> dict[str, object]:
        """Per instruction of the stage, the sharding its layer's ILP chose (None where two
        layers of the stage disagree: it stays free)."""
        hints: dict[str, object] = {}
        for layer in range(st.first_layer, st.last_layer + 1):
            names = [x.name for x in self.layers.layers[layer][0].module.entry.instructions]
            shards = self.chosen[(self.hashes[layer], st.submesh, config)]
            for name, sharding in zip(names, shards):
                if sharding is not None:
                    hints[name] = sharding if hints.get(name, sharding) == sharding else None
        return hints


def _pinned_meshes(text: str, ranges) -> dict:
    """`--stage-meshes 1x2,1x4:2x2` -> the PinnedMesh of each pinned layer range."""
    if not text:
        return {}
    parts = text.split(",")
    if ranges is None or len(parts) != len(ranges):
        raise UserError(f"--stage-meshes '{text}' needs --stages with as many layer ranges "
                        f"({len(parts)})")
    out = {}
    for part, key in zip(parts, ranges):
        sub, _, logical = part.partition(":")
        try:
            want = tuple(int(x) for x in sub.split("x"))
            shape = tuple(int(x) for x in logical.split("x")) if logical else None
        except ValueError:
            raise UserError(f"--stage-meshes '{text}': '{part}' should look like 1x4 or "
                            f"1x4:2x2 (nodes x devices per node[:logical mesh])") from None
        if len(want) != 2:
            raise UserError(f"--stage-meshes '{text}': '{sub}' should be nodes x devices "
                            f"per node, e.g. 1x4")
        out[key] = PinnedMesh(want, shape)
    return out


class PinnedMesh(NamedTuple):
    """A stage's submesh (nodes, devices per node) and, if given, its logical mesh."""

    submesh: tuple[int, ...]
    logical: tuple[int, ...] | None

    def allows(self, submesh, logical) -> bool:
        return tuple(submesh) == self.submesh and self.logical in (None, tuple(logical))


def _parse_ranges(text: str, num_layers: int) -> list[tuple[int, int]]:
    """`0-3,4-7` -> [(0, 3), (4, 7)], covering every layer in order."""
    ranges = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            ranges.append((int(first), int(last or first)))
    except ValueError:
        raise UserError(f"--stages '{text}' should look like 0-3,4-7 (layer ranges)") from None
    expected = 0
    for first, last in ranges:
        if first != expected or last < first:
            raise UserError(f"--stages '{text}' must cover layers 0..{num_layers - 1} in order "
                            f"without gaps")
        expected = last + 1
    if expected != num_layers:
        raise UserError(f"--stages '{text}' covers layers 0..{expected - 1}; the model has "
                        f"{num_layers} layers (--layers sets the number)")
    return ranges
