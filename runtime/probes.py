"""The small jitted programs that time, on each rank, the points of `alpac calibrate`'s grid
(`calibration_grid`).

A point is one row of one table of cluster.yaml's `calibration:` section (a dot level has
three shapes, whose median is the row). Every figure is the median of repeated timings after
a warm-up (`alpac.runtime.timing`). Dots, elementwise kernels and reductions are timed as
alpa-run runs a module of them, up to 16 one after the other, each into a new result, the
module's launch and arrays subtracted (`Rank._per_kernel`): so the tables price XLA's work
per kernel, which a loop repeating one kernel hides. The per-op arithmetic, the concurrency
dot and the collectives inside one process are repeated inside one execution instead (a
while loop whose trip count is an argument, so one compilation serves every count) and
divided; collectives under multi-process jax are timed a few per execution, each after a
dot, as a plan's module runs them (`Rank._in_modules`). Each iteration of that loop does the
work `UNROLL` times over, kept apart by optimization barriers (no fusion across them): a GPU
pays 15-30 µs per while-loop iteration (its condition read back by the host), which would
otherwise be counted as every small kernel's cost. Rank 0 chooses the repeat count for every
rank taking part, so that all run alike.

Every device works at once, as in a plan's run: each rank runs an SPMD program over all of
its devices, and the ranks start each timing together (on CPU they share the cores; a device
timed alone would look several times faster than it runs). The `concurrency` table says by
how much: one dot timed with 1, 2, 4, ... devices working at once, the plan that leaves
devices idle is priced from it. Collectives across ranks and sends between ranks involve
only the ranks in the group, rank 0 always among them. The host's work around a module
execution (launching, arrays, feeding, freeing) is timed by `HostProbes`
(`alpac.runtime.host_probes`).
"""

from __future__ import annotations

import statistics

import numpy as np

from alpac.plan.calibration import COMBINED_OPERANDS
from alpac.runtime.calibration_grid import Point
from alpac.runtime.host_probes import HostProbes
from alpac.runtime.probe_programs import collective_step, dots_hlo, kernels_hlo
from alpac.runtime.timing import per_op

UNROLL = 8  # the dot and arithmetic work done per loop iteration
# elementwise and reduce kernels: up to this many in one module, and to this many bytes
STRAIGHT_KERNELS, STRAIGHT_BYTES = 16, 64 << 20
STRAIGHT_FLOPS = 1e7  # and dots to this many FLOPs per device (one at least)
MATRICES, MATRIX_SIDE = 256, 16  # the batched dots of `matrix_s`
IN_A_MODULE = 8  # collectives per execution under multi-process jax, to 1 MiB
TAG_REPEAT = (1 << 28) + 16
TAG_PING = (1 << 28) + 17
TAG_RELEASE = (1 << 28) + 18


def _unrolled(step, x, times: int = UNROLL):
    """`step` applied `times` times, an optimization barrier between two (XLA fuses nothing
    across one, so each application is a kernel of its own as in the timed program)."""
    from jax import lax
    for i in range(times):
        x = step(lax.optimization_barrier(x) if i else x)
    return x


