"""The strategy ILP against brute force on small random graphs, with and without memory
budgets and ties, and the exactness of each graph reduction."""

from __future__ import annotations

import numpy as np
import pytest

from alpac.intraop.ilp import Infeasible, MemoryPoint, StrategyGraph, brute_force, reduce_graph, \
    solve


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
    best, best_value = brute_force(g)
    if best is None:
        with pytest.raises(Infeasible):
            solve(g)
        return
    sol = solve(g, gap_limit=0.0)
    assert g.feasible(sol.choice)
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
