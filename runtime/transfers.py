"""Moving arrays: between meshes over MPI (as `resharding.plan` says), and from one sharding
to another inside a mesh (an identity module XLA partitions: all-gather, all-to-all, ...).

Every rank of the source mesh sends the pieces its devices hold, packed into one message per
destination rank, right after the producing task; every rank of the destination mesh
receives the pieces for its devices right before the first reader, puts them on its devices,
and (local all-gather) runs the identity module from the receive layout to the destination
sharding. Pieces between two devices of the same rank go through a local mailbox. Bytes are
counted on the receiving side, per (source mesh, destination mesh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from alpac.runtime import resharding
from alpac.runtime.comm import Comm
from alpac.xla.bridge import (compile_hlo, host_to_devices, partition_indices,
                              sharding_from_text)

TAG_BASE = 16
TAG_CARRY = 1 << 24


def host_dtype(hlo_type: str) -> np.dtype:
    if hlo_type == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    table = {"pred": np.bool_, "s8": np.int8, "s16": np.int16, "s32": np.int32,
             "s64": np.int64, "u8": np.uint8, "u16": np.uint16, "u32": np.uint32,
             "u64": np.uint64, "f16": np.float16, "f32": np.float32, "f64": np.float64,
             "c64": np.complex64, "c128": np.complex128}
    if hlo_type not in table:
        raise ValueError(f"unsupported element type {hlo_type}")
    return np.dtype(table[hlo_type])


def _slices(region, origin) -> tuple:
    return tuple(slice(a - o, b - o) for (a, b), o in zip(region, origin))


@dataclass
class Move:
    """One move of one array version from a source mesh to a destination mesh."""
    id: int
    tag: int
    what: str  # for messages
    src_mesh: int
    dst_mesh: int
    src_sharding: str
    dst_sharding: str
    shape: list[int]
    dtype: str


class SameLayout:
    """Whether two jax shardings lay an array out alike (memoized: the runtime asks the same
    question about the same sharding objects every step, for every argument it hands over)."""

    def __init__(self):
        self._seen: dict[tuple, tuple] = {}

    def __call__(self, a, b, ndim: int) -> bool:
        if a is b:
            return True
        key = (id(a), id(b), ndim)
        hit = self._seen.get(key)
        if hit is None or hit[0] is not a or hit[1] is not b:
            hit = self._seen[key] = (a, b, a.is_equivalent_to(b, ndim))
        return hit[2]


class Mover:
    def __init__(self, comm: Comm, meshes: list[list], rank_of_device: dict[int, int],
                 mesh_ids: list[list[int]], watchdog_timeout: float,
                 allgather_min_bytes: int = 0):
        self.comm = comm
        self.meshes = meshes  # per mesh: jax devices in partition order (None: elsewhere)
        self.mesh_ids = mesh_ids  # per mesh: plan device ids
        self.rank_of = rank_of_device
        self.timeout = watchdog_timeout
        # replicated destinations whose region is smaller go to one device per region and are
        # copied to the others, instead of XLA's all-gather (latency over bandwidth)
        self.allgather_min_bytes = allgather_min_bytes
        self._plans: dict[tuple, tuple] = {}
        self._receiving: dict[int, tuple] = {}  # move tag -> `_incoming`
        self._shardings: dict[tuple, object] = {}
        self._reshard_exes: dict[tuple, object] = {}
        self.equivalent = SameLayout()
        self._mailbox: dict[int, list[np.ndarray]] = {}
        self.bytes: dict[tuple[int, int], int] = {}  # (src mesh, dst mesh) -> bytes received
        self.forward_bytes = 0  # inside destination meshes (replicas without local all-gather)
        self.seconds = 0.0
        self.arrived: float | None = None  # when the last receive's last message came in

    # ---- layouts -----------------------------------------------------------------------
    def sharding(self, text: str, mesh: int):
        key = (text, mesh)
        s = self._shardings.get(key)
        if s is None:
            s = self._shardings[key] = sharding_from_text(text, self.meshes[mesh])
        return s

    def regions(self, text: str, mesh: int, shape: list[int]) -> list:
        """Per partition of `mesh`, the region of the array it holds under `text`."""
        index = partition_indices(text, shape, len(self.mesh_ids[mesh]))
        return [resharding.region_of(i, shape) for i in index]

    def _plan(self, mv: Move):
        key = (mv.src_mesh, mv.dst_mesh, mv.src_sharding, mv.dst_sharding, tuple(mv.shape))
        found = self._plans.get(key)
        if found is None:
            src = self.regions(mv.src_sharding, mv.src_mesh, mv.shape)
            dst = self.regions(mv.dst_sharding, mv.dst_mesh, mv.shape)
            src_rank = [self.rank_of[d] for d in self.mesh_ids[mv.src_mesh]]
            dst_rank = [self.rank_of[d] for d in self.mesh_ids[mv.dst_mesh]]
            nbytes = resharding.size(dst[0]) * host_dtype(mv.dtype).itemsize
            rp = resharding.plan(mv.shape, src, dst, src_rank, dst_rank,
                                 local_allgather=nbytes >= self.allgather_min_bytes)
            found = self._plans[key] = (rp, src, src_rank, dst_rank)
        return found

    # ---- inside a mesh -----------------------------------------------------------------
    def reshard(self, array, text: str, mesh: int, dtype: str, copy: bool = False):
        """`array` (on mesh `mesh`) laid out as `text` (identity module, cached); with
        `copy`, a new array even when it is laid out so already."""
        from alpac.xla.bridge import sharding_text_of
        target = self.sharding(text, mesh)
        shape = list(array.shape)
        if not copy and self.equivalent(array.sharding, target, len(shape)):
            return array
        src_text = sharding_text_of(array.sharding, len(shape))
        key = (mesh, tuple(shape), dtype, src_text, text)
        exe = self._reshard_exes.get(key)
        if exe is None:
            exe = self._reshard_exes[key] = compile_hlo(
                identity_module(shape, dtype, src_text, text), self.meshes[mesh])
        self.comm.watchdog.arm(f"resharding on mesh {mesh} (waiting for its other ranks)",
                               self.timeout)
        try:
            out = exe.run_sharded([array])[0]
            out.block_until_ready()
        finally:
            self.comm.watchdog.disarm()
        return out

    # ---- between meshes ----------------------------------------------------------------
    def send(self, mv: Move, array) -> None:
        """Send the pieces this rank's devices hold (call on every rank of the source mesh)."""
        import time
        t0 = time.perf_counter()
        me = self.comm.rank
        array = self.reshard(array, mv.src_sharding, mv.src_mesh, mv.dtype)
        rp, src_regions, src_rank, dst_rank = self._plan(mv)
        shards = {s.device: s for s in array.addressable_shards}
        host: dict[int, np.ndarray] = {}
        out: dict[int, list[np.ndarray]] = {}
        for p in rp.pieces:
            if src_rank[p.src] != me:
                continue
            if p.src not in host:
                host[p.src] = np.asarray(shards[self.meshes[mv.src_mesh][p.src]].data)
            origin = [a for a, _ in src_regions[p.src]]
            out.setdefault(dst_rank[p.dst], []).append(host[p.src][_slices(p.region, origin)])
        for rank, parts in sorted(out.items()):
            if rank == me:
                self._mailbox[mv.id] = [np.array(x, copy=True) for x in parts]
            else:
                self.comm.isend(_pack(parts), rank, mv.tag)
        self.seconds += time.perf_counter() - t0

    def _incoming(self, mv: Move) -> tuple:
        """What this rank receives of a move, worked out once per move: its destination
        devices, the shape of the buffer each receives into, and per sending rank (in rank
        order) the elements it sends and each piece's (device, slices of its buffer, shape)."""
        found = self._receiving.get(mv.tag)
        if found is None:
            rp, _, src_rank, dst_rank = self._plan(mv)
            me = self.comm.rank
            mine = [j for j, r in enumerate(dst_rank) if r == me]
            receivers = {p.dst for p in rp.pieces}
            shapes = {j: [b - a for a, b in rp.recv_regions[j]] for j in mine if j in receivers}
            by_rank: dict[int, list] = {}
            for p in rp.pieces:
                if dst_rank[p.dst] == me:
                    origin = [a for a, _ in rp.recv_regions[p.dst]]
                    by_rank.setdefault(src_rank[p.src], []).append(
                        (p.dst, _slices(p.region, origin), [b - a for a, b in p.region]))
            incoming = [(rank, sum(math.prod(shape) for _, _, shape in pieces), pieces)
                        for rank, pieces in sorted(by_rank.items())]
            found = self._receiving[mv.tag] = (mine, shapes, incoming)
        return found

    def receive(self, mv: Move):
        """The array on the destination mesh in the destination sharding (call on every rank
        of the destination mesh)."""
        import time
        t0 = time.perf_counter()
        self.arrived = None
        me = self.comm.rank
        rp, _, src_rank, dst_rank = self._plan(mv)
        dtype = host_dtype(mv.dtype)
        mine, shapes, incoming = self._incoming(mv)
        bufs = {j: np.empty(shape, dtype) for j, shape in shapes.items()}
        moved = 0
        for rank, nbytes, pieces in incoming:
            if rank == me:
                parts = self._mailbox.pop(mv.id)
            else:
                raw = self.comm.recv(np.empty(nbytes * dtype.itemsize, np.uint8), rank, mv.tag,
                                     mv.what)
                self.arrived = time.perf_counter()
                parts = _unpack(raw, [shape for _, _, shape in pieces], dtype)
            for (j, where, _), data in zip(pieces, parts):
                bufs[j][where] = data
                moved += data.nbytes
        pair = (mv.src_mesh, mv.dst_mesh)
        self.bytes[pair] = self.bytes.get(pair, 0) + moved
        for leader, replica in rp.forwards:
            if dst_rank[leader] == me and dst_rank[replica] == me:
                bufs[replica] = bufs[leader].copy()
            elif dst_rank[leader] == me:
                self.comm.isend(bufs[leader], dst_rank[replica], mv.tag + 1)
                self.forward_bytes += bufs[leader].nbytes
            elif dst_rank[replica] == me:
                shape = [b - a for a, b in rp.recv_regions[replica]]
                raw = self.comm.recv(np.empty(int(np.prod(shape)) * dtype.itemsize, np.uint8),
                                     dst_rank[leader], mv.tag + 1, mv.what)
                self.arrived = time.perf_counter()
                bufs[replica] = _unpack(raw, [shape], dtype)[0]
        layout = rp.sharding_text() or mv.dst_sharding
        # one batched copy onto this rank's devices (a device_put each: ~7x the host time)
        by_region = {rp.recv_regions[j]: bufs[j] for j in mine}
        array = host_to_devices(
            tuple(mv.shape), self.sharding(layout, mv.dst_mesh),
            lambda index: by_region[resharding.region_of(index, mv.shape)])
        if rp.sharding_text() is not None:
            array = self.reshard(array, mv.dst_sharding, mv.dst_mesh, mv.dtype)
        self.seconds += time.perf_counter() - t0
        return array

    def crossing_bytes(self, mv: Move) -> int:
        """Bytes the move sends between the meshes in all (for the plan's prediction)."""
        rp = self._plan(mv)[0]
        return rp.crossing_elements() * host_dtype(mv.dtype).itemsize


