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


def _costs(rng, shape, low: float, high: float) -> np.ndarray:
    return 10.0 ** rng.uniform(low, high, size=shape)


@pytest.mark.parametrize("seed", range(16))
def test_ilp_with_costs_from_1e_12_to_1e25_seconds_equals_brute_force(seed):
    """Costs past SCIP's infinity (1e20, in the ILP's microseconds) beside costs of a
    picosecond, as a huge model on a slow cluster gives (they were "SCIP: read error!"):
    spread over the whole range; every strategy but one per node huge (the optimum is then
    all small, and the huge ones must not hide the differences between the small ones); all
    small (past the other end); all huge. With and without budgets and ties."""
    rng = np.random.default_rng(300 + seed)
    g = random_graph(rng, int(rng.integers(3, 10)), budget_fraction=[None, 0.5][seed % 2],
                     with_ties=seed % 4 == 1)
    kind = seed % 4
    if kind == 0:
        g.node_costs = [_costs(rng, c.shape, -12, 25) for c in g.node_costs]
        g.edges = {k: _costs(rng, m.shape, -12, 25) for k, m in g.edges.items()}
    elif kind == 1:
        for c in g.node_costs:
            c[:] = _costs(rng, c.shape, 15, 25)
            c[0] = _costs(rng, (), -12, -10)
        for m in g.edges.values():
            m[:] = _costs(rng, m.shape, 15, 25)
            m[0, 0] = _costs(rng, (), -12, -10)
    else:
        low, high = (-12, -10) if kind == 2 else (18, 25)
        g.node_costs = [_costs(rng, c.shape, low, high) for c in g.node_costs]
        g.edges = {k: _costs(rng, m.shape, low, high) for k, m in g.edges.items()}
    assert_solves_as_brute_force(g)


@pytest.mark.parametrize("seed", range(6))
def test_ilp_tells_picoseconds_apart_beside_reshardings_of_1e25_seconds(seed):
    """Every pair of 5 nodes adjacent (nothing reduces), each node's 3 strategies a few
    picoseconds, every resharding (a pair of different strategies) 1e19 to 1e25 s: the
    optimum is one strategy for all, and which one only the picoseconds tell. Scaling alone
    would put them below SCIP's epsilon; the huge costs, in no optimal solution, are cut
    first."""
    rng = np.random.default_rng(400 + seed)
    g = StrategyGraph()
    for _ in range(5):
        g.add_node(_costs(rng, 3, -12, -10))
    for v in range(5):
        for u in range(v):
            m = _costs(rng, (3, 3), 19, 25)
            np.fill_diagonal(m, _costs(rng, 3, -12, -10))
            g.add_edge(u, v, m)
    assert reduce_graph(g).graph.size["nodes"] == 5
    assert_solves_as_brute_force(g)


def test_ilp_objective_of_real_costs_is_in_microseconds_as_it_was():
    from alpac.intraop.ilp import TIME_SCALE, _scaled
    g = StrategyGraph()
    g.add_node([0.0, 1e-3])
    terms = [(2.5e-6, "a"), (1e-3, "b"), (7e-9, "c")]
    assert _scaled(terms, g, [0]) == [(c * TIME_SCALE, x) for c, x in terms]


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_cost_that_is_not_finite_is_refused_in_one_line(bad):
    from alpac.errors import UserError
    g = StrategyGraph()
    a = g.add_node([0.0, 1.0])
    b = g.add_node([1.0, 2.0])
    g.add_edge(a, b, [[0.0, bad], [1.0, 0.0]])
    with pytest.raises(UserError, match=f"priced at {bad} seconds") as info:
        solve(g)
    assert "\n" not in str(info.value)


def test_ctrl_c_during_a_solve_is_raised_not_swallowed():
    """SCIP would catch SIGINT itself and return its best solution so far, taken for a plan:
    Ctrl-C 3 s into a 300-node problem under a tight budget (it runs to its 8 s time limit)
    is raised as KeyboardInterrupt when the solve returns."""
    import os
    import signal
    import subprocess
    import time

    graph = random_graph(np.random.default_rng(1), 300, budget_fraction=0.1)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # even if run ignoring it
    # from another process, as a terminal sends it (SCIP's handler does not see a signal a
    # thread of this process sends itself)
    ctrl_c = subprocess.Popen(["sh", "-c", f"sleep 3; kill -INT {os.getpid()}"])
    start = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            solve(graph, time_limit=8, gap_limit=0.0)
    finally:
        ctrl_c.wait()
        signal.signal(signal.SIGINT, before)
    assert 3.0 <= time.perf_counter() - start < 30
