"""Which shardings an array can take on a mesh, and how shardings map through ops that move
dimensions around (reshape, transpose, broadcast, reduce)."""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

from alpac.plan.sharding import Sharding


@lru_cache(maxsize=None)
def array_shardings(dims: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[Sharding, ...]:
    """Every way to give each mesh axis (of size > 1) to one dimension or to none, keeping
    only splits that divide evenly. Within a dimension, axes go in mesh order. The most split
    come first: where strategies tie on time, the first (the smallest in memory) is kept."""
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    out = []
    for assign in itertools.product(range(len(dims) + 1), repeat=len(axes)):
        dim_axes = tuple(tuple(a for a, d in zip(axes, assign) if d == dim)
                         for dim in range(len(dims)))
        s = Sharding(dim_axes)
        if s.divides(dims, mesh_shape):
            out.append(s)
    out.sort(key=lambda s: (-s.num_tiles(mesh_shape), s.dim_axes))
    return tuple(out)


def transpose_sharding(s: Sharding, permutation: tuple[int, ...]) -> Sharding:
    return Sharding(tuple(s.dim_axes[p] for p in permutation), s.partial)


def broadcast_operand_sharding(out: Sharding, dimensions: tuple[int, ...]) -> Sharding:
    """The operand's part of a broadcast's output sharding (`dimensions` maps operand dims to
    output dims)."""
    return Sharding(tuple(out.dim_axes[d] for d in dimensions))


def reshape_sharding(s: Sharding, src: tuple[int, ...], dst: tuple[int, ...],
                     mesh_shape: tuple[int, ...]) -> Sharding | None:
    """The sharding of reshape(src -> dst) that keeps every device's data where it is, or None
    when the split cannot survive the reshape without moving data.

    Dims are matched in groups whose sizes multiply to the same number. In a group, only the
    most major input dim may be split, and it must divide the most major output dim (merging
    [b, s] -> [b*s] keeps a split of b; splitting [b*s] -> [b, s] keeps a split of b*s if it
    divides b)."""
    out: list[tuple[int, ...]] = [()] * len(dst)
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        if i >= len(src) or j >= len(dst):
            # trailing size-1 dims
            rest_src = src[i:]
            rest_dst = dst[j:]
            if any(x != 1 for x in rest_src) or any(x != 1 for x in rest_dst):
                return None
            if any(s.dim_axes[k] for k in range(i, len(src))):
                return None
            break
        ps, pd = src[i], dst[j]
        while ps != pd:
            if ps < pd:
                i += 1
                if i >= len(src):
                    return None
                gi.append(i)
                ps *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return None
                gj.append(j)
                pd *= dst[j]
        # skip size-1 dims at the major end of the group so the split lands on a real dim
        major_src = next((k for k in gi if src[k] != 1), gi[0])
        major_dst = next((k for k in gj if dst[k] != 1), gj[0])
        for k in gi:
            if k != major_src and s.dim_axes[k]:
                return None
        axes = s.dim_axes[major_src]
        if axes:
            n = math.prod(mesh_shape[a] for a in axes)
            if dst[major_dst] % n:
                return None
            out[major_dst] = axes
        i, j = gi[-1] + 1, gj[-1] + 1
    return Sharding(tuple(out), s.partial)
