"""Cross-mesh resharding: which slice of an array goes from which source device to which
destination device (pure computation on regions; `transfers.py` moves the bytes).

Given the region of the array every source device holds and every destination device needs:

- Every destination device receives exactly the slices of its region, each from one source
  device holding it (preferring one on the same rank, else the least loaded holder), so no
  byte crosses twice and no device receives what it does not need.
- When the destination replicates (r devices need the same region), the region is split in
  r equal parts along its first dimension divisible by r; each of the r devices receives one
  part, and an all-gather inside the destination mesh (XLA's, from the receive layout to
  the destination sharding) completes it: each slice crosses between the meshes once
  (Alpa's local all-gather). When no dimension divides, or the region is too small for an
  all-gather to pay off, the first of the r devices receives the whole region and forwards
  it to the others inside the destination mesh (a copy, or MPI when on another rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension


def region_of(index: tuple, shape: list[int]) -> Region:
    """A device's region from the tuple of slices jax gives (`devices_indices_map`)."""
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s}")
        out.append((start, stop))
    return tuple(out)


def size(region: Region) -> int:
    n = 1
    for a, b in region:
        n *= max(b - a, 0)
    return n


def intersect(a: Region, b: Region) -> Region | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


@dataclass
class Piece:
    src: int  # source partition (position in the source mesh)
    dst: int  # destination partition
    region: Region  # global coordinates


@dataclass
class ReshardPlan:
    recv_regions: list[Region]  # per destination partition, what it receives across meshes
    recv_tiles: list[int] | None  # tile dims of the receive layout when it is not the dst's
    recv_devices: list[int] | None  # partitions in tile order, for recv_tiles
    pieces: list[Piece]
    forwards: list[tuple[int, int]] = field(default_factory=list)  # (leader, replica)

    def sharding_text(self) -> str | None:
        """XLA sharding string of the receive layout (None: the destination's own)."""
        if self.recv_tiles is None:
            return None
        return ("{devices=[" + ",".join(map(str, self.recv_tiles)) + "]"
                + ",".join(map(str, self.recv_devices)) + "}")

    def crossing_elements(self) -> int:
        return sum(size(p.region) for p in self.pieces)


def plan(shape: list[int], src_regions: list[Region], dst_regions: list[Region],
         src_rank: list[int], dst_rank: list[int], local_allgather: bool = True
         ) -> ReshardPlan:
    """Pieces moving an array from the source layout to the destination layout."""
    groups = _groups(dst_regions)
    recv = list(dst_regions)
    tiles = devices = None
    receivers = list(range(len(dst_regions)))
    forwards: list[tuple[int, int]] = []
    replicated = any(len(g) > 1 for g in groups.values())
    if replicated:
        split = _split(shape, dst_regions, groups) if local_allgather else None
        if split is not None:
            recv, tiles, devices = split
        else:
            receivers = []
            for members in groups.values():
                receivers.append(members[0])
                forwards += [(members[0], r) for r in members[1:]]
    src_groups = _groups(src_regions)
    load: dict[int, int] = {}
    pieces = []
    for j in sorted(receivers):
        for region, holders in src_groups.items():
            part = intersect(recv[j], region)
            if part is None:
                continue
            same = [h for h in holders if src_rank[h] == dst_rank[j]]
            pool = same or holders
            h = min(pool, key=lambda x: (load.get(x, 0), x))
            load[h] = load.get(h, 0) + size(part)
            pieces.append(Piece(h, j, part))
    return ReshardPlan(recv, tiles, devices, pieces, forwards)


def _groups(regions: list[Region]) -> dict[Region, list[int]]:
    out: dict[Region, list[int]] = {}
    for i, r in enumerate(regions):
        out.setdefault(r, []).append(i)
    return out


def _split(shape, regions, groups):
    """Receive regions, tile dims and device order of the local all-gather layout, or None
    when the destination layout is not a regular grid or no dimension divides."""
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1 or not shape:
        return None
    r = sizes.pop()
    ndim = len(shape)
    extents = []
    for d in range(ndim):
        ext = {reg[d][1] - reg[d][0] for reg in groups}
        if len(ext) != 1:
            return None  # uneven tiles
        e = ext.pop()
        if e <= 0 or shape[d] % e:
            return None
        extents.append(e)
    tiles = [shape[d] // extents[d] for d in range(ndim)]
    dim = next((d for d in range(ndim) if extents[d] % r == 0), None)
    if dim is None:
        return None
    part = extents[dim] // r
    recv = list(regions)
    new_tiles = list(tiles)
    new_tiles[dim] *= r
    grid: dict[tuple[int, ...], int] = {}
    for reg, members in groups.items():
        coord = [reg[d][0] // extents[d] for d in range(ndim)]
        for q, dev in enumerate(members):
            lo = reg[dim][0] + q * part
            recv[dev] = tuple((lo, lo + part) if d == dim else reg[d] for d in range(ndim))
            c = list(coord)
            c[dim] = coord[dim] * r + q
            grid[tuple(c)] = dev
    order = sorted(grid)
    if len(order) != len(regions):
        return None
    return recv, new_tiles, [grid[c] for c in order]
