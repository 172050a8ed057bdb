"""The strategy-selection ILP, independent of HLO: nodes with one cost per strategy, pairwise
edge cost matrices, memory at liveness points, and ties — reduced, then solved by SCIP to a
proven gap.

    minimise   Σ_v c_v·s_v + Σ_(u,v) Σ_ij C_uv[i,j]·e_uv[i,j]
    subject to Σ_i s_v[i] = 1,  s binary
               Σ_j e_uv[i,j] = s_u[i],  Σ_i e_uv[i,j] = s_v[j],  e ≥ 0   (tight marginals: with
               integral s they force e integral, and the LP is exact on trees)
               base_t + Σ_(v,m) m·s_v ≤ budget at every liveness point t
               (a point may add the largest of several such sums, a temporary of which one
               is live at a time: a variable above each of them)
               s_u[i] ≤ Σ_{j: allowed[i,j]} s_v[j] and the mirror, for every tie
               (aliased parameters and outputs, loop state that must keep one sharding)

Reduction before solving, each exact: edges whose matrix is zero or separable
(C[i,j] = a_i + b_j) fold into node costs; strategies that another strategy of the same node
matches or beats in cost, in every edge row and (under a budget) in memory are dropped; nodes
left with one strategy become constants; repeated memory points are dropped.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

TIME_SCALE = 1e6  # the ILP works in microseconds: SCIP's tolerances suit numbers near 1
_EPS = 1e-15


Terms = list[tuple[int, np.ndarray]]  # per node, the bytes each of its strategies keeps


@dataclass
class MemoryPoint:
    """Bytes per device live at one point of the schedule: a constant plus, per node, the bytes
    each of its strategies keeps; plus the largest of `largest` (constant, terms) sums, where
    one of several temporaries is live (a pipeline stage's judged peak)."""

    base: float
    terms: Terms
    largest: list[tuple[float, Terms]] = field(default_factory=list)

    def value(self, choice) -> float:
        return self.base + _sum(self.terms, choice) + max(
            (c + _sum(t, choice) for c, t in self.largest), default=0.0)

    def term_lists(self) -> list[Terms]:
        return [self.terms] + [t for _, t in self.largest]


def _sum(terms: Terms, choice) -> float:
    return sum(float(m[choice[v]]) for v, m in terms)


@dataclass
class StrategyGraph:
    node_costs: list[np.ndarray] = field(default_factory=list)  # seconds per strategy
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # [S_u, S_v], u < v
    memory_points: list[MemoryPoint] = field(default_factory=list)
    ties: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # bool [S_u, S_v]
    budget: float | None = None  # bytes per device
    constant: float = 0.0  # seconds that no choice changes

    def add_node(self, costs) -> int:
        self.node_costs.append(np.asarray(costs, dtype=float))
        return len(self.node_costs) - 1

    def add_edge(self, u: int, v: int, matrix) -> None:
        matrix = np.asarray(matrix, dtype=float)
        if u == v:
            self.node_costs[u] = self.node_costs[u] + np.diag(matrix)
            return
        if u > v:
            u, v, matrix = v, u, matrix.T
        old = self.edges.get((u, v))
        self.edges[(u, v)] = matrix if old is None else old + matrix

    def objective(self, choice) -> float:
        total = self.constant + sum(float(c[choice[v]]) for v, c in enumerate(self.node_costs))
        return total + sum(float(m[choice[u], choice[v]]) for (u, v), m in self.edges.items())

    def peak_memory(self, choice) -> float:
        return max((p.value(choice) for p in self.memory_points), default=0.0)

    def feasible(self, choice) -> bool:
        if any(not allowed[choice[u], choice[v]] for u, v, allowed in self.ties):
            return False
        return self.budget is None or self.peak_memory(choice) <= self.budget * (1 + 1e-9)

    @property
    def size(self) -> dict:
        return {"nodes": len(self.node_costs),
                "strategies": int(sum(len(c) for c in self.node_costs)),
                "edges": len(self.edges),
                "edge_entries": int(sum(m.size for m in self.edges.values())),
                "memory_points": len(self.memory_points)}


@dataclass
class Solution:
    choice: list[int]
    objective: float  # seconds
    status: str  # optimal | gap_limit | time_limit
    gap: float
    solve_time: float
    size_before: dict
    size_after: dict
    peak_memory: float


class Infeasible(Exception):
    """No assignment fits the budget; `min_peak` is the smallest peak that any reaches."""

    def __init__(self, min_peak: float):
        super().__init__(f"no sharding fits the memory budget; the smallest per-device peak "
                         f"alpac can reach is {min_peak:,.0f} bytes")
        self.min_peak = min_peak


# ---- reduction -------------------------------------------------------------------------------

@dataclass
class Reduced:
    graph: StrategyGraph
    keep: list[np.ndarray]  # per original node: its original strategy indices still in play
    index: dict[int, int]  # original node -> node of the reduced graph
    eliminated: list[tuple]  # (v, u, w, table) in elimination order, see `expand`

    def expand(self, choice: list[int]) -> list[int]:
        """Original strategy indices of every original node for a reduced-graph choice."""
        full = [int(k[0]) for k in self.keep]
        for v, new in self.index.items():
            full[v] = int(self.keep[v][choice[new]])
        for v, u, w, table in reversed(self.eliminated):
            if u is None:
                full[v] = int(table)
            elif w is None:
                full[v] = int(table[full[u]])
            else:
                full[v] = int(table[full[u], full[w]])
        return full


def reduce_graph(graph: StrategyGraph) -> Reduced:
    return _Reducer(graph).run()


class _Reducer:
    """Exact reductions, repeated until nothing changes (see the module docstring), plus
    elimination of nodes that no memory point or tie involves: a node with one neighbour folds
    into it (min over its strategies), a node with two into an edge between them."""

    def __init__(self, graph: StrategyGraph):
        self.graph = graph
        self.keep = [np.arange(len(c)) for c in graph.node_costs]
        self.costs = [c.copy() for c in graph.node_costs]
        self.edges = {k: m.copy() for k, m in graph.edges.items()}
        self.points = [MemoryPoint(p.base, _copy(p.terms),
                                   [(c, _copy(t)) for c, t in p.largest])
                       for p in graph.memory_points]
        self.tied = {u for u, _, _ in graph.ties} | {v for _, v, _ in graph.ties}
        self.use_memory = graph.budget is not None
        self.term_at: dict[int, list[tuple[Terms, int]]] = {}  # node -> its memory terms
        for p in self.points:
            for terms in p.term_lists():
                for j, (v, _) in enumerate(terms):
                    self.term_at.setdefault(v, []).append((terms, j))
        self.in_memory = set(self.term_at) if self.use_memory else set()
        self.alive = set(range(len(self.costs)))
        self.eliminated: list[tuple] = []

    def incident(self) -> dict[int, list[tuple[tuple[int, int], int]]]:
        out: dict[int, list] = {v: [] for v in self.alive}
        for key in self.edges:
            out[key[0]].append((key, 0))
            out[key[1]].append((key, 1))
        return out

    def fold_separable(self) -> bool:
        changed = False
        for (u, v), m in list(self.edges.items()):
            a = m[:, :1] - m[:1, :1]
            b = m[:1, :]
            if np.allclose(m, a + b, rtol=0, atol=_EPS + 1e-12 * float(np.abs(m).max())):
                self.costs[u] = self.costs[u] + a[:, 0]
                self.costs[v] = self.costs[v] + b[0]
                del self.edges[(u, v)]
                changed = True
        return changed

    def drop_dominated(self) -> bool:
        changed = False
        incident = self.incident()
        for v in sorted(self.alive):
            if v in self.tied or len(self.costs[v]) <= 1:
                continue
            columns = [self.costs[v][:, None]]
            columns += [self.edges[k] if side == 0 else self.edges[k].T
                        for k, side in incident[v]]
            # memory also without a budget: of two equally fast strategies the smaller stays
            columns += [terms[j][1][:, None] for terms, j in self.term_at.get(v, ())]
            drop = _dominated(np.hstack(columns))
            if not drop.any():
                continue
            mask = ~drop
            self.keep[v], self.costs[v] = self.keep[v][mask], self.costs[v][mask]
            for k, side in incident[v]:
                self.edges[k] = self.edges[k][mask] if side == 0 else self.edges[k][:, mask]
            for terms, j in self.term_at.get(v, ()):
                terms[j] = (v, terms[j][1][mask])
            changed = True
        return changed

    def _drop_edge(self, key: tuple[int, int], incident) -> None:
        del self.edges[key]
        incident[key[0]].remove((key, 0))
        incident[key[1]].remove((key, 1))

    def eliminate(self) -> bool:
        changed = False
        incident = self.incident()
        for v in sorted(self.alive):
            if v in self.tied or v in self.in_memory or v not in self.alive:
                continue
            nbrs = incident[v]
            if len(nbrs) > 2:
                continue
            # each neighbour edge as a matrix [S_v, S_other]
            mats = [(k[1 - side], self.edges[k] if side == 0 else self.edges[k].T, k)
                    for k, side in nbrs]
            c = self.costs[v]
            if not mats:
                best = int(np.argmin(c))
                self.eliminated.append((v, None, None, self.keep[v][best]))
            elif len(mats) == 1:
                u, m, key = mats[0]
                total = c[:, None] + m  # [S_v, S_u]
                best = np.argmin(total, axis=0)
                table = np.full(len(self.graph.node_costs[u]), -1)
                table[self.keep[u]] = self.keep[v][best]
                self.costs[u] = self.costs[u] + total[best, np.arange(total.shape[1])]
                self._drop_edge(key, incident)
                self.eliminated.append((v, u, None, table))
            else:
                (u, mu, ku), (w, mw, kw) = mats
                if u == w or mu.shape[1] * mw.shape[1] > mu.size + mw.size:
                    continue
                total = c[:, None, None] + mu[:, :, None] + mw[:, None, :]  # [S_v, S_u, S_w]
                best = np.argmin(total, axis=0)
                merged = np.take_along_axis(total, best[None], axis=0)[0]
                table = np.full((len(self.graph.node_costs[u]), len(self.graph.node_costs[w])),
                                -1)
                table[np.ix_(self.keep[u], self.keep[w])] = self.keep[v][best]
                self._drop_edge(ku, incident)
                self._drop_edge(kw, incident)
                key = (u, w) if u < w else (w, u)
                merged = merged if u < w else merged.T
                if key in self.edges:
                    self.edges[key] = self.edges[key] + merged
                else:
                    self.edges[key] = merged
                    incident[key[0]].append((key, 0))
                    incident[key[1]].append((key, 1))
                self.eliminated.append((v, u, w, table))
            self.alive.discard(v)
            del incident[v]
            changed = True
        return changed

    def run(self) -> Reduced:
        while self.fold_separable() | self.drop_dominated() | self.eliminate():
            pass
        index: dict[int, int] = {}
        out = StrategyGraph(budget=self.graph.budget)
        for v in sorted(self.alive):
            if len(self.costs[v]) > 1 or v in self.tied:
                index[v] = out.add_node(self.costs[v])
        for (u, v), m in self.edges.items():
            if u in index and v in index:
                out.add_edge(index[u], index[v], m)
            elif v in index:
                out.node_costs[index[v]] = out.node_costs[index[v]] + m[0]
            elif u in index:
                out.node_costs[index[u]] = out.node_costs[index[u]] + m[:, 0]
        if self.use_memory:
            seen = set()
            for p in self.points:
                base, terms = _renumbered(p.base, p.terms, index)
                largest = [_renumbered(c, t, index) for c, t in p.largest]
                key = (_key(base, terms), tuple(_key(c, t) for c, t in largest))
                if key not in seen:
                    seen.add(key)
                    out.memory_points.append(MemoryPoint(base, terms, largest))
        out.ties = [(index[u], index[v], a[np.ix_(self.keep[u], self.keep[v])])
                    for u, v, a in self.graph.ties]
        return Reduced(out, self.keep, index, self.eliminated)


def _copy(terms: Terms) -> Terms:
    return [(v, m.copy()) for v, m in terms]


def _renumbered(base: float, terms: Terms, index: dict[int, int]) -> tuple[float, Terms]:
    """A sum's terms on the reduced graph's nodes; a node reduced to one strategy becomes
    part of the constant."""
    base += sum(float(m[0]) for v, m in terms if v not in index)
    out: dict[int, np.ndarray] = {}
    for v, m in terms:
        if v in index:
            out[index[v]] = out.get(index[v], 0) + m
    return base, sorted(out.items())


def _key(base: float, terms: Terms) -> tuple:
    return round(base), tuple((v, tuple(np.round(m).astype(np.int64))) for v, m in terms)


def _dominated(profile: np.ndarray) -> np.ndarray:
    """Rows that another row matches or beats in every column (of equal rows, the first
    stays)."""
    n = len(profile)
    drop = np.zeros(n, dtype=bool)
    order = np.arange(n)
    for i in range(n):
        if drop[i]:
            continue
        beats = np.all(profile[i] <= profile + _EPS, axis=1)
        equal = np.all(np.abs(profile - profile[i]) <= _EPS, axis=1)
        drop |= beats & (~equal | (order > i)) & (order != i)
    return drop


# ---- solving ---------------------------------------------------------------------------------

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
    objective = [(float(c[i]) * TIME_SCALE, s[v][i]) for v, c in enumerate(g.node_costs)
                 for i in range(len(c)) if c[i] != 0]
    edge_vars = []  # (u, v, strategy -> row group, strategy -> column group, variables)
    for (u, v), m in sorted(g.edges.items()):
        low = float(m.min())  # shifting a matrix by a constant does not change the argmin
        if low:
            objective.extend((low * TIME_SCALE, x) for x in s[u])
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
        objective.extend(((float(cols[r, c]) - low) * TIME_SCALE, e[r][c])
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
                           -c / g.budget)
                row.append((1.0, top))
            if row:
                lp.row(row, "<=", room)
    model = _new_model("alpac-sharding", time_limit, seed)
    model.setParam("limits/gap", gap_limit)
    lp.load(model, objective)
    by_name = {x.name: x for x in model.getVars()}
    warm = greedy(g)
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
            model.setSolVal(sol, by_name[top], max(c + _sum(t, warm) for c, t in p.largest)
                            / g.budget)
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
    return [(float(m[i]) / budget, s[v][i]) for v, m in terms for i in range(len(m)) if m[i] > 0]


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


def brute_force(graph: StrategyGraph) -> tuple[list[int] | None, float]:
    """Exhaustive search, for tests: the best feasible assignment and its objective."""
    sizes = [len(c) for c in graph.node_costs]
    combos = np.array(list(itertools.product(*[range(n) for n in sizes])), dtype=np.int64)
    combos = combos.reshape(max(len(combos), 1), len(sizes))
    value = np.zeros(len(combos))
    for v, c in enumerate(graph.node_costs):
        value += c[combos[:, v]]
    for (u, v), m in graph.edges.items():
        value += m[combos[:, u], combos[:, v]]
    ok = np.ones(len(combos), dtype=bool)
    for u, v, allowed in graph.ties:
        ok &= allowed[combos[:, u], combos[:, v]]
    if graph.budget is not None:
        for p in graph.memory_points:
            def used(base, terms):
                out = np.full(len(combos), base)
                for v, m in terms:
                    out += m[combos[:, v]]
                return out
            top = np.max([used(c, t) for c, t in p.largest], axis=0) if p.largest else 0.0
            ok &= used(p.base, p.terms) + top <= graph.budget * (1 + 1e-9)
    if not ok.any():
        return None, float("inf")
    value = np.where(ok, value, np.inf)
    best = int(np.argmin(value))
    return [int(x) for x in combos[best]], float(value[best])
