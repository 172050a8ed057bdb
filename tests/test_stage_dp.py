"""Stage DP: exact against brute force, memory under 1F1B, laziness, pinning, speed."""

import itertools
import math
import random

import pytest

from alpac.interop.stage_dp import NoFeasiblePlan, StageCost, stage_dp
from alpac.interop.submesh import logical_shapes, place, submesh_shapes


def brute_force(L, shapes, configs, nodes, M, Bs, cost, fixed=None):
    """(objective, least memory any plan needs regardless of budget), over every partition,
    submesh and config per stage, and B."""
    best, least_memory = math.inf, math.inf
    options = [(m, c) for m in range(len(shapes)) for c in range(len(configs[m]))]
    partitions = [fixed] if fixed else [
        [(a, b - 1) for a, b in zip((0, *cuts), (*cuts, L))]
        for S in range(1, L + 1) for cuts in itertools.combinations(range(1, L), S - 1)]
    for ranges in partitions:
        S = len(ranges)
        for assign in itertools.product(options, repeat=S):
            if sum(shapes[m][0] * shapes[m][1] for m, _ in assign) != nodes * M:
                continue
            try:
                place([shapes[m] for m, _ in assign], nodes, M)
            except ValueError:
                continue
            for B in Bs:
                costs = [cost(i, j, m, c, B) for (i, j), (m, c) in zip(ranges, assign)]
                if None in costs:
                    continue
                need = [x.static_bytes + min(S - s, B) * x.activation_bytes
                        for s, x in enumerate(costs)]
                least_memory = min(least_memory, max(need))
                if all(n <= x.budget for n, x in zip(need, costs)):
                    t = [x.t for x in costs]
                    best = min(best, sum(t) + (B - 1) * max(t) + max(x.apply for x in costs))
    return best, least_memory


def random_costs(seed, budget=100.0, none_rate=0.15):
    rng = random.Random(seed)
    table = {}

    def cost(i, j, m, c, B):
        key = (i, j, m, c, B)
        if key not in table:
            if rng.random() < none_rate:
                table[key] = None
            else:
                table[key] = StageCost(t=rng.choice([1, 2, 3, 5, 8]) * (j - i + 1) / B,
                                       apply=rng.choice([0.0, 0.5, 1.0, 2.0]),
                                       static_bytes=rng.uniform(0, 60) * (j - i + 1) / 3,
                                       activation_bytes=rng.uniform(0, 30) / B,
                                       budget=budget)
        return table[key]
    return cost


CLUSTERS = [(2, 2), (1, 4)]


@pytest.mark.parametrize("nodes,M", CLUSTERS)
def test_equals_brute_force_on_small_random_instances(nodes, M):
    shapes = submesh_shapes(nodes, M)
    configs = [logical_shapes(s) for s in shapes]
    infeasible = 0
    for seed in range(40):
        L = 1 + seed % 5
        Bs = [[1], [1, 2], [2, 4, 3]][seed % 3]
        cost = random_costs(seed)
        want, least_memory = brute_force(L, shapes, configs, nodes, M, Bs, cost)
        try:
            plan = stage_dp(L, shapes, configs, nodes, M, Bs, cost)
        except NoFeasiblePlan as e:
            infeasible += 1
            assert want == math.inf
            assert e.min_memory == pytest.approx(least_memory if least_memory < math.inf else None)
            continue
        assert plan.objective == pytest.approx(want, rel=1e-12)
        check_plan(plan, L, shapes, nodes, M, cost)
    assert infeasible < 20


