"""The strategy-selection problem, independent of HLO: nodes with one cost per strategy,
pairwise edge cost matrices, memory at liveness points, and ties (`StrategyGraph`), solved by
`alpac.intraop.ilp` after `alpac.intraop.reduce`; `brute_force` is the reference the tests
hold both to.

    minimise   Σ_v c_v·s_v + Σ_(u,v) Σ_ij C_uv[i,j]·e_uv[i,j]
    subject to one strategy per node,
               base_t + Σ_(v,m) m·s_v ≤ budget at every liveness point t
               (a point may add the largest of several such sums, a temporary of which one
               is live at a time)
               tied nodes take allowed pairs of strategies
               (aliased parameters and outputs, loop state that must keep one sharding)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

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
        return self.base + terms_sum(self.terms, choice) + max(
            (c + terms_sum(t, choice) for c, t in self.largest), default=0.0)

    def term_lists(self) -> list[Terms]:
        return [self.terms] + [t for _, t in self.largest]


def terms_sum(terms: Terms, choice) -> float:
    """The bytes `terms` add up to under `choice`."""
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
