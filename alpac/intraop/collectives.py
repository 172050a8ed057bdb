"""Turning one sharding of an array into another on the same mesh: which collectives XLA's
SPMD partitioner uses, and what they cost.

Per mesh axis: kept on the same dimension -> nothing; newly splitting a dimension -> a local
slice (free); no longer splitting -> all-gather over that axis; moving to another dimension ->
all-to-all over that axis. The all-to-alls come first, then one all-gather over every axis
given up.
"""

from __future__ import annotations

from dataclasses import dataclass

from alpac.analysis.costmodel import CostModel
from alpac.plan.sharding import Sharding


@dataclass(frozen=True)
class Collective:
    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    axes: tuple[int, ...]
    nbytes: int  # bytes of the result on each device, as XLA's instruction shape counts them

    def seconds(self, model: CostModel) -> float:
        n = model.group_size(self.axes)
        # the cost model takes the full (gathered) size for gathers and scatters
        full = self.nbytes * n if self.kind == "reduce-scatter" else self.nbytes
        return model.collective(self.kind, full, self.axes)


def reshard(dims: tuple[int, ...], elem_bits: int, src: Sharding, dst: Sharding,
            mesh_shape: tuple[int, ...]) -> tuple[Collective, ...]:
    """Collectives that turn `src` into `dst` (both without partial sums), as XLA does it."""
    if src == dst:
        return ()
    out: list[Collective] = []
    if _needs_permute(src, dst):
        out.append(Collective("collective-permute", tuple(sorted(set(src.used_axes))),
                              src.tile_bytes(dims, elem_bits, mesh_shape)))
    current = [list(axes) for axes in src.dim_axes]
    moved, dropped = [], []
    for axis in sorted(set(src.used_axes)):
        ds, dd = src.axis_dim(axis), dst.axis_dim(axis)
        if ds == dd:
            continue
        if dd is None:
            dropped.append(axis)
        else:
            moved.append((axis, ds, dd))
    for axis, ds, dd in moved:
        current[ds].remove(axis)
        current[dd].append(axis)
        state = Sharding(tuple(tuple(a) for a in current))
        out.append(Collective("all-to-all", (axis,),
                              state.tile_bytes(dims, elem_bits, mesh_shape)))
    if dropped:
        for axis in dropped:
            for axes in current:
                if axis in axes:
                    axes.remove(axis)
        state = Sharding(tuple(tuple(a) for a in current))
        out.append(Collective("all-gather", tuple(dropped),
                              state.tile_bytes(dims, elem_bits, mesh_shape)))
    return tuple(out)


def _needs_permute(src: Sharding, dst: Sharding) -> bool:
    """Tiles keep their meaning only when, on every dimension, the axes both keep are the
    major part of both splits in the same order (axes leave and join at the minor end);
    otherwise devices hold other tiles and data must be permuted first."""
    for s_axes, d_axes in zip(src.dim_axes, dst.dim_axes):
        kept = [a for a in s_axes if a in d_axes]
        if tuple(kept) != s_axes[:len(kept)] or tuple(kept) != d_axes[:len(kept)]:
            return True
    return False


def collectives_of(sg, choice: list[int]) -> list[tuple[str, Collective, float]]:
    """The collectives the chosen strategies of a `builder.ShardingGraph` imply: (instruction,
    collective, multiplier).
    Resharding one value into one sharding counts once, as it is written once; so does
    gathering one value whole: XLA makes every sharding that needs the whole value first (an
    all-gather, then a local slice) from one replicated copy."""
    out = []
    for instr, plan in sg.plans.items():
        if plan.strategies:
            for c in plan.strategy(choice).collectives:
                out.append((instr.name, c, plan.multiplier))
    seen = set()
    for use in sg.uses:
        if use.value is None:
            continue
        src, req = use.value.sharding(choice), use.required_sharding(choice)
        if src == req or (id(use.value), req) in seen:
            continue
        shape = use.value.shape
        colls = reshard(shape.dims, shape.element_bits, src, req, tuple(sg.mesh.shape))
        if len(colls) == 1 and colls[0].kind == "all-gather" and \
                colls[0].nbytes == shape.byte_size:  # gathered whole, then sliced
            req = Sharding.replicated(shape.rank)
        key = (id(use.value), req)
        if key in seen:
            continue
        seen.add(key)
        for c in colls:
            out.append((use.value.producer.name, c, use.multiplier))
    return out