def check_plan(plan, L, shapes, nodes, M, cost):
    B, S = plan.num_micro_batches, len(plan.stages)
    assert plan.stages[0].first_layer == 0 and plan.stages[-1].last_layer == L - 1
    assert all(a.last_layer + 1 == b.first_layer for a, b in zip(plan.stages, plan.stages[1:]))
    devices = sorted(d for st in plan.stages for d in st.devices)
    assert devices == list(range(nodes * M))
    for s, st in enumerate(plan.stages):
        x = cost(st.first_layer, st.last_layer, st.submesh, st.config, B)
        assert (st.t, st.apply) == (x.t, x.apply)
        assert st.in_flight == min(S - s, B)
        assert st.memory == x.static_bytes + st.in_flight * x.activation_bytes <= x.budget
        assert len(st.devices) == shapes[st.submesh][0] * shapes[st.submesh][1]
        assert len({d // M for d in st.devices}) == shapes[st.submesh][0]
    t = [st.t for st in plan.stages]
    assert plan.stage_times == tuple(t)
    assert plan.objective == pytest.approx(sum(t) + (B - 1) * max(t)
                                           + max(st.apply for st in plan.stages))
    assert plan.stats.calls > 0 and plan.stats.thresholds > 0


def test_deterministic():
    shapes = submesh_shapes(2, 2)
    configs = [logical_shapes(s) for s in shapes]
    plans = [stage_dp(5, shapes, configs, 2, 2, [1, 2, 4], random_costs(3)) for _ in range(3)]
    assert len({(p.num_micro_batches, p.stages, p.objective) for p in plans}) == 1


def test_memory_bound_depends_on_the_stage_position():
    # Two one-device stages are faster, but the first holds min(2, B) microbatches: with B = 2
    # it does not fit and the plan falls back to one stage on both devices; with B = 1 it fits.
    shapes = [(1, 1), (1, 2)]

    def cost(i, j, m, c, B):
        if m == 0:
            return StageCost(t=1.0, apply=0.0, static_bytes=10, activation_bytes=50, budget=100)
        return StageCost(t=3.0, apply=0.0, static_bytes=10, activation_bytes=10, budget=100)

    for B, stages in ((2, 1), (1, 2)):
        plan = stage_dp(2, shapes, [[0], [0]], 1, 2, [B], cost)
        assert len(plan.stages) == stages
    plan = stage_dp(2, shapes, [[0], [0]], 1, 2, [1], cost)
    assert [st.in_flight for st in plan.stages] == [1, 1]
    assert [st.memory for st in plan.stages] == [60, 60]


def test_nothing_fits_reports_the_least_memory():
    shapes = submesh_shapes(1, 4)
    configs = [logical_shapes(s) for s in shapes]
    cost = random_costs(7, budget=1.0, none_rate=0.0)
    _, least_memory = brute_force(3, shapes, configs, 1, 4, [1, 2], cost)
    with pytest.raises(NoFeasiblePlan) as e:
        stage_dp(3, shapes, configs, 1, 4, [1, 2], cost)
    assert e.value.min_memory == pytest.approx(least_memory)
    assert "smallest memory per device" in str(e.value)


def test_no_plan_at_all():
    # One one-device submesh cannot make up a 4-device cluster with a single layer.
    with pytest.raises(NoFeasiblePlan) as e:
        stage_dp(1, [(1, 1)], [[0]], 1, 4, [1], random_costs(0, none_rate=0.0))
    assert e.value.min_memory is None


def test_pinned_stages_and_micro_batches():
    shapes = submesh_shapes(2, 2)
    configs = [logical_shapes(s) for s in shapes]
    cost = random_costs(11, budget=1e9)
    fixed = [(0, 1), (2, 4)]
    plan = stage_dp(5, shapes, configs, 2, 2, [1, 2, 4], cost, fixed_stages=fixed,
                    fixed_num_micro_batches=2)
    assert [(st.first_layer, st.last_layer) for st in plan.stages] == fixed
    assert plan.num_micro_batches == 2
    want, _ = brute_force(5, shapes, configs, 2, 2, [2], cost, fixed=fixed)
    assert plan.objective == pytest.approx(want)
    with pytest.raises(ValueError):
        stage_dp(5, shapes, configs, 2, 2, [1], cost, fixed_stages=[(0, 1), (3, 4)])


def test_lower_bounds_save_calls_and_change_nothing():
    shapes = submesh_shapes(2, 4)
    configs = [list(range(min(3, k * m))) for k, m in shapes]  # up to 3 logical meshes
    rng = random.Random(2)
    work = [rng.uniform(1, 3) for _ in range(12)]

    def cost(i, j, m, c, B):
        n = shapes[m][0] * shapes[m][1]
        t = sum(work[i:j + 1]) / n / B * (1 + 0.1 * c) + 0.01 * (n > 1)
        return StageCost(t=t, apply=0.01 * (j - i + 1) / n, static_bytes=0,
                         activation_bytes=0, budget=1)

    def bound(i, j, m, c, B):
        return sum(work[i:j + 1]) / (shapes[m][0] * shapes[m][1]) / B

    eager = stage_dp(12, shapes, configs, 2, 4, [1, 4, 8], cost)
    lazy = stage_dp(12, shapes, configs, 2, 4, [1, 4, 8], cost, lower_bound=bound)
    assert (lazy.num_micro_batches, lazy.stages, lazy.objective) == \
        (eager.num_micro_batches, eager.stages, eager.objective)
    assert lazy.stats.calls < eager.stats.calls / 3


def test_bubble_fraction_matches_the_analytic_anchor():
    # p equal stages, m microbatches: (p - 1) / (m + p - 1).
    plan = stage_dp(4, [(1, 1)], [[0]], 1, 4, [8],
                    lambda i, j, m, c, B: StageCost(1.0 if i == j else 9.0, 0.0, 0, 0, 1))
    assert len(plan.stages) == 4
    assert plan.bubble_fraction == pytest.approx(3 / 11)
    assert plan.objective == pytest.approx(4 + 7)


def test_50_layers_on_64_devices_make_a_deep_pipeline():
    # (its speed is a benchmark's: benchmarks/bench_compile.py times the stage DP)
    # Costs shaped like a real model: more devices per stage are less efficient (more so
    # across nodes), every layer has a fixed per-microbatch overhead, and activation memory
    # varies so that the 1F1B memory bound binds at many stage positions (a deep DP).
    nodes, M, L = 8, 8, 50
    shapes = submesh_shapes(nodes, M)
    configs = [list(range(min(3, k * m))) for k, m in shapes]  # up to 3 logical meshes
    assert sum(map(len, configs)) == 18
    rng = random.Random(0)
    prefix = [0.0, *itertools.accumulate(rng.uniform(0.8, 1.2) for _ in range(L))]
    noise = {}

    def cost(i, j, m, c, B):
        (k, w), layers = shapes[m], prefix[j + 1] - prefix[i]
        speed, act = noise.setdefault((i, j, m, c, B), (rng.uniform(1, 1.2), rng.uniform(.5, 2)))
        slow = 1 + 0.4 * math.log2(k) + 0.08 * math.log2(w) + 0.05 * c
        return StageCost(t=layers / (k * w) / B * speed * slow + 2e-3 * (j - i + 1),
                         apply=2e-3 * layers / (k * w), static_bytes=1e9 * layers / (k * w),
                         activation_bytes=0.5e9 * layers / (k * w) * act, budget=16e9)

    plan = stage_dp(L, shapes, configs, nodes, M, [1, 2, 4, 8, 16, 32, 64, 128], cost)
    assert sum(len(st.devices) for st in plan.stages) == 64
    assert len(plan.stages) > 8 and plan.stages[0].in_flight > 8
    print(f"\n50 layers on 8x8, {sum(map(len, configs))} configs, 8 B: "
          f"DP {plan.stats.seconds:.2f}s (+ callbacks {plan.stats.callback_seconds:.2f}s), "
          f"{plan.stats.calls} calls, {plan.stats.thresholds} thresholds, "
          f"{plan.stats.dp_runs} DP runs; B={plan.num_micro_batches}, "
          f"{len(plan.stages)} stages")


def test_submesh_shapes():
    assert submesh_shapes(8, 8) == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)]
    assert submesh_shapes(6, 8)[-3:] == [(2, 8), (4, 8), (6, 8)]  # the whole cluster too
    assert submesh_shapes(3, 8, "all")[-3:] == [(1, 8), (2, 8), (3, 8)]
    assert submesh_shapes(2, 6) == [(1, 1), (1, 2), (1, 6), (2, 6)]
    assert submesh_shapes(2, 6, "all") == [(1, 1), (1, 2), (1, 3), (1, 6), (2, 6)]
    assert submesh_shapes(1, 1) == [(1, 1)]
    with pytest.raises(ValueError):
        submesh_shapes(2, 8, "manual")


