"""The one sharding type, and its conversion to and from XLA's sharding strings.

`Sharding` says, for each tensor dimension, which logical-mesh axes split it (major to
minor); mesh axes that split no dimension replicate the value, unless they are listed in
`partial`, in which case each device holds a partial sum to be reduced over those axes.
XLA's strings (`{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}`, the iota form
`{devices=[4,2]<=[2,4]T(1,0)}`, `{replicated}`, tuples `{{...}, {...}}`) are read into
`XlaSharding` and converted against a mesh.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, order=True)
class Sharding:
    dim_axes: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...] = ()

    @staticmethod
    def replicated(rank: int) -> "Sharding":
        return Sharding(((),) * rank)

    @staticmethod
    def split(rank: int, dim: int, axes: tuple[int, ...]) -> "Sharding":
        return Sharding(tuple(tuple(axes) if d == dim else () for d in range(rank)))

    @property
    def rank(self) -> int:
        return len(self.dim_axes)

    @property
    def used_axes(self) -> tuple[int, ...]:
        return tuple(a for axes in self.dim_axes for a in axes)

    @property
    def is_replicated(self) -> bool:
        return not self.used_axes and not self.partial

    def axis_dim(self, axis: int) -> int | None:
        for d, axes in enumerate(self.dim_axes):
            if axis in axes:
                return d
        return None

    def num_tiles(self, mesh_shape) -> int:
        return math.prod(mesh_shape[a] for a in self.used_axes)

    def tile_dims(self, dims, mesh_shape) -> tuple[int, ...]:
        """Per-device shape (rounded up where a dimension does not divide)."""
        return tuple(-(-d // math.prod(mesh_shape[a] for a in axes))
                     for d, axes in zip(dims, self.dim_axes))

    def tile_bytes(self, dims, element_bits: int, mesh_shape) -> int:
        """Bytes of one device's tile (of `tile_dims`), rounded up to whole bytes."""
        return (math.prod(self.tile_dims(dims, mesh_shape)) * element_bits + 7) // 8

    def divides(self, dims, mesh_shape) -> bool:
        return all(d % math.prod(mesh_shape[a] for a in axes) == 0
                   for d, axes in zip(dims, self.dim_axes))

    def without_partial(self) -> "Sharding":
        return Sharding(self.dim_axes)

    def __str__(self) -> str:
        """`S0,R` style: per dimension R (replicated) or S followed by the mesh axes."""
        text = ",".join("S" + "".join(map(str, axes)) if axes else "R" for axes in self.dim_axes)
        if self.partial:
            text += " partial@" + "".join(map(str, self.partial))
        return text or "scalar"

    def to_xla(self, mesh_shape) -> str:
        """XLA sharding string on a mesh whose partition ids are 0..n-1 in row-major order."""
        if self.partial:
            raise ValueError("a partial-sum value has no XLA sharding; reduce it first")
        mesh_shape = tuple(mesh_shape)
        if self.num_tiles(mesh_shape) == 1:
            return "{replicated}"
        free = [a for a in range(len(mesh_shape)) if a not in self.used_axes]
        tile = [math.prod(mesh_shape[a] for a in axes) for axes in self.dim_axes]
        replicate = math.prod(mesh_shape[a] for a in free)
        perm = list(self.used_axes) + free
        dims = tile + ([replicate] if replicate > 1 else [])
        text = "{devices=[" + ",".join(map(str, dims)) + "]"
        if perm == sorted(perm):  # XLA writes an untransposed iota as one flat range
            text += f"<=[{math.prod(mesh_shape)}]"
        else:
            text += "<=[" + ",".join(map(str, mesh_shape)) + "]T(" + ",".join(
                map(str, perm)) + ")"
        if replicate > 1:
            text += " last_tile_dim_replicate"
        return text + "}"


