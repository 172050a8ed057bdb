"""Exact reductions of a `StrategyGraph` before it is solved: edges whose matrix is zero or
separable (C[i,j] = a_i + b_j) fold into node costs; strategies that another strategy of the
same node matches or beats in cost, in every edge row and (under a budget) in memory are
dropped; nodes left with one strategy become constants; repeated memory points are dropped;
nodes that no memory point or tie involves are eliminated into their neighbours.
`Reduced.expand` maps a solution of the reduced graph back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from alpac.intraop.problem import MemoryPoint, StrategyGraph, Terms

_EPS = 1e-15

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