def test_logical_shapes():
    assert logical_shapes((1, 1)) == [(1,)]
    assert logical_shapes((1, 4)) == [(4,), (2, 2)]  # (1, 4) is (4,); inside a node
    assert logical_shapes((1, 8)) == [(8,), (4, 2)]  # (2, 4) prices as (4, 2)
    assert logical_shapes((2, 8)) == [(16,), (8, 2), (4, 4), (2, 8)]
    assert logical_shapes((2, 8), max_model_parallel=16)[-1] == (1, 16)
    assert logical_shapes((2, 6)) == [(12,), (6, 2), (4, 3), (2, 6)]


def test_place():
    assert place([(1, 2), (2, 4), (1, 1), (1, 1)], 3, 4) == \
        [[8, 9], [0, 1, 2, 3, 4, 5, 6, 7], [10], [11]]
    # first-fit decreasing packs partial submeshes node by node
    assert place([(1, 1), (1, 2), (1, 2), (1, 2), (1, 1)], 2, 4) == \
        [[6], [0, 1], [2, 3], [4, 5], [7]]
    with pytest.raises(ValueError):
        place([(2, 4), (1, 4)], 2, 4)  # too many devices
    with pytest.raises(ValueError):
        place([(1, 3), (1, 3), (1, 2)], 2, 4)  # 8 devices, but no node has 2 left
    with pytest.raises(ValueError):
        place([(2, 2)], 2, 4)  # part of two nodes


def test_model_parallel_axis_stays_in_a_node():
    nodes, M = 4, 8
    devices = place([(2, 8), (1, 4), (1, 4), (1, 8)], nodes, M)
    for (k, m), devs in zip([(2, 8), (1, 4), (1, 4), (1, 8)], devices):
        for dp, mp in (s for s in logical_shapes((k, m)) if len(s) == 2):
            rows = [devs[r * mp:(r + 1) * mp] for r in range(dp)]  # row-major
            assert all(len({d // M for d in row}) == 1 for row in rows)
