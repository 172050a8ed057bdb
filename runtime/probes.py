"""What `alpac calibrate` measures on each rank: the points of the grid, and the small jitted
programs that time them.

A point is one row of one table of cluster.yaml's `calibration:` section (a dot level has
three shapes, whose median is the row). Every figure is the median of repeated timings after
a warm-up; work shorter than `TARGET` seconds is repeated inside one execution (a while loop
whose trip count is an argument, so one compilation serves every count) and divided, so that
the tables price the work itself and `launch_s` the launching of a module. Rank 0 chooses the
repeat count for every rank taking part, so that all run alike.

Every device works at once, as in a plan's run: each rank runs an SPMD program over all of
its devices, and the ranks start each timing together (on CPU they share the cores; a device
timed alone would look several times faster than it runs). Collectives across ranks and
sends between ranks involve only the ranks in the group, rank 0 always among them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
REPS = 5
TARGET = 4e-3  # seconds: shorter work is repeated inside one execution
# Across ranks, a collective sometimes waits a scheduler tick for another process (gloo on
# CPU: a small all-reduce takes 0.35 ms back to back, 4 ms now and then, more often with gaps
# between them): longer and more timings, so that the median is the back-to-back cost.
ACROSS_REPS, ACROSS_TARGET = 9, 50e-3
# the largest message across ranks in the full grid: a 64 MiB one costs gloo seconds per
# collective (a 5-minute budget for 4 ranks on 2 cores); the tables extrapolate past it
ACROSS_MAX_BYTES = 16 << 20
MAX_REPEAT = 512
TAG_REPEAT = (1 << 28) + 16
TAG_PING = (1 << 28) + 17


@dataclass(frozen=True)
class Point:
    """One row to measure: `table` is its key path under `calibration:`, `size` the row's
    FLOPs or bytes; `shape` is (m, k, n) for a dot, (ranks, devices per rank) for a
    collective's group."""
    table: tuple[str, ...]
    size: int
    shape: tuple[int, ...] = ()

    @property
    def phase(self) -> str:
        """"inter" for collectives across ranks (multi-process jax), else "local"."""
        return "inter" if self.table[:2] == ("collectives", "inter_node") else "local"

    def describe(self) -> str:
        what = ".".join(self.table)
        if self.table[0] == "dot":
            return f"{what} {'x'.join(map(str, self.shape))}"
        return what if self.table[0] == "launch_s" else f"{what} {self.size:,} B"


# ---- the grid ------------------------------------------------------------------------------

