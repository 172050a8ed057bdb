"""The strategy ILP against brute force on small random graphs, with and without memory
budgets and ties, and the exactness of each graph reduction."""

from __future__ import annotations

import numpy as np
import pytest

from alpac.intraop.ilp import solve
from alpac.intraop.problem import Infeasible, MemoryPoint, StrategyGraph, brute_force
from alpac.intraop.reduce import reduce_graph


def random_graph(rng, n_nodes, budget_fraction=None, with_ties=False, structured=False):
    g = StrategyGraph()
    sizes = rng.integers(1, 5, size=n_nodes)
    for n in sizes:
        g.add_node(rng.uniform(0, 1e-3, size=n))
    for v in range(1, n_nodes):
        for u in rng.choice(v, size=min(v, rng.integers(1, 3)), replace=False):
            m = rng.uniform(0, 2e-3, size=(sizes[u], sizes[v]))
            if structured:  # zero diagonal-like, separable or all-zero matrices appear too
                kind = rng.integers(0, 3)
                if kind == 0:
                    m = np.zeros_like(m)
                elif kind == 1:
                    m = rng.uniform(0, 1e-3, size=(sizes[u], 1)) + rng.uniform(0, 1e-3, size=(1, sizes[v]))
            g.add_edge(int(u), v, m)
    mem = [rng.uniform(1e6, 1e7, size=n) for n in sizes]
    for t in range(n_nodes):
        live = [v for v in range(n_nodes) if abs(v - t) <= 2]
        g.memory_points.append(MemoryPoint(float(rng.uniform(0, 1e6)),
                                           [(v, mem[v]) for v in live]))
    if budget_fraction is not None:
        low = max(p.base + sum(m.min() for _, m in p.terms) for p in g.memory_points)
        high = max(p.base + sum(m.max() for _, m in p.terms) for p in g.memory_points)
        g.budget = low + budget_fraction * (high - low)
    if with_ties:
        for _ in range(2):
            u, v = sorted(rng.choice(n_nodes, size=2, replace=False))
            allowed = rng.random((sizes[u], sizes[v])) < 0.5
            allowed[0, 0] = True
            g.ties.append((int(u), int(v), allowed))
    return g


@pytest.mark.parametrize("seed", range(40))
def test_ilp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 13))
    g = random_graph(rng, n, budget_fraction=[None, 0.2, 0.5][seed % 3],
                     with_ties=seed % 4 == 0, structured=seed % 2 == 0)
    assert_solves_as_brute_force(g)


def assert_solves_as_brute_force(g: StrategyGraph) -> None:
    """The ILP's solution fits and costs what exhaustive search finds (infeasible alike)."""
    best, best_value = brute_force(g)
    if best is None:
        with pytest.raises(Infeasible):
            solve(g)
        return
    sol = solve(g, gap_limit=0.0)
    assert g.feasible(sol.choice)
    assert g.budget is None or sol.peak_memory <= g.budget * (1 + 1e-9)
    assert sol.objective == pytest.approx(best_value, rel=1e-7, abs=1e-12)
    assert sol.status == "optimal"


def test_reduction_is_exact_and_shrinks():
    rng = np.random.default_rng(7)
    for _ in range(20):
        g = random_graph(rng, 8, structured=True)
        reduced = reduce_graph(g)
        _, full_best = brute_force(g)
        choice, red_best = brute_force(reduced.graph)
        assert g.objective(reduced.expand(choice)) == pytest.approx(full_best, rel=1e-9)
        assert reduced.graph.size["edges"] <= g.size["edges"]


def test_deterministic():
    rng = np.random.default_rng(3)
    g = random_graph(rng, 12, budget_fraction=0.3)
    assert solve(g).choice == solve(g).choice


def test_impossible_budget_reports_smallest_peak():
    g = StrategyGraph(budget=10.0)
    a = g.add_node([0.0, 1.0])
    g.memory_points.append(MemoryPoint(5.0, [(a, np.array([100.0, 40.0]))]))
    with pytest.raises(Infeasible) as info:
        solve(g)
    assert info.value.min_peak == pytest.approx(45.0)


@pytest.mark.parametrize("seed", range(12))
def test_ilp_with_a_largest_temporary_equals_brute_force(seed):
    """A pipeline stage's memory point: what it holds, plus the largest of its temporaries
    (a variable above each of them in the ILP)."""
    rng = np.random.default_rng(100 + seed)
    g = random_graph(rng, int(rng.integers(3, 10)), structured=seed % 2 == 0)
    sizes = [len(c) for c in g.node_costs]
    n = len(sizes)
    held = [(v, rng.uniform(1e6, 1e7, size=sizes[v])) for v in range(0, n, 2)]
    temporaries = [(float(rng.uniform(0, 2e6)), [(v, rng.uniform(1e6, 2e7, size=sizes[v]))])
                   for v in range(1, n)]
    g.memory_points = [MemoryPoint(1e6, held, temporaries)]
    peaks = sorted(g.peak_memory([int(rng.integers(0, s)) for s in sizes]) for _ in range(64))
    g.budget = peaks[len(peaks) // 3]
    assert_solves_as_brute_force(g)


def test_smallest_peak_counts_the_largest_temporary():
    g = StrategyGraph(budget=10.0)
    a = g.add_node([0.0, 1.0])
    b = g.add_node([0.0, 1.0])
    g.memory_points.append(MemoryPoint(5.0, [(a, np.array([100.0, 40.0]))],
                                       [(0.0, [(b, np.array([30.0, 20.0]))]),
                                        (25.0, [])]))
    with pytest.raises(Infeasible) as info:
        solve(g)
    assert info.value.min_peak == pytest.approx(5 + 40 + 25)
