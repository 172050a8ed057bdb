"""The strategy-selection ILP: a reduced `StrategyGraph` solved by SCIP to a proven gap, with a
greedy, locally improved warm start.

    minimise   Σ_v c_v·s_v + Σ_(u,v) Σ_ij C_uv[i,j]·e_uv[i,j]
    subject to Σ_i s_v[i] = 1,  s binary
               Σ_j e_uv[i,j] = s_u[i],  Σ_i e_uv[i,j] = s_v[j],  e ≥ 0   (tight marginals: with
               integral s they force e integral, and the LP is exact on trees)
               base_t + Σ_(v,m) m·s_v ≤ budget at every liveness point t
               (a point may add the largest of several such sums: a variable above each of
               them)
               s_u[i] ≤ Σ_{j: allowed[i,j]} s_v[j] and the mirror, for every tie

SCIP reads coefficients near 1 best and takes 1e20 for infinity: the objective is in
microseconds, unless its largest coefficient is outside what real ILPs have (a huge model on
a slow cluster, or a tiny one on a fast cluster), where it is scaled to about 1e6, its
coefficients above twice the warm start's objective (in no optimal solution) first cut to that
(`_scaled`); a memory coefficient above 1e6 budgets (a strategy that fits nowhere) is cut to
that. A cost that is not finite is refused in one line.
"""

from __future__ import annotations

import time

import numpy as np

from alpac.errors import UserError
from alpac.intraop.problem import Infeasible, Solution, StrategyGraph, Terms, terms_sum
from alpac.intraop.reduce import reduce_graph

TIME_SCALE = 1e6  # the ILP works in microseconds: SCIP's tolerances suit numbers near 1
# the largest objective coefficient of real ILPs, in microseconds, kept as it is (the same
# objective, so the same solutions, as before bounds were needed); outside, `_scaled`
OBJECTIVE_RANGE = (1e-3, 1e9)
OBJECTIVE_LARGEST = 1e6  # where `_scaled` puts the largest coefficient outside that range
MEMORY_COEFFICIENT_MAX = 1e6  # in budgets: any above 1 already fits nowhere


def greedy(graph: StrategyGraph) -> list[int]:
    """Each node in order takes the strategy cheapest given the nodes already chosen: the warm
    start handed to the solver."""
    choice: list[int] = []
    earlier: dict[int, list[tuple[int, np.ndarray]]] = {}
    for (u, v), m in graph.edges.items():
        earlier.setdefault(v, []).append((u, m))
    for v, c in enumerate(graph.node_costs):
        total = c.copy()
        for u, m in earlier.get(v, []):
            total = total + m[choice[u]]
        for a, b, allowed in graph.ties:
            if b == v and a < v:
                total = np.where(allowed[choice[a]], total, np.inf)
            elif a == v and b < v:
                total = np.where(allowed[:, choice[b]], total, np.inf)
        choice.append(int(np.argmin(total)))
    return _improve(graph, choice)


def _improve(graph: StrategyGraph, choice: list[int], rounds: int = 20) -> list[int]:
    """Local search on the greedy choice: each node without ties in turn takes its best
    strategy given all its neighbours, until nothing changes. A good incumbent lets SCIP stop
    at the gap as soon as its bound is good enough."""
    tied = {u for u, _, _ in graph.ties} | {v for _, v, _ in graph.ties}
    rows: dict[int, list] = {}  # node -> (neighbour, matrix as [own, neighbour's])
    for (u, v), m in graph.edges.items():
        rows.setdefault(u, []).append((v, m))
        rows.setdefault(v, []).append((u, m.T))
    start, choice = choice, list(choice)
    for _ in range(rounds):
        changed = False
        for v, c in enumerate(graph.node_costs):
            if v in tied or len(c) <= 1:
                continue
            total = c.copy()
            for u, m in rows.get(v, ()):
                total = total + m[:, choice[u]]
            best = int(np.argmin(total))
            if total[best] < total[choice[v]] - 1e-15:
                choice[v] = best
                changed = True
        if not changed:
            break
    if graph.budget is not None and not graph.feasible(choice) and graph.feasible(start):
        return start  # the search ignores memory; keep the greedy choice that fits
    return choice