def dot_shapes(side: int) -> list[tuple[int, int, int]]:
    """Three shapes of 2*side^3 FLOPs: square, tall with a narrow output, a small batch."""
    return [(side, side, side), (4 * side, side, side // 4), (side // 16, 4 * side, 4 * side)]


def dot_side(flops: float) -> int:
    return max(16, round((flops / 2) ** (1 / 3) / 16) * 16)


def group_sizes(n: int) -> list[int]:
    """Powers of two up to n, and n."""
    return sorted({2 ** i for i in range(1, n.bit_length()) if 2 ** i <= n} | ({n} - {1}))


def collective_bytes(nbytes: float, group: int) -> int:
    """The row size of a collective near `nbytes`: whole f32 elements that split evenly."""
    return 4 * max(group, round(nbytes / 4 / group) * group)


def grid(nodes: int, k: int, quick: bool) -> list[Point]:
    """Every point of a calibration of `nodes` ranks of `k` devices."""
    sides = (32, 128, 512) if quick else (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                                          1536)
    arrays = [4096 * 16 ** i for i in range(3)] if quick else [4096 * 4 ** i for i in range(8)]
    messages = [1024 * 32 ** i for i in range(3)] if quick else [1024 * 4 ** i for i in range(9)]
    points = [Point(("launch_s",), 1)]
    for dtype, top in (("f32", sides[-1]), ("bf16", 256 if quick else 1024)):
        points += [Point(("dot", dtype), 2 * s ** 3, shape) for s in sides if s <= top
                   for shape in dot_shapes(s)]
    points += [Point(("elementwise",), 2 * b) for b in arrays]
    points += [Point(("reduce",), b) for b in arrays]
    groups = [("intra_node", (1, g)) for g in group_sizes(k)]
    groups += [("inter_node", (g, 1)) for g in group_sizes(nodes)]
    groups += [("inter_node", (nodes, k))] if nodes > 1 and k > 1 and not quick else []
    for link, (ranks, per) in groups:
        for kind in COLLECTIVES:
            points += [Point(("collectives", link, kind, str(ranks * per)),
                             collective_bytes(b, ranks * per), (ranks, per))
                       for b in messages if link == "intra_node" or b <= ACROSS_MAX_BYTES]
    for link, present in (("intra_node", k > 1), ("inter_node", nodes > 1)):
        points += [Point(("send", link), b) for b in messages] if present else []
    return points


# ---- timing --------------------------------------------------------------------------------

def per_op(run, agree, ops: int = 1, sync=None) -> float:
    """Seconds per operation of `run(r)`, which does `r * ops` operations and waits for them.
    `agree(r)` gives every rank taking part rank 0's repeat count, so that all run alike; the
    ranks warm up with it. With `sync()` (work every rank does at once) each timing starts in
    step with the other ranks; without (work across ranks, whose collectives wait for each
    other) the timings are more and longer."""
    def clock(repeat: int) -> float:
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        run(repeat)
        return time.perf_counter() - t0

    run(1)  # compiles and warms up
    once = [clock(1) for _ in range(3)]
    target, reps = (TARGET, REPS) if sync is not None else (ACROSS_TARGET, ACROSS_REPS)
    repeat = agree(max(1, min(MAX_REPEAT, int(target / max(min(once), 1e-7)))))
    if repeat == 1:  # long work: the first timings count
        return statistics.median(once + [clock(1) for _ in range(reps - 3)]) / ops
    run(repeat)
    return statistics.median(clock(repeat) for _ in range(reps)) / (repeat * ops)


class Rank:
    """This rank's devices and communicator, and the programs that measure each table."""

    def __init__(self, comm, jax, k: int, distributed: bool):
        self.comm, self.jax, self.k = comm, jax, k
        self.local = sorted(jax.local_devices(), key=lambda d: d.id)[:k]
        self.everywhere = sorted(jax.devices(), key=lambda d: d.id) if distributed else None

    def _timed(self, run, ops: int = 1) -> float:
        """`per_op` of work every rank does at once, on all of its devices: the ranks start
        each timing together, so that the devices share the machine as in a plan's run."""
        return per_op(run, self._agree(self.comm.size), ops,
                      sync=lambda: self.comm.barrier("the other ranks to time"))

    def measure(self, p: Point) -> float | None:
        """Seconds of the point's work, or None on a rank that takes no part in it."""
        kind = p.table[0]
        if kind == "launch_s":
            return self.launch()
        if kind == "dot":
            return self.dot(p.table[1], *p.shape)
        if kind in ("elementwise", "reduce"):
            return self.memory(kind, p.size)
        if kind == "collectives":
            ranks, per = p.shape
            across = p.table[1] == "inter_node"
            if across and self.comm.rank >= ranks:
                return None
            return self.collective(p.table[2], p.size, ranks, per, across)
        if p.table[1] == "intra_node":
            return self.send_local(p.size)
        return self.send_between_ranks(p.size) if self.comm.rank < 2 else None

    # ---- on each device of the rank ----------------------------------------------------
    def _spmd(self, body, replicated: int = 0):
        """`body(x, *replicated, r)` on every device of the rank, x split on axis 0."""
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P
        mesh = Mesh(np.array(self.local), ("d",))
        specs = (P("d"),) + (P(),) * (replicated + 1)
        return mesh, self.jax.jit(self.jax.shard_map(body, mesh=mesh, in_specs=specs,
                                                     out_specs=P("d"), check_vma=False))

    def _put(self, mesh, spec, array):
        from jax.sharding import NamedSharding
        return self.jax.device_put(array, NamedSharding(mesh, spec))

    def launch(self) -> float:
        """A tiny module on the rank's devices, run the way alpa-run runs a module (the XLA
        bridge), executed and waited for."""
        from alpac.xla.bridge import compile_hlo, execute_unchecked, jax_parameter_shardings
        exe = compile_hlo("HloModule tiny\nENTRY e {\n  p = f32[1] parameter(0)\n"
                          "  c = f32[1] constant({1})\n  ROOT a = f32[1] add(p, c)\n}\n",
                          self.local)
        x = self.jax.device_put(np.zeros(1, np.float32), jax_parameter_shardings(exe)[0])

        def run(r):
            for _ in range(r):
                execute_unchecked(exe, [x])[0].block_until_ready()
        return self._timed(run)

    def dot(self, dtype: str, m: int, k: int, n: int) -> float:
        """[m,k]x[k,n] and back ([m,n]x[n,k]), repeated: two dots of 2mkn FLOPs each."""
        from jax import lax
        from jax.sharding import PartitionSpec as P
        jnp = self.jax.numpy
        t = jnp.float32 if dtype == "f32" else jnp.bfloat16
        # weights 1/k and 1/n keep the values at 1: no overflow, no denormals
        mesh, f = self._spmd(lambda x, a, b, r: lax.fori_loop(0, r, lambda i, y: (y @ a) @ b, x),
                             replicated=2)
        x = self._put(mesh, P("d"), np.ones((self.k * m, k), t))
        a = self._put(mesh, P(), np.full((k, n), 1 / k, t))
        b = self._put(mesh, P(), np.full((n, k), 1 / n, t))
        return self._timed(lambda r: f(x, a, b, r).block_until_ready(), ops=2)

    def memory(self, kind: str, nbytes: int) -> float:
        """A fused chain of four elementwise ops over an f32 array (`nbytes` read + written),
        or a row reduction of one (`nbytes` read)."""
        from jax import lax
        from jax.sharding import PartitionSpec as P
        jnp = self.jax.numpy
        n = nbytes // (8 if kind == "elementwise" else 4)
        cols = min(n, 1024)
        if kind == "elementwise":
            def body(x, r):
                return lax.fori_loop(0, r, lambda i, y: jnp.maximum(y * 0.5 + 0.25, -1.0) * 1.5, x)
        else:
            def body(x, r):  # the scale carried from one sum to the next keeps each one
                s = lax.fori_loop(0, r, lambda i, s: s + jnp.sum(jnp.sum(x * s, axis=1)) * 1e-30,
                                  jnp.float32(1.0))
                return x[:1] * s
        mesh, f = self._spmd(body)
        x = self._put(mesh, P("d"), np.ones((self.k * (n // cols), cols), np.float32))
        return self._timed(lambda r: f(x, r).block_until_ready())

    # ---- collectives and sends -----------------------------------------------------------
    def collective(self, kind: str, nbytes: int, ranks: int, per: int, across: bool) -> float:
        """One collective of `nbytes` (the convention of the cost model) over a group of
        `per` devices on each of `ranks` ranks, repeated; inside a rank, every device of it
        in groups of `per` at once."""
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P
        g = ranks * per
        if across:
            devices = [d for d in self.everywhere if d.process_index < ranks][:g] if per > 1 \
                else [self.everywhere[r * self.k] for r in range(ranks)]
            mesh = Mesh(np.array(devices).reshape(1, g), ("o", "i"))
        else:
            rows = self.k // g
            mesh = Mesh(np.array(self.local[:rows * g]).reshape(rows, g), ("o", "i"))
        step = _collective_step(kind, g)
        f = self.jax.jit(self.jax.shard_map(
            lambda x, r: self.jax.lax.fori_loop(0, r, lambda i, y: step(y), x), mesh=mesh,
            in_specs=(P(("o", "i")), P()), out_specs=P(("o", "i")), check_vma=False))
        local = nbytes // 4 // (g if kind == "all-gather" else 1)
        shape = (mesh.size * local,)
        x = self.jax.make_array_from_callback(
            shape, self.jax.sharding.NamedSharding(mesh, P(("o", "i"))),
            lambda index: np.ones(local, np.float32))
        if not across:
            return self._timed(lambda r: f(x, r).block_until_ready())
        self.comm.watchdog.arm(f"in a {kind} of {g} devices", self.comm.timeout)
        try:
            return per_op(lambda r: f(x, r).block_until_ready(), self._agree(ranks))
        finally:
            self.comm.watchdog.disarm()

    def send_local(self, nbytes: int) -> float:
        """Device 0 to device 1 of this rank as alpa-run moves a piece inside a rank: to the
        host, a copy (its mailbox), onto the other device."""
        x = self.jax.device_put(np.ones(nbytes // 4, np.float32), self.local[0])

        def run(r):
            for _ in range(r):
                host = np.array(np.asarray(x), copy=True)
                self.jax.device_put(host, self.local[1]).block_until_ready()
        return self._timed(run)

    def send_between_ranks(self, nbytes: int) -> float:
        """Device 0 of rank 0 to device 0 of rank 1 and back over MPI, as alpa-run moves a
        piece between meshes (to the host, MPI, onto the device): half a round trip."""
        comm, peer = self.comm, 1 - self.comm.rank
        x = self.jax.device_put(np.ones(nbytes // 4, np.float32), self.local[0])
        buf = np.empty(nbytes // 4, np.float32)

        def hop(first: bool):
            nonlocal x
            if first:
                comm.isend(np.asarray(x), peer, TAG_PING)
                comm.flush(f"rank {peer} to take a message")
            else:
                comm.recv(buf, peer, TAG_PING, "a message")
                x = self.jax.device_put(buf, self.local[0])
                x.block_until_ready()

        def run(r):
            for _ in range(r):
                hop(comm.rank == 0)
                hop(comm.rank == 1)
        return per_op(run, self._agree(2), ops=2)

    def _agree(self, ranks: int):
        def agree(repeat: int) -> int:
            if self.comm.rank == 0:
                for r in range(1, ranks):
                    self.comm.send_obj(repeat, r, TAG_REPEAT)
                self.comm.flush("the other ranks to take the repeat count")
                return repeat
            return self.comm.recv_obj(0, TAG_REPEAT, "the repeat count")
        return agree


def _collective_step(kind: str, g: int):
    """One collective over mesh axis "i" of size g, shaped so that it can repeat: its result
    has its operand's shape (a slice or tile where the collective changes it)."""
    from jax import lax
    if kind == "all-reduce":
        return lambda y: lax.psum(y, "i") * (1.0 / g)
    if kind == "all-gather":
        return lambda y: lax.all_gather(y, "i", tiled=True)[: y.shape[0]]
    if kind == "reduce-scatter":
        import jax.numpy as jnp
        return lambda y: jnp.tile(lax.psum_scatter(y, "i", tiled=True), g)
    if kind == "all-to-all":
        return lambda y: lax.all_to_all(y.reshape(g, -1), "i", 0, 0, tiled=True).reshape(-1)
    return lambda y: lax.ppermute(y, "i", [(j, (j + 1) % g) for j in range(g)])