def _pack(parts: list[np.ndarray]) -> np.ndarray:
    if len(parts) == 1:
        return np.ascontiguousarray(parts[0]).reshape(-1).view(np.uint8)
    return np.concatenate([np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in parts])


def _unpack(raw: np.ndarray, shapes: list[list[int]], dtype: np.dtype) -> list[np.ndarray]:
    out, pos = [], 0
    for shape in shapes:
        n = int(np.prod(shape)) * dtype.itemsize
        out.append(raw[pos:pos + n].view(dtype).reshape(shape))
        pos += n
    return out


def zeros_module(arrays: list[tuple[list[int], str, str]]) -> str:
    """HLO text of a module without parameters giving zeros of each (shape, type, sharding)."""
    types = [f"{dtype}[{','.join(map(str, shape))}]" for shape, dtype, _ in arrays]
    lines = []
    for i, ((shape, dtype, sharding), t) in enumerate(zip(arrays, types)):
        zero = {"pred": "false", "c64": "(0, 0)", "c128": "(0, 0)"}.get(dtype, "0")
        lines += [f"  %z{i} = {dtype}[] constant({zero})",
                  f"  %b{i} = {t} broadcast(%z{i}), dimensions={{}}, sharding={sharding}"]
    result = f"({', '.join(types)})"
    shardings = ", ".join(s for _, _, s in arrays)
    return (f"HloModule alpac_zeros\n\nENTRY %main () -> {result} {{\n" + "\n".join(lines) +
            f"\n  ROOT %r = {result} tuple({', '.join(f'%b{i}' for i in range(len(arrays)))}), "
            f"sharding={{{shardings}}}\n}}\n")


def identity_module(shape: list[int], dtype: str, src: str, dst: str) -> str:
    """HLO text of `copy` from sharding `src` to sharding `dst` (XLA inserts the collectives)."""
    dims = ",".join(map(str, shape))
    layout = "{" + ",".join(map(str, reversed(range(len(shape))))) + "}" if shape else ""
    t = f"{dtype}[{dims}]"
    return (f"HloModule alpac_reshard, entry_computation_layout={{({t}{layout})->{t}{layout}}}\n\n"
            f"ENTRY %main (p: {t}) -> {t} {{\n"
            f"  %p = {t}{layout} parameter(0), sharding={src}\n"
            f"  ROOT %r = {t}{layout} copy(%p), sharding={dst}\n"
            f"}}\n")