def solve(graph: StrategyGraph, *, time_limit: float = 60.0, gap_limit: float = 1e-4,
          seed: int = 0) -> Solution:
    """Reduce, then solve with SCIP; the same input gives the same solution."""
    start = time.perf_counter()
    _check_finite(graph)
    reduced = reduce_graph(graph)
    choice, status, gap = _solve_scip(reduced.graph, time_limit, gap_limit, seed)
    if choice is None:
        raise Infeasible(min_peak_memory(graph))
    full = reduced.expand(choice)
    return Solution(full, graph.objective(full), status, gap, time.perf_counter() - start,
                    graph.size, reduced.graph.size, graph.peak_memory(full))


def _new_model(name: str, time_limit: float, seed: int = 0):
    from pyscipopt import SCIP_PARAMSETTING, Model

    model = Model(name)
    model.hideOutput()
    model.setParam("limits/time", max(time_limit, 0.1))
    model.setParam("randomization/randomseedshift", seed)
    model.setParam("lp/threads", 1)
    model.setParam("parallel/maxnthreads", 1)
    # Ctrl-C stays Python's: SCIP's own handler ends the solve with its best solution so far
    # (the compile went on and wrote a plan), and one arriving as a solve ends is lost; so
    # the interrupt is raised when the solve returns, within its time limit
    model.setParam("misc/catchctrlc", False)
    model.setPresolve(SCIP_PARAMSETTING.FAST)
    # the marginal formulation's LP bound is already tight and the caller hands in a warm
    # start: cutting planes and primal heuristics cost more than they find (GPT layer ILPs on
    # 2-D meshes reach the same optimum in about half the time without them)
    model.setSeparating(SCIP_PARAMSETTING.OFF)
    model.setHeuristics(SCIP_PARAMSETTING.OFF)
    return model


def _one_hot_vars(model, g: StrategyGraph):
    from pyscipopt import quicksum

    s = []
    for v, c in enumerate(g.node_costs):
        xs = [model.addVar(f"s{v}_{i}", vtype="B") for i in range(len(c))]
        model.addCons(quicksum(xs) == 1)
        s.append(xs)
    for u, v, allowed in g.ties:
        for i in range(allowed.shape[0]):
            model.addCons(s[u][i] <= quicksum(s[v][j] for j in np.flatnonzero(allowed[i])))
        for j in range(allowed.shape[1]):
            model.addCons(s[v][j] <= quicksum(s[u][i] for i in np.flatnonzero(allowed[:, j])))
    return s


