"""Stage construction: split L layers into pipeline stages, give each a submesh and a logical
mesh, and pick the number of microbatches B (Alpa's training DP, reference section 2).

A stage (first layer, last layer, submesh, config) is priced by the caller's `stage_cost`
(None: it cannot run). A plan covers the layers in order on submeshes that use exactly the
cluster's D devices and that `submesh.place` can lay out. Under 1F1B stage s (0-based) of S
holds min(S - s, B) microbatches of activations, so static + min(S - s, B)·activation must
fit the budget. A step costs sum t + (B - 1)·max t + max apply (fill and drain, the steady
state paced by the slowest stage, then the optimizer updates, in parallel on the meshes).
The search is exact over the number of stages, their ranges, submeshes, configs and B.

How, per B:
  - DP state: (stages from here to the end, capped at K; first layer; devices), value: least
    sum t. Memory depends on the stages that follow only up to the largest in-flight count
    some stage cannot afford, so K = 1 + that count (often 1), not Alpa's L. Levels below K
    are numpy min-plus products over (submesh, first layer, stage length, devices); level K
    loops over the first layer.
  - W(τ) = least sum t + max apply over plans with every t <= τ: a DP pass gives the least
    sum with every apply < α; α drops to the answer's max apply until the sum alone reaches
    the best W seen.
  - The answer is min over τ of W(τ) + (B - 1)·τ, τ over the stage times (Alpa's t_max
    enumeration). W is non-increasing, so the search bisects the sorted τ, skipping a
    stretch whose ends have equal W or whose bound W(right) + (B - 1)·τ(left) cannot beat
    the best plan. It stops where Alpa does (τ·B >= best), or at τ >= (best - least sum
    t)/(B - 1) if sooner.
  - Laziness: a stage is priced (stage_cost called, at most once) only once the search
    reaches a τ at or above its lower bound (the optional `lower_bound`; 0 without it), and
    never if, with every unpriced stage at its bound, no plan holding it can beat the best.
Ties keep the first plan found; the search order is fixed, so equal inputs give equal plans.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from alpac.interop.submesh import place
from alpac.plan.schedule import bubble_share, microbatches_in_flight, step_seconds


@dataclass(frozen=True)
class StageCost:
    t: float  # seconds per microbatch, forward + backward
    apply: float  # seconds, once per step: the optimizer update of the stage's weights
    static_bytes: float  # per device, held all step: weights, optimizer state, ...
    activation_bytes: float  # per device, per microbatch in flight (kept for the backward)
    budget: float  # per device memory budget, bytes

    def as_row(self) -> tuple[float, float, float, float, float]:
        """The fields in order (`dataclasses.astuple` deep-copies: too slow for the 10^5
        stages a search prices)."""
        return self.t, self.apply, self.static_bytes, self.activation_bytes, self.budget


@dataclass(frozen=True)
class Stage:
    first_layer: int
    last_layer: int  # inclusive
    submesh: int  # index into the submesh list
    config: int  # index into that submesh's configs
    t: float
    apply: float
    in_flight: int  # microbatches of activations held under 1F1B: min(stages after + 1, B)
    memory: float  # bytes per device: static + in_flight · activation
    devices: tuple[int, ...]  # physical device ids (submesh.place), ascending


@dataclass(frozen=True)
class DPStats:
    calls: int  # stage_cost calls
    thresholds: int  # t_max values the DP was run at
    dp_runs: int  # DP passes (with feasibility probes and the apply iteration)
    seconds: float  # wall time, the callbacks' time excluded
    callback_seconds: float


@dataclass(frozen=True)
class StagePlan:
    num_micro_batches: int
    stages: tuple[Stage, ...]
    objective: float  # seconds per step: sum t + (B - 1)·max t + max apply
    stage_times: tuple[float, ...]  # t per stage
    bubble_fraction: float  # idle share of the pipeline: 1 - B·mean t / (sum t + (B-1)·max t)
    stats: DPStats


class NoFeasiblePlan(Exception):
    """No plan fits. `min_memory` is the least per-device memory, in bytes, that some plan
    would need (None when no plan exists whatever the memory)."""

    def __init__(self, min_memory: float | None):
        self.min_memory = min_memory
        super().__init__(f"no stage assignment fits in device memory; the smallest memory per "
                         f"device any assignment needs is {min_memory:.0f} bytes"
                         if min_memory is not None else "no stage assignment exists")


def stage_dp(num_layers: int, submeshes: Sequence[tuple[int, int]],
             configs: Sequence[Sequence[object]], nodes: int, devices_per_node: int,
             micro_batches: Sequence[int],
             stage_cost: Callable[[int, int, int, int, int], StageCost | None], *,
             lower_bound: Callable[[int, int, int, int, int], float] | None = None,
             fixed_stages: Sequence[tuple[int, int]] | None = None,
             fixed_num_micro_batches: int | None = None,
             admissible: Callable | None = None) -> StagePlan:
    """The cheapest plan (module docstring). `configs[m]` lists submesh m's configs (only
    their number matters here). `lower_bound(first, last, submesh, config, B)` must never
    exceed that stage's t; `fixed_stages` pins the layer ranges (first, last), in order;
    `fixed_num_micro_batches` pins B; `admissible(first, last, submesh, config)` (arrays)
    leaves out stages that can never be worth pricing, at any B. Raises NoFeasiblePlan when
    nothing fits."""
    if fixed_num_micro_batches is not None:
        micro_batches = [fixed_num_micro_batches]
    if num_layers < 1 or not submeshes or len(configs) != len(submeshes) or not micro_batches \
            or min(micro_batches) < 1:
        raise ValueError("need num_layers >= 1, one config list per submesh and B >= 1")
    if fixed_stages is not None and (
            [a for a, _ in fixed_stages] != [0] + [b + 1 for _, b in fixed_stages[:-1]]
            or fixed_stages[-1][1] != num_layers - 1 or any(b < a for a, b in fixed_stages)):
        raise ValueError(f"fixed stages {fixed_stages} must cover layers 0..{num_layers - 1}")
    search = _Search(num_layers, list(submeshes), [len(c) for c in configs], nodes,
                     devices_per_node, stage_cost, lower_bound, fixed_stages, admissible)
    for B in dict.fromkeys(micro_batches):  # in the order given, once each
        search.search(B)
    return search.result()


def _max_in_flight(static, act, budget):
    """Largest k with static + k·act <= budget (inf when act is 0 and static fits, -1 when
    static does not), computed so that the boundary value itself counts."""
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.floor((budget - static) / np.where(act > 0, act, 1))
        k += static + (k + 1) * act <= budget
        k -= static + k * act > budget
    return np.where(static > budget, -1.0, np.where(act > 0, k, np.inf))


class _Options:
    """The stages of one B that a plan of exactly D devices could hold, and their prices."""

    def __init__(self, search: _Search, B: int):
        self.B = B
        self.i, self.j, self.m, self.c = search.structural
        self.keys = list(zip(self.i.tolist(), self.j.tolist(), self.m.tolist(),
                             self.c.tolist(), [B] * len(self.i)))  # as Python ints
        n = len(self.i)
        self.lb = np.array([search.lower_bound(*self.key(k)[:4], B) for k in range(n)],
                           dtype=np.float64) if search.lower_bound else np.zeros(n)
        self.order = np.lexsort((np.arange(n), self.lb))  # pricing order
        self.open = np.ones(n, dtype=bool)  # not priced and not ruled out
        self.cost: list[StageCost | None] = [None] * n
        self.t = np.full(n, np.inf)  # inf until priced, and for stages that cannot run
        self.apply = np.zeros(n)
        self.kap = np.full(n, -1.0)  # max microbatches in flight; -1: cannot run
        self.search = search

    def key(self, k):
        return self.keys[k]

    def ensure(self, tau: float, strict: bool = False):
        """Price every open stage whose lower bound is <= tau (< tau when strict)."""
        lb = self.lb[self.order]
        due = self.order[self.open[self.order] & ((lb < tau) if strict else (lb <= tau))]
        self.open[due] = False
        for k in due:
            self.cost[k] = self.search.price(self.key(k))
        runs = np.array([k for k in due if self.cost[k] is not None], dtype=np.int64)
        t, apply, static, act, budget = np.array(
            [self.cost[k].as_row() for k in runs], dtype=np.float64).reshape(-1, 5).T
        kap = _max_in_flight(static, act, budget)
        fits = kap >= 1
        self.t[runs[fits]], self.apply[runs[fits]] = t[fits], apply[fits]
        self.kap[runs[fits]] = kap[fits]

    def thresholds(self, above: float, upto: float, lbs: bool) -> np.ndarray:
        """Sorted distinct known t in (above, upto], with the lower bounds of open stages in
        that range when `lbs`."""
        vals = self.t[(self.t > above) & (self.t <= upto)]
        if lbs:
            lb = self.lb[self.open]
            vals = np.concatenate([vals, lb[(lb > above) & (lb <= upto)]])
        return np.unique(vals)

    def rule_out(self, best: float) -> float:
        """Close the open stages no plan cheaper than `best` can hold (unpriced stages at
        their bounds, memory ignored: the other stages' least sum t + B·own bound >= best).
        Returns the least sum t of any plan on the same terms."""
        t = np.where(self.open, self.lb, self.t)
        rest, least = _rest_bounds(self.search, self.i, self.j, self.m, t)
        self.open &= rest + self.B * self.lb < best
        return least


class _Search:
    def __init__(self, L, shapes, num_configs, nodes, M, stage_cost, lower_bound, fixed,
                 admissible=None):
        self.L, self.shapes, self.num_configs = L, shapes, num_configs
        self.nodes, self.M, self.D = nodes, M, nodes * M
        self.sizes = np.array([k * m for k, m in shapes])
        self.stage_cost, self.lower_bound, self.fixed = stage_cost, lower_bound, fixed
        self.admissible = admissible
        self.cache: dict[tuple, StageCost | None] = {}
        self.options: dict[int, _Options] = {}
        self.best: tuple | None = None  # (objective, B, stage option indices, options)
        self.dp_runs = self.thresholds = 0
        self.callback_seconds = 0.0
        self.start = time.perf_counter()
        self.structural = self.structural_options()


    def price(self, key):  # each stage and B at most once
        if key not in self.cache:
            t0 = time.perf_counter()
            self.cache[key] = self.stage_cost(*key)
            self.callback_seconds += time.perf_counter() - t0
        return self.cache[key]

    def structural_options(self):
        """(i, j, m, c) of every stage that some plan of exactly D devices could hold."""
        ranges = self.fixed or [(i, j) for i in range(self.L) for j in range(i, self.L)]
        arr = np.array([(i, j, m, c) for i, j in ranges for m in range(len(self.shapes))
                        for c in range(self.num_configs[m])], dtype=np.int64).reshape(-1, 4)
        i, j, m, c = arr.T
        rest, _ = _rest_bounds(self, i, j, m, np.zeros(len(i)))
        keep = np.isfinite(rest)
        if self.admissible is not None:
            keep &= self.admissible(i, j, m, c)
        return i[keep], j[keep], m[keep], c[keep]

    # -- the DP ---------------------------------------------------------------------------

    def run_dp(self, o: _Options, sel: np.ndarray, t: np.ndarray, kap: np.ndarray):
        """(least sum t, option indices front to back) over plans of options `sel`, or None."""
        self.dp_runs += 1
        path = _min_sum(self.L, self.D, self.sizes, o.B, o.i[sel], o.j[sel], o.m[sel],
                        t[sel], kap[sel])
        return None if path is None else (path[0], sel[path[1]])

    def solve(self, o: _Options, tau: float, alpha: float = np.inf):
        self.thresholds += alpha == np.inf
        sel = np.flatnonzero((o.t <= tau) & (o.apply < alpha))
        res = self.run_dp(o, sel, o.t, o.kap)
        if res is not None:
            self.offer(o, res[1])
        return res

    def offer(self, o: _Options, picks):
        t, a = o.t[picks], o.apply[picks]
        obj = float(step_seconds(t.sum(), t.max(), a.max(), o.B))
        if self.best is None or obj < self.best[0]:
            try:
                place([self.shapes[m] for m in o.m[picks]], self.nodes, self.M)
            except ValueError:
                return  # only possible with widths that do not divide each other
            self.best = (obj, o.B, picks, o)

    def W(self, o: _Options, tau: float) -> float:
        """Least sum t + max apply over plans with every t <= tau (module docstring)."""
        best, alpha = np.inf, np.inf
        while (res := self.solve(o, tau, alpha)) is not None:
            a = float(o.apply[res[1]].max())
            best = min(best, res[0] + a)
            if res[0] >= best:
                break
            alpha = a
        return best

    def search(self, B: int):
        o = self.options[B] = _Options(self, B)
        if self.best is not None:
            o.rule_out(self.best[0])
        cap = lambda: self.best[0] / B if self.best else np.inf  # noqa: E731
        # 1. The least feasible tau: exponential search, pricing only up to the probe.
        below, step = -np.inf, 1
        while True:
            vals = o.thresholds(below, cap(), lbs=True)
            vals = vals[vals < cap()]
            if not len(vals):
                return
            probe = vals[min(step, len(vals)) - 1]
            o.ensure(probe)
            if self.solve(o, probe) is not None:
                break
            below, step = probe, step * 2
        known = o.thresholds(below, probe, lbs=False)
        lo, hi = 0, len(known) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.solve(o, known[mid]) is not None else (mid + 1, hi)
        tau0 = known[lo]
        if self.best is None:  # every plan found so far was unplaceable
            return
        # 2. Bisect the thresholds that can still beat the best plan.
        least_sum = o.rule_out(self.best[0])
        limit = cap() if B == 1 else min(cap(), (self.best[0] - least_sum) / (B - 1))
        if tau0 >= limit:
            return
        o.ensure(limit, strict=True)
        taus = np.concatenate([[tau0], o.thresholds(tau0, limit, lbs=False)])
        taus = taus[taus < limit]
        w = {0: self.W(o, taus[0])}
        if len(taus) > 1:
            w[len(taus) - 1] = self.W(o, taus[-1])
        stack = [(0, len(taus) - 1)]
        while stack:
            lo, hi = stack.pop()
            if hi - lo <= 1 or w[lo] == w[hi] or w[hi] + (B - 1) * taus[lo + 1] >= self.best[0]:
                continue
            mid = (lo + hi) // 2
            w[mid] = self.W(o, taus[mid])
            stack += [(mid, hi), (lo, mid)]


    def stats(self) -> DPStats:
        total = time.perf_counter() - self.start
        return DPStats(len(self.cache), self.thresholds, self.dp_runs,
                       total - self.callback_seconds, self.callback_seconds)

    def result(self) -> StagePlan:
        if self.best is None:
            raise NoFeasiblePlan(self.min_memory())
        obj, B, picks, o = self.best
        S = len(picks)
        devices = place([self.shapes[m] for m in o.m[picks]], self.nodes, self.M)
        held = [microbatches_in_flight(S, s, B) for s in range(S)]
        stages = [Stage(*o.key(k)[:4], o.cost[k].t, o.cost[k].apply, held[s],
                        o.cost[k].static_bytes + held[s] * o.cost[k].activation_bytes,
                        tuple(devices[s])) for s, k in enumerate(picks)]
        t = [st.t for st in stages]
        bubble = bubble_share(sum(t), max(t), S, B)
        return StagePlan(B, tuple(stages), obj, tuple(t), bubble, self.stats())

    def min_memory(self) -> float | None:
        """Least per-device memory some plan needs: per B, bisect the distinct values
        static + k·activation of the stages that can run at all."""
        best = math.inf
        for B, o in self.options.items():
            runs = np.array([k for k, c in enumerate(o.cost) if c is not None], dtype=np.int64)
            static, act = np.array([o.cost[k].as_row()[2:4] for k in runs]).reshape(-1, 2).T
            flights = np.arange(1, min(B, self.L, self.D) + 1)
            values = np.unique(static[:, None] + act[:, None] * flights)

            def fits(mu):
                kap = np.full(len(o.t), -1.0)
                kap[runs] = _max_in_flight(static, act, mu)
                return self.run_dp(o, np.flatnonzero(kap >= 1), np.zeros(len(o.t)), kap)

            if len(values) and fits(values[-1]):
                lo, hi = 0, len(values) - 1
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if fits(values[mid]) else (mid + 1, hi)
                best = min(best, float(values[lo]))
        return None if best == math.inf else best


def _min_sum(L, D, sizes, B, oi, oj, om, t, kap):
    """The DP over (stages to the end, capped at K; first layer; devices). Option k covers
    layers oi[k]..oj[k] on submesh om[k] in time t[k] and affords kap[k] microbatches in
    flight; at level s (s stages from it to the end, counting itself) it holds min(s, B).
    Returns (least sum, indices of the options front to back) or None."""
    M = len(sizes)
    s_max = min(L, D // int(sizes.min()))
    full = min(B, s_max)
    cap = np.where(kap >= full, np.inf, kap)
    finite = cap[np.isfinite(cap)]
    K = int(finite.max()) + 1 if len(finite) else 1
    level = np.where(np.isfinite(cap), cap, K).astype(np.int64)  # highest usable level
    w = np.full((K + 1, M, L, L), np.inf)
    np.minimum.at(w, (level, om, oi, oj), t)
    for s in range(K - 1, 0, -1):
        np.minimum(w[s], w[s + 1], out=w[s])
    # Stages on submesh m span at most band[m] layers: work on (first layer, length) only.
    band = np.zeros(M, dtype=np.int64)
    np.maximum.at(band, om, oj - oi + 1)
    first = np.arange(L)[:, None]
    F = np.full((K + 1, L + 1, D + 1), np.inf)
    F[0, L, 0] = 0.0
    banded = []
    for m, n in enumerate(sizes):
        if n <= D and band[m]:
            last = first + np.arange(band[m])[None, :]  # (first layer, length) -> last layer
            wb = w[1:K, m][:, first, np.minimum(last, L - 1)]
            wb[:, last >= L] = np.inf
            banded.append((n, wb, np.minimum(last + 1, L)))
    for s in range(1, K):
        rows = L - s + 1  # s stages need s layers
        for n, wb, nxt in banded:
            cand = (wb[s - 1, :rows, :, None] + F[s - 1][nxt[:rows], :D + 1 - n]).min(axis=1)
            np.minimum(F[s, :rows, n:], cand, out=F[s, :rows, n:])
    for i in range(L - 1, -1, -1):
        for m, n in enumerate(sizes):
            row = w[K, m, i, i:i + band[m]]
            if n <= D and np.isfinite(row).any():
                src = np.minimum(F[K - 1, i + 1:i + 1 + len(row)], F[K, i + 1:i + 1 + len(row)])
                cand = (row[:, None] + src[:, :D + 1 - n]).min(axis=0)
                np.minimum(F[K, i, n:], cand, out=F[K, i, n:])
    ends = F[1:, 0, D]
    if not np.isfinite(ends).any():
        return None
    s, i, d = int(np.argmin(ends)) + 1, 0, D
    total, picks = float(ends[s - 1]), []
    while i < L:
        best = None
        for m, n in enumerate(sizes):
            for prev in ([s - 1] if s < K else [K - 1, K]):
                if n <= d:
                    vals = w[s, m, i, i:] + F[prev, i + 1:, d - n]
                    hits = np.flatnonzero(vals == F[s, i, d])
                    if len(hits) and (best is None or hits[0] + i < best[0]):
                        best = (int(hits[0]) + i, m, prev)
        j, m, prev = best
        k = np.flatnonzero((oi == i) & (oj == j) & (om == m) & (level >= s)
                           & (t == w[s, m, i, j]))[0]
        picks.append(k)
        s, i, d = prev, j + 1, d - int(sizes[m])
    return total, np.array(picks, dtype=np.int64)


def _rest_bounds(search: _Search, oi, oj, om, t):
    """Memory-free min-sum DPs from both ends: per option the least sum t of the stages
    around it in a plan, and the least sum t of any plan."""
    L, D, sizes = search.L, search.D, search.sizes
    w = np.full((len(sizes), L, L), np.inf)
    ok = np.isfinite(t)
    np.minimum.at(w, (om[ok], oi[ok], oj[ok]), t[ok])
    pre = np.full((L + 1, D + 1), np.inf)  # pre[i, d]: layers 0..i-1 on d devices
    suf = np.full((L + 1, D + 1), np.inf)  # suf[i, d]: layers i..L-1 on d devices
    pre[0, 0] = suf[L, 0] = 0.0
    for x in range(L):
        i = L - 1 - x
        for m, n in enumerate(sizes):
            if n <= D:
                cand = (w[m, i, i:][:, None] + suf[i + 1:, :D + 1 - n]).min(axis=0)
                np.minimum(suf[i, n:], cand, out=suf[i, n:])
                cand = (w[m, :x + 1, x][:, None] + pre[:x + 1, :D + 1 - n]).min(axis=0)
                np.minimum(pre[x + 1, n:], cand, out=pre[x + 1, n:])
    rest = np.full(len(oi), np.inf)
    for m, n in enumerate(sizes):
        if n <= D:
            both = (pre[:L, None, :D + 1 - n] + suf[None, 1:, D - n::-1]).min(axis=2)
            k = om == m
            rest[k] = both[oi[k], oj[k]]
    return rest, float(suf[0, D])
