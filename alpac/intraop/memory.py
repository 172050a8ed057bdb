"""Memory per device of a sharding problem, as `MemoryPoint`s of the ILP.

A whole program's memory is the peak of the values live at each point of its schedule
(`liveness_points`). A pipeline stage's is judged otherwise (`StageMemory`, the count the
stage DP and the plan's figures use, alpac.interop.pricing): one point of what it holds, its
microbatches' activations in flight, and its largest temporary (`stage_point`).

Values are the builder's (alpac.intraop.builder.Value): a node (None: one fixed sharding),
a sharding per strategy of that node, a shape, the instruction producing it and its leaf.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from alpac.intraop.problem import MemoryPoint, Terms


@dataclass(frozen=True)
class StageMemory:
    """How a pipeline stage's peak bytes per device are judged (alpac.interop.pricing): the
    parameters it holds all step, plus `in_flight` times the values one microbatch keeps from
    its forward to its backward, plus the largest of the other values (XLA's fused loops
    write in place: about one temporary is live at a time). Names of entry instructions."""

    held: frozenset[str]  # parameters kept all step (weights, optimizer state, accumulators)
    kept: frozenset[str]  # values one microbatch keeps for its backward
    in_flight: int  # microbatches whose activations are held at once
    not_temporary: frozenset[str]  # parameters, and what the backward reads from the forward


def liveness_points(values: list, birth: dict[int, int], death: dict[int, int],
                    mesh_shape: tuple[int, ...]) -> list[MemoryPoint]:
    """One memory point per local maximum of the live set: a position where values were born
    since the last death and one now dies (the maximal cliques of the intervals). `birth` and
    `death` map id(value) to schedule positions."""
    births = {birth[id(v)] for v in values}
    deaths = {death[id(v)] for v in values}
    positions, rising = [], False
    for t in sorted(births | deaths):
        rising = rising or t in births
        if t in deaths and rising:
            positions.append(t)
            rising = False
    if rising:
        positions.append(max(births))
    # sweep the positions once: a value is added where its interval starts and taken away
    # after it ends (bytes are whole numbers, so the running sums stay exact)
    changes: dict[int, list] = {}  # position index -> (node, bytes per strategy, +1 / -1)
    for v in values:
        first = bisect.bisect_left(positions, birth[id(v)])
        after = bisect.bisect_right(positions, death[id(v)])
        if first < after:
            tiles = tile_bytes(v, mesh_shape)
            changes.setdefault(first, []).append((v.node, tiles, 1))
            changes.setdefault(after, []).append((v.node, -tiles, -1))
    base, terms, live = 0.0, {}, {}
    points = []
    for k in range(len(positions)):
        for node, tiles, count in changes.get(k, ()):
            if node is None:
                base += float(tiles[0])
                continue
            live[node] = live.get(node, 0) + count
            if live[node]:
                terms[node] = terms.get(node, 0) + tiles
            else:
                del live[node], terms[node]
        points.append(MemoryPoint(base, sorted(terms.items())))
    return points


def stage_point(values: dict, parameters: list, memory: StageMemory,
                mesh_shape: tuple[int, ...]) -> MemoryPoint:
    """`memory`'s judged peak as one memory point: held and in-flight bytes summed, the
    temporaries as its `largest` (those that can never be the largest left out). `values`
    maps (instruction, leaf index) to the builder's values; `parameters` are the entry's."""
    by_name: dict[str, list] = {}
    for (instr, idx), v in values.items():
        if v.producer is instr and idx == v.leaf:
            by_name.setdefault(instr.name, []).append(v)
    held = [values[(p, ())] for p in parameters if p.name in memory.held and (p, ()) in values]
    kept = [v for name in memory.kept for v in by_name.get(name, ())]
    base, terms = bytes_terms(held, 1, mesh_shape)
    more, kept_terms = bytes_terms(kept, memory.in_flight, mesh_shape)
    temporaries = [bytes_terms(vs, 1, mesh_shape) for name, vs in by_name.items()
                   if name not in memory.not_temporary]
    return MemoryPoint(base + more, _merged(terms + kept_terms), _may_be_largest(temporaries))


def bytes_terms(values: list, times: int, mesh_shape: tuple[int, ...]) -> tuple[float, Terms]:
    """`times` the values' bytes per device: a constant, and per node per strategy."""
    base, terms = 0.0, {}
    for v in values:
        tiles = times * tile_bytes(v, mesh_shape)
        if v.node is None:
            base += float(tiles[0])
        else:
            terms[v.node] = terms.get(v.node, 0) + tiles
    return base, sorted(terms.items())


def tile_bytes(value, mesh_shape: tuple[int, ...]) -> np.ndarray:
    """The bytes per device of `value` under each of its shardings."""
    return np.array([s.tile_bytes(value.shape.dims, value.shape.element_bits, mesh_shape)
                     for s in value.shardings], dtype=float)


def _merged(terms: Terms) -> Terms:
    out: dict[int, np.ndarray] = {}
    for v, m in terms:
        out[v] = out.get(v, 0) + m
    return sorted(out.items())


def _may_be_largest(sums: list[tuple[float, Terms]]) -> list[tuple[float, Terms]]:
    """The sums that some choice makes the largest: one is at least the largest of their
    smallest values whatever the choice, so a sum that never exceeds that never counts."""
    if not sums:
        return []
    least = [c + sum(float(m.min()) for _, m in t) for c, t in sums]
    floor = max(least)
    keep = least.index(floor)
    return [s for k, s in enumerate(sums)
            if k == keep or s[0] + sum(float(m.max()) for _, m in s[1]) > floor]