def _solve_scip(g: StrategyGraph, time_limit: float, gap_limit: float, seed: int):
    if not g.node_costs:
        if g.budget is not None and any(p.base > g.budget * (1 + 1e-9)
                                        for p in g.memory_points):
            return None, "infeasible", 1.0
        return [], "optimal", 0.0
    lp = _LpText()
    s = [[lp.binary(f"s{v}_{i}") for i in range(len(c))] for v, c in enumerate(g.node_costs)]
    for xs in s:
        lp.row([(1.0, x) for x in xs], "=", 1.0)
    for u, v, allowed in g.ties:
        for i in range(allowed.shape[0]):
            lp.row([(1.0, s[u][i])] + [(-1.0, s[v][j]) for j in np.flatnonzero(allowed[i])],
                   "<=", 0.0)
        for j in range(allowed.shape[1]):
            lp.row([(1.0, s[v][j])] + [(-1.0, s[u][i]) for i in np.flatnonzero(allowed[:, j])],
                   "<=", 0.0)
    objective = [(float(c[i]), s[v][i]) for v, c in enumerate(g.node_costs)  # seconds
                 for i in range(len(c)) if c[i] != 0]
    edge_vars = []  # (u, v, strategy -> row group, strategy -> column group, variables)
    for (u, v), m in sorted(g.edges.items()):
        low = float(m.min())  # shifting a matrix by a constant does not change the argmin
        if low:
            objective.extend((low, x) for x in s[u])
        # strategies with identical rows (columns) cost the same against every partner:
        # one edge variable per pair of groups keeps the marginals exact and the LP small
        rows, row_of = np.unique(m, axis=0, return_inverse=True)
        cols, col_of = np.unique(rows, axis=1, return_inverse=True)
        row_of, col_of = row_of.reshape(-1), col_of.reshape(-1)
        n_rows, n_cols = cols.shape
        e = [[lp.continuous(f"e{u}_{v}_{r}_{c}") for c in range(n_cols)] for r in range(n_rows)]
        edge_vars.append((u, v, row_of, col_of, e))
        for r in range(n_rows):
            lp.row([(1.0, x) for x in e[r]] + [(-1.0, s[u][i])
                                               for i in np.flatnonzero(row_of == r)], "=", 0.0)
        for c in range(n_cols):
            lp.row([(1.0, e[r][c]) for r in range(n_rows)] +
                   [(-1.0, s[v][j]) for j in np.flatnonzero(col_of == c)], "=", 0.0)
        objective.extend((float(cols[r, c]) - low, e[r][c])
                         for r in range(n_rows) for c in range(n_cols) if cols[r, c] > low)
    tops = []  # (variable, its memory point)
    if g.budget is not None:
        for k, p in enumerate(g.memory_points):
            room = 1.0 - p.base / g.budget
            if room < -1e-9:
                return None, "infeasible", 1.0
            row = _memory_row(p.terms, s, g.budget)
            if p.largest:  # a variable at least each sum, in fractions of the budget
                top = lp.continuous(f"largest{k}")
                tops.append((top, p))
                for c, terms in p.largest:
                    lp.row(_memory_row(terms, s, g.budget) + [(-1.0, top)], "<=",
                           max(-c / g.budget, -MEMORY_COEFFICIENT_MAX))
                row.append((1.0, top))
            if row:
                lp.row(row, "<=", room)
    model = _new_model("alpac-sharding", time_limit, seed)
    model.setParam("limits/gap", gap_limit)
    warm = greedy(g)
    lp.load(model, _scaled(objective, g, warm if g.feasible(warm) else None))
    by_name = {x.name: x for x in model.getVars()}
    if g.feasible(warm):  # a complete solution (edge variables too): SCIP need not finish it
        sol = model.createSol()
        for v, i in enumerate(warm):
            for k, name in enumerate(s[v]):
                model.setSolVal(sol, by_name[name], 1.0 if k == i else 0.0)
        for u, v, row_of, col_of, e in edge_vars:
            r, c = row_of[warm[u]], col_of[warm[v]]
            for rr, row in enumerate(e):
                for cc, name in enumerate(row):
                    model.setSolVal(sol, by_name[name], 1.0 if (rr, cc) == (r, c) else 0.0)
        for top, p in tops:
            top_bytes = max(c + terms_sum(t, warm) for c, t in p.largest)
            model.setSolVal(sol, by_name[top], top_bytes / g.budget)
        model.addSol(sol)
    model.optimize()
    if model.getNSols() == 0:
        return None, "infeasible", 1.0
    best = model.getBestSol()
    choice = [int(np.argmax([model.getSolVal(best, by_name[x]) for x in xs])) for xs in s]
    status = {"optimal": "optimal", "gaplimit": "gap_limit", "timelimit": "time_limit"}.get(
        model.getStatus(), model.getStatus())
    gap = float(model.getGap())
    return choice, status, gap if np.isfinite(gap) else 1.0


def _memory_row(terms: Terms, s, budget: float) -> list:
    return [(min(float(m[i]) / budget, MEMORY_COEFFICIENT_MAX), s[v][i])
            for v, m in terms for i in range(len(m)) if m[i] > 0]