class Rank(HostProbes):
    """This rank's devices and communicator, and the programs that measure each table."""

    def __init__(self, comm, jax, k: int, distributed: bool):
        self.comm, self.jax, self.k = comm, jax, k
        self.local = sorted(jax.local_devices(), key=lambda d: d.id)[:k]
        self.everywhere = sorted(jax.devices(), key=lambda d: d.id) if distributed else None
        self.launch_s: float | None = None  # `launch`'s figure, once measured
        # `alone`'s launch on rank 0, once measured (0 on the other ranks, which kept step)
        self.launch_alone_s: float | None = None
        self._work_on: dict[tuple, float] = {}  # (mesh, count) -> its dots (_in_modules)
        self._host: dict[str, float] = {}  # `_once`: the host's figures per array

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
        if kind == "array_s":
            return self._array_s(alone=False)
        if kind == "argument_s":
            return self._argument_s(alone=False)
        if kind in ("launch_alone_s", "array_alone_s", "argument_alone_s",
                    "launch_cpu_alone_s"):
            return self.alone(kind)
        if kind == "launch_cpu_s":
            return self.launch_cpu()
        if kind in ("pause_cpu_s", "pause_s"):
            return self.pause(kind)
        if kind in ("feed_s", "free_s"):
            return self.while_others_busy(self.feed if kind == "feed_s" else self.free)
        if kind in ("flop_s", "transcendental_s"):
            return self.arithmetic(kind)
        if kind == "matrix_s":
            return self.matrix_s()
        if kind == "dot":
            return self.dot_kernels(p.table[1], *p.shape)
        if kind == "concurrency":
            return self.concurrent(p.size)
        if kind == "alone":
            return self.compute_alone(p)
        if kind in ("elementwise", "reduce"):
            return self.memory(kind, p.size)
        if kind == "collectives":
            ranks, per = p.shape
            across = p.table[1] != "intra_node"
            if across and self.comm.rank >= ranks:
                return None
            return self.collective(p.table[2], p.size, ranks, per, across,
                                   shared=p.table[1] == "inter_node_shared")
        if p.table[1] == "intra_node":
            return self.send_local(p.size)
        if self.comm.rank >= 2:
            return self.busy_until_released()
        return self.send_between_ranks(p.size)

    # ---- on each device of the rank ----------------------------------------------------
    def _spmd(self, body, replicated: int = 0, devices=None):
        """`body(x, *replicated, r)` on every device of the rank (or `devices`), x split on
        axis 0."""
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P
        mesh = Mesh(np.array(self.local if devices is None else devices), ("d",))
        specs = (P("d"),) + (P(),) * (replicated + 1)
        return mesh, self.jax.jit(self.jax.shard_map(body, mesh=mesh, in_specs=specs,
                                                     out_specs=P("d"), check_vma=False))

    def _fill(self, mesh, spec, shape, dtype, *values) -> tuple:
        """One array filled with each value, all made on the devices by one module (a GPU's
        largest operands are GBs: no host copy)."""
        from jax.sharding import NamedSharding
        jnp = self.jax.numpy
        return self.jax.jit(lambda: tuple(jnp.full(shape, v, dtype) for v in values),
                            out_shardings=(NamedSharding(mesh, spec),) * len(values))()

    def compute_alone(self, p: Point) -> float | None:
        """A row of the f32 dot, elementwise or reduce table on rank 0's first device, every
        other device idle (`Calibration.alone`): virtual CPU devices share their host's cores,
        and a small kernel gains less from working alone than a large dot. None on the other
        ranks, which keep step."""
        if self.launch_alone_s is None:  # `memory` takes a module's launch off
            self.alone("launch_alone_s")
        self._pair_s(alone=True)  # and its arrays
        if self.comm.rank:
            self._timed(lambda r: None)
            return None
        if p.table[1] == "dot":
            return self.dot_kernels("f32", *p.shape, alone=True)
        return self.memory(p.table[1], p.size, alone=True)

    def square_dot(self, side: int, devices) -> float:
        """A square f32 dot repeated in a loop on `devices` (`concurrent` compares the same
        work on fewer devices at once; a loop keeps the host out of it)."""
        from jax import lax
        from jax.sharding import PartitionSpec as P
        jnp = self.jax.numpy
        # a weight of 1/side keeps the values at 1: no overflow, no denormals
        # a CPU's loop costs next to nothing beside a dot of 1e7 FLOPs or more
        unroll = UNROLL if devices[0].platform != "cpu" or 2 * side ** 3 < 1e7 else 1
        mesh, f = self._spmd(lambda x, a, r: lax.fori_loop(
            0, r, lambda i, y: _unrolled(lambda z: z @ a, y, unroll), x), replicated=1,
            devices=devices)
        (x,) = self._fill(mesh, P("d"), (len(devices) * side, side), jnp.float32, 1)
        (a,) = self._fill(mesh, P(), (side, side), jnp.float32, 1 / side)
        return self._timed(lambda r: f(x, a, r).block_until_ready(), ops=unroll)

    def dot_kernels(self, dtype: str, m: int, k: int, n: int, alone: bool = False,
                    batch: int = 0, transposed: bool = False) -> float:
        """One [m,k]x[k,n] dot (`dots_hlo`; with `batch`, that many at once) as alpa-run runs
        a module of them, like `memory`'s kernels: XLA's work per kernel counts, which a loop
        repeating one dot hides (a [32,32]x[32,32] dot took 10 µs in a module of 16 on one
        device here, 1.8 µs in a loop). `alone`: on the rank's first device only."""
        devices = self.local[:1] if alone else self.local
        flops = 2 * m * k * n * max(batch, 1)
        size = max(batch, 1) * m * k * (4 if dtype == "f32" else 2)
        kernels = max(1, min(STRAIGHT_KERNELS, STRAIGHT_BYTES // size,
                             int(STRAIGHT_FLOPS // flops)))
        exe, held = self._module(dots_hlo(kernels, len(devices), dtype, batch, m, k, n,
                                          transposed), devices, 1 / k)
        return self._per_kernel(exe, held, kernels, alone, kernels + 1)

    def matrix_s(self) -> float:
        """Beyond its FLOPs, each matrix of a batched dot whose lhs holds its matrices
        transposed ([k,m]), as a backward pass's attention has them: XLA's CPU backend runs
        those in a loop of its own, not its matmul library (in BERT's and GPT's one-device
        steps here 0.9-1.5 µs per 16x16 matrix against 0.02-0.2 for the other batched dots).
        A module of such dots against one of flat dots of the same FLOPs, per matrix."""
        b, s = MATRICES, MATRIX_SIDE
        batched = self.dot_kernels("f32", s, s, s, batch=b, transposed=True)
        flat = self.dot_kernels("f32", b * s, s, s)
        return max(batched - flat, 0.0) / b

    def _square_side(self) -> int:
        """The side of the square f32 dot that stands for a plan's compute (`concurrent`, and
        between `_in_modules`' collectives): about 1 ms on a CPU device, 256; a GPU's 2048."""
        return 256 if self.local[0].platform == "cpu" else 2048

    def concurrent(self, busy: int) -> float | None:
        """A square f32 dot on each of `busy` devices at once (the first ranks' first
        devices, the rest idle; side 256 on CPU, 2048 on a GPU): how much faster a device
        works with fewer beside it. None on a rank with no device working."""
        mine = min(self.k, max(0, busy - self.comm.rank * self.k))
        side = self._square_side()
        # three timings, their median: every plan on fewer devices is priced from this row
        # (a device alone measured 5.4x and 7.4x as fast as with all 8 in two calibrations)
        seconds = []
        for _ in range(3):
            if not mine:
                self._timed(lambda r: None)  # keeps step with the ranks that time
            else:
                seconds.append(self.square_dot(side, self.local[:mine]))
        return statistics.median(seconds) if mine else None

    def memory(self, kind: str, nbytes: int, alone: bool = False) -> float:
        """A fused chain of four elementwise ops over an f32 array (`nbytes` read + written),
        or a row reduction of one (`nbytes` read), as alpa-run runs a module of them (the XLA
        bridge, waited for): kernels one after the other, each reading an array of its own
        and writing a new one (an optimizer's update is hundreds of these; a new result's
        memory is first touched, which a loop over one array in place never pays: 2-4x
        slower on CPU). A module of K such kernels less its launch and its K returned arrays
        (a plan's module is priced with them: `launch_seconds`), over K, is one kernel.
        `alone`: on the rank's first device only (`compute_alone`)."""
        n = nbytes // (8 if kind == "elementwise" else 4)
        kernels = max(1, min(STRAIGHT_KERNELS, STRAIGHT_BYTES // nbytes))
        devices = self.local[:1] if alone else self.local
        rows, cols = n // min(n, 1024), min(n, 1024)
        exe, held = self._module(kernels_hlo(kind, kernels, len(devices), rows, cols),
                                 devices)
        return self._per_kernel(exe, held, kernels, alone, kernels)

    def _per_kernel(self, exe, held, kernels: int, alone: bool, arguments: int) -> float:
        """One of a module's `kernels` kernels: the module, as alpa-run runs it (the XLA
        bridge, waited for), less its launch, the arrays it returns and the arguments it
        takes (a plan's module is priced with them: `launch_seconds`)."""
        from alpac.xla.bridge import execute_unchecked

        def run(r):
            for _ in range(r):
                for a in execute_unchecked(exe, held):
                    a.block_until_ready()
        module = self._timed(run)
        if alone:
            launch = self.launch_alone_s
        else:
            launch = self.launch() if self.launch_s is None else self.launch_s
        host = launch + kernels * self._pair_s(alone) + \
            (arguments - kernels) * self._argument_s(alone)
        return max(module - host, module / 2) / kernels  # noise never leaves nothing

    def _module(self, text: str, devices, last: float | None = None):
        """Module `text` compiled by the XLA bridge for `devices`, and its arguments, each
        filled with its position + 1 (the last with `last` where given)."""
        from alpac.xla.bridge import compile_hlo, jax_parameter_shardings
        exe = compile_hlo(text, devices)
        types = exe.parameter_types
        values = [i + 1 for i in range(len(types))]
        if last is not None:
            values[-1] = last
        shardings = jax_parameter_shardings(exe)
        return exe, [self.jax.device_put(np.full(dims, v, dtype), sharding)
                     for (dims, dtype), v, sharding in zip(types, values, shardings)]

    def arithmetic(self, kind: str) -> float:
        """Seconds per element and op of a long elementwise chain over an array that stays in
        cache (64K f32 per device): what an op costs where memory does not bound the kernel.
        `flop_s`: multiply-adds (two ops each); `transcendental_s`: exp and sqrt."""
        from jax import lax
        from jax.sharding import PartitionSpec as P
        jnp = self.jax.numpy
        n, chain = 1 << 16, 16
        if kind == "flop_s":
            def step(y):
                for _ in range(chain):
                    y = y * 0.999 + 0.001
                return y
        else:  # values stay in (0, 1]
            def step(y):
                for _ in range(chain // 2):
                    y = jnp.sqrt(jnp.exp(-y))
                return y
        mesh, f = self._spmd(lambda x, r: lax.fori_loop(0, r, lambda i, y: _unrolled(step, y), x))
        (x,) = self._fill(mesh, P("d"), (self.k * n,), np.float32, 0.5)
        ops = 2 * chain if kind == "flop_s" else chain
        return self._timed(lambda r: f(x, r).block_until_ready(), ops=UNROLL * ops * n)

    # ---- collectives and sends -----------------------------------------------------------
    def collective(self, kind: str, nbytes: int, ranks: int, per: int, across: bool,
                   shared: bool = False) -> float:
        """One collective of `nbytes` (the convention of the cost model) over a group of
        `per` devices on each of `ranks` ranks, repeated; inside a rank, every device of it
        in groups of `per` at once; `shared`: `per` groups of `ranks` at once, one device of
        each rank in each (the nodes' links shared)."""
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P
        g = ranks if shared else ranks * per
        if shared:
            mesh = Mesh(np.array([[d for d in self.everywhere if d.process_index == r][:per]
                                  for r in range(ranks)]).T, ("o", "i"))
        elif across:
            devices = [d for d in self.everywhere if d.process_index < ranks][:g] if per > 1 \
                else [self.everywhere[r * self.k] for r in range(ranks)]
            mesh = Mesh(np.array(devices).reshape(1, g), ("o", "i"))
        else:
            rows = self.k // g
            mesh = Mesh(np.array(self.local[:rows * g]).reshape(rows, g), ("o", "i"))
        step = collective_step(kind, g)
        # all-gather: the bytes are the result's; combined: each operand's
        pieces = COMBINED_OPERANDS if kind == "combined-all-reduce" else 1
        local = nbytes // 4 // (g if kind == "all-gather" else 1) * pieces
        shape = (mesh.size * local,)
        x = self.jax.make_array_from_callback(
            shape, self.jax.sharding.NamedSharding(mesh, P(("o", "i"))),
            lambda index: np.ones(local, np.float32))
        if self.everywhere is None:  # one process: back to back in a loop
            f = self.jax.jit(self.jax.shard_map(
                lambda x, r: self.jax.lax.fori_loop(0, r, lambda i, y: step(y), x), mesh=mesh,
                in_specs=(P(("o", "i")), P()), out_specs=P(("o", "i")), check_vma=False))
            return self._timed(lambda r: f(x, r).block_until_ready()) / pieces
        # a large one: bandwidth, not ticks (a combined one is several already)
        count = IN_A_MODULE if nbytes <= 1 << 20 and pieces == 1 else 2
        if not across:
            return self._in_modules(mesh, step, x, count, self._timed) / pieces
        self.comm.watchdog.arm(f"in a {kind} of {g} devices", self.comm.timeout)
        try:
            return self._in_modules(mesh, step, x, count,
                                    lambda run: per_op(run, self._agree(ranks))) / pieces
        finally:
            self.comm.watchdog.disarm()

    def _in_modules(self, mesh, step, x, count: int, timed) -> float:
        """Seconds per collective under multi-process jax, timed as a plan's module runs them:
        `count` per execution, each after a dot on every device of the group (a plan computes
        between its collectives), each execution waited for; less the same module without
        the collectives. A CPU's gloo waits a scheduler tick far more often after work than
        back to back: on this machine an all-reduce of 4 KB over 2 ranks x 4 devices took
        4.5 ms in a row and 1.8-2.2 ms more each after a dot of 1-6 ms; priced from the
        figure in a row, every 8-device plan ran 1.2-1.6x its estimate. gloo also keeps to a
        fast or a slow mode for minutes at a time: two calibrations 40 minutes apart read
        0.68 and 2.63 ms for an all-gather among a rank's 2 devices."""
        from jax.sharding import PartitionSpec as P
        jnp = self.jax.numpy
        spec = P(("o", "i"))
        side = self._square_side()

        def seconds(body, arg) -> float:
            f = self.jax.jit(self.jax.shard_map(body, mesh=mesh, in_specs=(spec, spec),
                                                out_specs=spec, check_vma=False))

            def run(r):
                for _ in range(r):
                    f(arg, w).block_until_ready()
            return timed(run)

        def chain(collective):
            def body(y, v):
                for _ in range(count):  # each waits for the other: dot, collective, dot, ...
                    v = v @ v + y[0] * 1e-30
                    y = collective(y + v[0, 0] * 1e-30)
                return jnp.sum(y, keepdims=True) + v[0, :1]
            return body
        w = self.jax.make_array_from_callback(  # entries 1/side: v @ v stays v
            (mesh.size * side, side), self.jax.sharding.NamedSharding(mesh, spec),
            lambda index: np.full((side, side), 1 / side, np.float32))
        # a mesh's devices say how it is timed: one rank's own (every rank at once), or
        # several ranks' (those ranks only)
        key = (tuple(d.id for d in mesh.devices.flat), count)
        if key not in self._work_on:
            tiny = self.jax.make_array_from_callback(
                (mesh.size,), self.jax.sharding.NamedSharding(mesh, spec),
                lambda index: np.ones(1, np.float32))
            self._work_on[key] = seconds(chain(lambda y: y), tiny)
        full = seconds(chain(step), x)
        # never below a tenth of the execution: two noisy timings' difference
        return max(full - self._work_on[key], full / 10) / count

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
        piece between meshes (to the host, MPI, onto the device): half a round trip. The
        other ranks keep their devices busy meanwhile (`busy_until_released`), as the other
        meshes of a pipeline compute while two of its ranks exchange: on a shared CPU the
        message then waits for a core (1 KB: 0.65 ms with 2 of 4 ranks busy, 0.35 ms with
        them idle)."""
        try:
            return self._ping_pong(nbytes)
        finally:
            if self.comm.rank == 0:
                self._release_busy(2)

    def _release_busy(self, first: int) -> None:
        """Rank 0: tell ranks `first`.. (in `busy_until_released`) that the timing is done."""
        for r in range(first, self.comm.size):
            self.comm.send_obj(None, r, TAG_RELEASE)
        self.comm.flush("the busy ranks to take their release")

    def busy_until_released(self) -> None:
        """A small module on every device of this rank, again and again, until rank 0 says
        the sends are timed; a rank measures nothing here (None)."""
        from jax.sharding import PartitionSpec as P
        mesh, f = self._spmd(lambda x, a, r: self.jax.lax.fori_loop(
            0, r, lambda i, y: _unrolled(lambda z: z @ a, y), x), replicated=1)
        (x,) = self._fill(mesh, P("d"), (len(self.local) * 64, 64), np.float32, 1)
        (a,) = self._fill(mesh, P(), (64, 64), np.float32, 1 / 64)
        while not self.comm.comm.Iprobe(source=0, tag=TAG_RELEASE):
            f(x, a, 1).block_until_ready()
        self.comm.recv_obj(0, TAG_RELEASE, "the end of rank 0's timing")
        return None

    def _ping_pong(self, nbytes: int) -> float:
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