@dataclass(frozen=True)
class XlaSharding:
    """A parsed XLA sharding string (array or tuple)."""

    kind: str  # "replicated" | "maximal" | "manual" | "tiled" | "tuple" | "unknown"
    tile_dims: tuple[int, ...] = ()  # including a trailing replication dim if present
    devices: tuple[int, ...] = ()  # partition ids in tile order
    replicate_last: bool = False
    elements: tuple["XlaSharding", ...] = ()
    text: str = ""

    def to_sharding(self, mesh_shape, rank: int) -> Sharding | None:
        """The `Sharding` on a row-major mesh of this shape that XLA's string denotes, or None
        when the tiling is not a mesh-axis split of that mesh."""
        if self.kind == "replicated":
            return Sharding.replicated(rank)
        if self.kind != "tiled":
            return None
        mesh_shape = tuple(mesh_shape)
        tile = list(self.tile_dims[:rank])
        if len(tile) != rank or math.prod(self.tile_dims) != math.prod(mesh_shape):
            return None
        for candidate in _candidate_shardings(mesh_shape, tile):
            probe = parse_xla_sharding(candidate.to_xla(mesh_shape))
            if probe.kind == "replicated":
                if all(t == 1 for t in tile):
                    return candidate
                continue
            if _same_groups(probe, self):
                return candidate
        return None


def _candidate_shardings(mesh_shape, tile):
    """Every assignment of mesh axes to dimensions whose products match `tile`."""
    axes = list(range(len(mesh_shape)))

    def assign(d, remaining):
        if d == len(tile):
            yield ()
            return
        for k in range(len(remaining) + 1):
            for combo in _ordered_subsets(remaining, k):
                if math.prod(mesh_shape[a] for a in combo) == tile[d]:
                    rest = [a for a in remaining if a not in combo]
                    for tail in assign(d + 1, rest):
                        yield (combo,) + tail

    for dim_axes in assign(0, axes):
        yield Sharding(dim_axes)


def _ordered_subsets(items, k):
    from itertools import permutations
    return permutations(items, k)


def _same_groups(a: XlaSharding, b: XlaSharding) -> bool:
    """Same tile -> device-set mapping (device order within a replication group ignored)."""
    if a.tile_dims != b.tile_dims or a.replicate_last != b.replicate_last:
        return False
    ga = np.array(a.devices).reshape(a.tile_dims)
    gb = np.array(b.devices).reshape(b.tile_dims)
    if a.replicate_last:
        return bool(np.array_equal(np.sort(ga, axis=-1), np.sort(gb, axis=-1)))
    return bool(np.array_equal(ga, gb))


_IOTA = re.compile(r"<=\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?")


def parse_xla_sharding(text: str) -> XlaSharding:
    """Parse `{...}` as XLA prints shardings; unknown forms give kind 'unknown'."""
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1].strip()
    if body.startswith("{"):
        from alpac.hlo.parser import split_top_level
        elements = tuple(parse_xla_sharding(body[a:b].strip())
                         for a, b in split_top_level(body))
        return XlaSharding("tuple", elements=elements, text=text)
    body = re.sub(r"\s*metadata=\{.*\}\s*$", "", body)
    if body == "replicated" or body == "":
        return XlaSharding("replicated", text=text)
    if body.startswith("maximal"):
        return XlaSharding("maximal", text=text)
    if body == "manual":
        return XlaSharding("manual", text=text)
    m = re.match(r"devices=\[([\d,\s]*)\]\s*(.*)$", body, re.S)
    if not m:
        return XlaSharding("unknown", text=text)
    tile = tuple(int(x) for x in m.group(1).split(",") if x.strip())
    rest = m.group(2)
    iota = _IOTA.match(rest)
    if iota:
        reshape = [int(x) for x in iota.group(1).split(",") if x.strip()]
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if iota.group(2):
            ids = np.transpose(ids, [int(x) for x in iota.group(2).split(",")])
        devices = tuple(int(x) for x in ids.reshape(-1))
        rest = rest[iota.end():]
    else:
        ids = re.match(r"([\d,\s]+)", rest)
        devices = tuple(int(x) for x in ids.group(1).split(",") if x.strip()) if ids else ()
        rest = rest[ids.end():] if ids else rest
    replicate_last = "last_tile_dim_replicate" in rest
    if "last_tile_dims" in rest or "last_dims" in rest:
        kinds = re.search(r"last_(?:tile_)?dims=\{([^}]*)\}", rest)
        if kinds and kinds.group(1).strip() == "replicated":
            replicate_last = True
        else:
            return XlaSharding("unknown", tile, devices, text=text)
    if len(devices) != math.prod(tile):
        return XlaSharding("unknown", tile, devices, text=text)
    return XlaSharding("tiled", tile, devices, replicate_last, text=text)