def _scaled(objective: list, g: StrategyGraph, warm: list[int] | None) -> list:
    """The objective's (seconds, variable) terms as the ILP's coefficients: microseconds where
    the largest is in OBJECTIVE_RANGE (every real ILP), else scaled so that the largest is
    OBJECTIVE_LARGEST, once every coefficient above twice the objective of `warm` (a feasible
    solution, or None) is cut to that: none of them is in an optimal solution, before or after
    (the coefficients are not negative), and the cut keeps them within SCIP's infinity and
    the others apart."""
    largest = max((abs(c) for c, _ in objective), default=0.0)
    low, high = OBJECTIVE_RANGE
    if largest == 0 or low <= largest * TIME_SCALE <= high:
        return [(c * TIME_SCALE, x) for c, x in objective]
    if warm is not None and all(c >= 0 for c, _ in objective):
        bound = sum(float(c[warm[v]]) for v, c in enumerate(g.node_costs)) + sum(
            float(m[warm[u], warm[v]]) for (u, v), m in g.edges.items())
        cap = 2 * bound if bound > 0 else min(c for c, _ in objective if c > 0)
        objective = [(min(c, cap), x) for c, x in objective]
        largest = max(c for c, _ in objective)
    factor = OBJECTIVE_LARGEST / largest
    return [(c * factor, x) for c, x in objective]


def _check_finite(g: StrategyGraph) -> None:
    """UserError, in one line, where a cost or a memory figure is not a finite number (figures
    past float's range, or inf - inf): the ILP could not be written."""
    arrays = [("seconds", c) for c in g.node_costs] + [("seconds", m) for m in g.edges.values()]
    kept = {id(m): m for p in g.memory_points for terms in p.term_lists() for _, m in terms}
    arrays += [("bytes", m) for m in kept.values()]  # points share their nodes' arrays
    arrays.append(("bytes", np.array([p.base for p in g.memory_points]
                                     + [c for p in g.memory_points for c, _ in p.largest])))
    for unit, a in arrays:
        bad = a[~np.isfinite(a)]
        if bad.size:
            raise UserError(f"a sharding strategy is priced at {bad[0]} {unit}, which the "
                            f"sharding ILP cannot solve with; the cluster's figures or the "
                            f"model's shapes are out of range")


class _LpText:
    """An ILP written as CPLEX LP text, which SCIP reads in C: building a model of 10^5
    variables through the Python API costs seconds, writing the text a fraction of that."""

    def __init__(self):
        self.rows: list[str] = []
        self.binaries: list[str] = []
        self.continuous_vars: list[str] = []

    def binary(self, name: str) -> str:
        self.binaries.append(name)
        return name

    def continuous(self, name: str) -> str:
        self.continuous_vars.append(name)
        return name

    def row(self, terms, sense: str, rhs: float) -> None:
        body = " ".join(f"{c:+.17g} {x}" for c, x in terms)
        self.rows.append(f" r{len(self.rows)}: {body} {sense} {rhs:.17g}")

    def load(self, model, objective) -> None:
        import os
        import tempfile

        text = ["Minimize", " obj: " + (" ".join(f"{c:+.17g} {x}" for c, x in objective)
                                          or "0 " + self.binaries[0]),
                "Subject To", *self.rows, "Bounds",
                *(f" 0 <= {x} <= 1" for x in self.continuous_vars),
                "Binary", *(f" {x}" for x in self.binaries), "End"]
        fd, path = tempfile.mkstemp(suffix=".lp", prefix="alpac-ilp-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(text) + "\n")
            model.readProblem(path)
        finally:
            os.unlink(path)


def min_peak_memory(graph: StrategyGraph, time_limit: float = 30.0) -> float:
    """The smallest per-device peak memory that any assignment respecting the ties reaches."""
    from pyscipopt import quicksum

    model = _new_model("alpac-min-memory", time_limit)
    s = _one_hot_vars(model, graph)
    peak = model.addVar("peak", lb=0.0)
    scale = max([p.base for p in graph.memory_points]
                + [float(m.max()) for p in graph.memory_points for terms in p.term_lists()
                   for _, m in terms] + [1.0])

    def total(terms):
        return quicksum(float(m[i]) / scale * s[v][i] for v, m in terms for i in range(len(m)))

    for k, p in enumerate(graph.memory_points):
        top = 0.0
        if p.largest:
            top = model.addVar(f"largest{k}", lb=0.0)
            for c, terms in p.largest:
                model.addCons(c / scale + total(terms) <= top)
        model.addCons(p.base / scale + total(p.terms) + top <= peak)
    model.setObjective(peak)
    model.optimize()
    return float(model.getObjVal()) * scale if model.getNSols() else float("inf")
