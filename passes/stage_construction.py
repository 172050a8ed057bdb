"""Split the program into pipeline stages and give each a submesh and a logical mesh.

With `mesh` set, one stage runs the whole step on that logical mesh (intra-operator
parallelism only). Otherwise: cluster the forward pass into layers, price each layer on every
submesh and logical mesh with the sharding ILP (identical layers once, in parallel), let the
stage DP choose the stages, their meshes and the number of microbatches, and build each
stage's module for the final ILP. A step that cannot be microbatched exactly runs as one
stage with B = 1, and the plan says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from alpac.errors import UserError
from alpac.layers import choose_num_layers, cluster_layers
from alpac.mesh import LogicalMesh
from alpac.passmanager import CompileContext, Pass
from alpac.stage import Stage
from alpac.stage_dp import NoFeasiblePlan, StageCost, stage_dp
from alpac.strategy_rules import (parse_megatron, roles_of_stage, roles_of_step, rule,
                                  update_rule)
from alpac.submesh import grid_shape, logical_shapes, submesh_shapes


@dataclass
class StageConstructionPass(Pass):
    name = "stage-construction"
    description = "choose pipeline stages, their submeshes and logical meshes, and B"
    requires = ("costs",)
    provides = ("stages",)
    mesh: str = ""  # e.g. 2x4: one stage on that logical mesh, intra-op parallelism only
    micro_batches: int = 0  # number of microbatches (0: chosen among divisors of the batch)
    layers: int = 0  # number of layers (0: chosen)
    stages: str = ""  # pinned layer ranges, e.g. "0-3,4-7"
    jobs: int = 0  # parallel ILP solves (0: all cores)
    layer_time_limit: float = 5.0  # seconds per layer ILP (the DP needs costs, not proofs)
    max_micro_batches: int = 128
    strategy: str = ""  # data-parallel | zero2 | zero3 | megatron:dp=..,tp=..,pp=..

    def run(self, ctx: CompileContext) -> None:
        module, cluster = ctx.module, ctx.cluster
        split = module.analyses.get("step")
        if self.strategy in ("data-parallel", "zero2", "zero3"):
            mesh = LogicalMesh.parse(self.mesh, range(cluster.num_devices)) if self.mesh else \
                LogicalMesh((cluster.num_devices,), tuple(range(cluster.num_devices)))
            stage = self.whole(ctx, mesh)
            stage.allow = rule(self.strategy, roles_of_step(module, split), mesh.shape)
            module.analyses["stages"] = [stage]
            ctx.plan["strategy"] = self.strategy
            return
        if self.strategy and not self.strategy.startswith("megatron"):
            rule(self.strategy, None, ())  # says what is expected
        if self.mesh:
            mesh = LogicalMesh.parse(self.mesh, range(cluster.num_devices))
            module.analyses["stages"] = [self.whole(ctx, mesh)]
            return
        reason = None if split is None else split.refusal
        if split is None or reason is not None or not split.backward:
            ctx.plan["microbatching"] = {"refused": reason or "no training step found"}
            mesh = LogicalMesh((cluster.num_devices,), tuple(range(cluster.num_devices)))
            module.analyses["stages"] = [self.whole(ctx, mesh)]
            return
        if sum(_is_heavy(x) for x in _activations(split)) < 2:
            ctx.plan["pipelining"] = {"refused": _LOOPED_LAYERS}
            mesh = LogicalMesh((cluster.num_devices,), tuple(range(cluster.num_devices)))
            module.analyses["stages"] = [self.whole(ctx, mesh)]
            return
        module.analyses["stages"] = self.pipeline(ctx, split)

    def whole(self, ctx: CompileContext, mesh: LogicalMesh) -> Stage:
        nodes = {ctx.cluster.node_of(d) for d in mesh.devices}
        return Stage(0, mesh, ctx.module, None, (len(nodes), mesh.num_devices // len(nodes)))

    # ---- the pipeline ------------------------------------------------------------------------
    def pipeline(self, ctx: CompileContext, split) -> list[Stage]:
        from alpac import pipeline as pl
        from alpac.stage_costs import LayerCost, LayerModules, RangeCosts, solve_all

        module, cluster = ctx.module, ctx.cluster
        costs = module.analyses["costs"]
        seconds: dict[str, float] = {}  # where the pass's time goes, for compile-stats.json
        clock = [time.perf_counter()]

        def lap(what: str) -> None:
            now = time.perf_counter()
            seconds[what] = seconds.get(what, 0.0) + now - clock[0]
            clock[0] = now

        layer_of, num_layers = self.cluster(split, costs)
        lap("layer clustering")
        batch = split.batch.size
        candidates = [b for b in _powers_of_two(min(batch, self.max_micro_batches))
                      if batch % b == 0]
        if self.micro_batches:
            if batch % self.micro_batches:
                raise UserError(f"--micro-batches {self.micro_batches} does not divide the "
                                f"batch size {batch}")
            candidates = [self.micro_batches]
        reference = candidates[len(candidates) // 2]
        layers = LayerModules(module, split, layer_of, num_layers, reference)
        lap("layer modules")
        submeshes = submesh_shapes(cluster.nodes, cluster.devices_per_node)
        configs = [logical_shapes(sm) for sm in submeshes]
        forced = None
        if self.strategy.startswith("megatron"):
            dp, tp, pp = parse_megatron(self.strategy, cluster.num_devices)
            forced = (dp, tp, pp)
            configs = [[g] if (g := grid_shape(sm, dp, tp)) else [] for sm in submeshes]
            if num_layers % pp:
                raise UserError(f"strategy {self.strategy}: {num_layers} layers do not split "
                                f"into {pp} equal stages (--layers sets the number)")
            ctx.plan["strategy"] = self.strategy
        hashes = [layers.layers[k][1] for k in range(num_layers)]
        distinct = sorted(set(hashes))
        first_of = {h: hashes.index(h) for h in distinct}
        budget = ctx.budget
        # a config is a logical mesh shape and whether its weights and optimizer state are
        # stored split (ZeRO-3: "lean", slower, for stages that do not fit otherwise)
        options = [[(tuple(shape), False) for shape in cs] for cs in configs]

        def layer_tasks(keys, B_layers, hint=None):
            out = []
            for h, m, c in keys:
                stage = B_layers.layers[first_of[h]][0]
                shape, lean = options[m][c]
                mesh = LogicalMesh(shape, tuple(range(submeshes[m][0] * submeshes[m][1])))
                out.append((stage, mesh, cluster, self.layer_time_limit,
                            hint[(h, m, c)] if hint else None,
                            _stage_rule(stage, B_layers.graph, mesh, forced is not None, lean)))
            return out

        def solve(tasks, what):
            done = iter(range(1, len(tasks) + 1))
            ctx.progress(f"layer ILPs ({what})", 0, len(tasks))
            return solve_all(tasks, self.jobs or None,
                             lambda: ctx.progress(f"layer ILPs ({what})", next(done), len(tasks)))

        keys = [(h, m, c) for h in distinct for m in range(len(submeshes))
                for c in range(len(options[m]))]
        results = solve(layer_tasks(keys, layers), f"{len(distinct)} distinct layers, "
                                                   f"B={reference}")
        solved = {k: r[0] for k, r in zip(keys, results)}
        chosen = {k: r[1] for k, r in zip(keys, results)}
        lap("layer ILPs")
        if not forced:
            # lean variants of the configs where even a fair share of the model would not
            # fit: the layers' static bytes times the config's share of the cluster, plus
            # one microbatch's activations at the smallest microbatch
            added = []
            for m in range(len(submeshes)):
                share = submeshes[m][0] * submeshes[m][1] / cluster.num_devices
                for c in range(len(options[m])):
                    fair = sum(solved[(h, m, c)].static_bytes * share + solved[(h, m, c)]
                               .activation_bytes * reference / max(candidates) for h in hashes) \
                        + max(solved[(h, m, c)].transient_bytes for h in hashes)
                    if fair > budget and submeshes[m][0] * submeshes[m][1] > 1:
                        options[m].append((options[m][c][0], True))
                        added += [(h, m, len(options[m]) - 1) for h in distinct]
            results = solve(layer_tasks(added, layers), "memory-lean variants")
            solved.update({k: r[0] for k, r in zip(added, results)})
            chosen.update({k: r[1] for k, r in zip(added, results)})
            keys += added
            lap("memory-lean layer ILPs")
        # the same shardings at a second microbatch count: what does and does not scale
        second = max(candidates) if max(candidates) != reference else min(candidates)
        again = {}
        if second != reference:
            layers2 = LayerModules(module, split, layer_of, num_layers, second,
                                   only=sorted(first_of.values()))
            lap("layer modules")
            results = solve(layer_tasks(keys, layers2, chosen), f"same shardings at B={second}")
            again = {k: r[0] for k, r in zip(keys, results)}
            lap("second-point layer ILPs")
        ctx.stats["stage_dp"] = {"layers": num_layers, "distinct_layers": len(distinct),
                                 "layer_ilps": len(keys) * (2 if again else 1),
                                 "reference_micro_batches": reference, "seconds": seconds}

        ranges: dict[tuple[int, int, int], RangeCosts] = {}  # (m, c, B) -> every range

        def stage_cost(first, last, m, c, B):
            if (m, c, B) not in ranges:
                ranges[(m, c, B)] = RangeCosts([
                    LayerCost.fit(reference, solved[key], second, again.get(key, solved[key]), B)
                    for key in ((h, m, c) for h in hashes)])
            total = ranges[(m, c, B)](first, last)
            return StageCost(total.t, total.apply, total.held_bytes, total.activation_bytes,
                             budget)

        pinned = _parse_ranges(self.stages, num_layers) if self.stages else None
        if forced:
            size = num_layers // forced[2]
            pinned = [(k * size, (k + 1) * size - 1) for k in range(forced[2])]
        try:
            plan = stage_dp(num_layers, submeshes, options, cluster.nodes,
                            cluster.devices_per_node, candidates, stage_cost,
                            fixed_stages=pinned)
        except NoFeasiblePlan as e:
            need = f"{e.min_memory:,.0f} bytes" if e.min_memory is not None else "more"
            raise UserError(f"the model does not fit on cluster '{cluster.name}': the smallest "
                            f"memory per device alpac can reach is {need}, the budget is "
                            f"{budget:,.0f} bytes") from None
        lap("stage DP")
        B = plan.num_micro_batches
        ctx.plan["num_micro_batches"] = B
        ctx.plan["pipeline"] = {
            "layers": num_layers, "objective_s": plan.objective,
            "bubble_fraction": plan.bubble_fraction, "stage_times_s": list(plan.stage_times),
            "dp": {"calls": plan.stats.calls, "thresholds": plan.stats.thresholds}}
        meshes = [LogicalMesh(options[st.submesh][st.config][0], tuple(st.devices))
                  for st in plan.stages]
        stage_of_layer = [next(s for s, st in enumerate(plan.stages)
                               if st.first_layer <= layer <= st.last_layer)
                          for layer in range(num_layers)]
        graph = layers.graph if B == reference else pl.step_graph(
            split.microbatch(B), {x.name for x in split.forward}, layer_of,
            module.input_output_alias)
        where, placed = pl.assign_stages(graph, stage_of_layer)
        modules = pl.stage_modules(graph, where, placed, len(meshes), B)
        module.analyses["pipeline"] = (graph, modules)
        stages = []
        for s, (st, mesh, sm) in enumerate(zip(plan.stages, meshes, modules)):
            hints: dict[str, object] = {}
            for layer in range(st.first_layer, st.last_layer + 1):
                names = [x.name for x in layers.layers[layer][0].module.entry.instructions]
                shards = chosen[(hashes[layer], st.submesh, st.config)]
                for name, sharding in zip(names, shards):
                    if sharding is not None:  # a node two layers disagree on stays free
                        hints[name] = sharding if hints.get(name, sharding) == sharding \
                            else None
            allow = _stage_rule(sm, graph, mesh, forced is not None,
                                options[st.submesh][st.config][1])
            stages.append(Stage(s, mesh, sm.module, (st.first_layer, st.last_layer),
                                submeshes[st.submesh], pipeline_stage=sm, hints=hints,
                                allow=allow,
                                weights_stored_split=options[st.submesh][st.config][1]))
        lap("stage modules")
        return stages

    def cluster(self, split, costs) -> tuple[dict[str, int], int]:
        """Forward activations into layers (Alpa's layer construction), backward ones paired
        with the layer they differentiate. Values computed from inputs alone (masks, one-hot
        labels) are left out: every stage recomputes them, so they cross no cut."""
        forward = _activations(split)
        index = {x: i for i, x in enumerate(forward)}
        flops = [costs[x].flops if x in costs else 0.0 for x in forward]
        heavy = [_is_heavy(x) for x in forward]
        edges = [(index[o], index[x], o.shape.byte_size) for x in forward for o in x.operands
                 if o in index]
        if self.layers:
            n, clustering = self.layers, cluster_layers(flops, heavy, edges, self.layers)
        else:
            n, clustering = _cheapest_to_price(forward, flops, heavy, edges)
        forward_layer = dict(zip(forward, clustering.layer_of_op))
        backward_layer = split.backward_layers(forward_layer)
        layer_of = {x.name: layer for x, layer in {**forward_layer, **backward_layer}.items()}
        return layer_of, n


def _stage_rule(stage_module, graph, mesh, megatron: bool, lean: bool):
    """The ILP filter of a stage (or layer) module: Megatron's when that strategy is forced,
    weights and optimizer state stored split when the option is lean, else None."""
    if not megatron and not lean:
        return None
    roles = roles_of_stage(stage_module, graph)
    allow = rule("megatron", roles, mesh.shape) if megatron else None
    return update_rule(roles, mesh.shape, "3", allow) if lean else allow


_SOLVE_OVERHEAD_OPS = 50
_LOOPED_LAYERS = ("fewer than two dots or convolutions of the forward pass sit outside loops "
                  "(layers applied by a while/scan loop): pipeline stages cannot be cut inside "
                  "a loop yet, so the step runs as one stage")


def _is_heavy(x) -> bool:
    """An instruction that anchors a layer: Alpa's layers are cut around dots and convolutions."""
    return x.opcode in ("dot", "convolution")


def _cheapest_to_price(forward, flops, heavy, edges):
    """The layer count near Alpa's choice whose layers cost the least to price. Layers that
    are the same program up to names are priced once; a layer's ILPs grow about
    quadratically with its size, plus a fixed cost per solve (counted as a layer of
    `_SOLVE_OVERHEAD_OPS` operations'): the least sum over the distinct layers, then more
    layers. Measured on GPT-2.6B (32 blocks, 64 devices), layer ILPs: 65 s at two blocks per
    layer, 40 s at one, 25 s at half a block; on GPT-39B (48 blocks) 36 s at one, 51 s at
    half a block, with five distinct layers instead of three."""
    base = choose_num_layers(flops, heavy, edges)
    best = None
    for n in range(max(2, base // 2), min(sum(heavy), 2 * base, 128) + 1):
        clustering = cluster_layers(flops, heavy, edges, n)
        shapes = {tuple((x.opcode, x.shape.without_layout())
                        for x in forward[clustering.bounds[k]:clustering.bounds[k + 1]])
                  for k in range(n)}
        key = (sum(len(s) ** 2 + _SOLVE_OVERHEAD_OPS ** 2 for s in shapes), -n)
        if best is None or key < best[0]:
            best = (key, n, clustering)
    return best[1], best[2]


def _activations(split) -> list:
    """The forward instructions that read both the batch and the weights."""
    batch = {a.param for a in split.batch.args}
    example, weights = set(), set()
    for x in split.module.entry.instructions:
        if x.opcode == "parameter":
            (example if x.parameter_number in batch else weights).add(x)
        else:
            if any(o in example for o in x.operands):
                example.add(x)
            if any(o in weights for o in x.operands):
                weights.add(x)
    return [x for x in split.forward if x in example and x in weights]


def _powers_of_two(limit: int) -> list[int]:
    out, b = [], 1
    while b <= limit:
        out.append(b)
        b *= 2
    return out


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
