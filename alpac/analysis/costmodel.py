"""The one cost model: seconds for compute and for collectives, from the cluster spec.

Collectives use ring formulas per group of devices with alpha-beta links: a group that stays
inside a node uses the intra-node link, one that crosses nodes the inter-node link. For a
group of n devices and S bytes (S = the full, gathered size of the array on each device):

    all-gather / reduce-scatter : (n-1)·alpha + (n-1)/n · S / bandwidth
    all-reduce                  : 2 × the above
    all-to-all                  : (n-1)·alpha + (n-1)/n · S / bandwidth   (S = local bytes)
    collective-permute          : alpha + S / bandwidth

Compute is a roofline: max(FLOPs / FLOP/s of the element type, bytes / memory bandwidth) per
device; work that every device repeats (replicated) costs its full time. Elementwise work and
reductions are priced by the bytes of the fused kernel XLA runs them in (each instruction its
share, alpac.analysis.fusion), not the bytes each instruction would move alone. FLOP/s and
bandwidths are the peaks times the file's `efficiency:` shares (1 where it has none). Unlike
XLA's auto-sharding costs, nothing is rounded to integers.

A calibrated cluster (`alpac calibrate`, alpac/plan/calibration.py) replaces these formulas
by its measured tables where it has one: dots by FLOPs (each matrix of a batched dot XLA's
CPU backend runs in a loop of its own by `matrix_s` beyond them), elementwise work and
reductions by bytes, each collective by link kind, group size and bytes, point-to-point
sends by bytes. Across nodes a collective was measured one group at a time, and with a group
per device of a node at once (`inter_node_shared`): where a mesh runs several groups across
one node's link at once (data parallelism across nodes beside tensor parallelism inside
them), each is priced by the second (fewer than a node's devices: in between,
`Calibration.shared_seconds`), or, in files without it, as one group carrying all their
bytes (inside a node every device was in a group when measured). On this machine 2 groups of
4 ranks at once took 1.3-1.5x that one group's price for 4-64 KiB, 4 groups of 2 ranks
2-2.5x (benchmarks/results/collective_forms*.md). The tables hold work inside a module (its
launch and arrays subtracted where measured); launching a module is counted once per module
execution instead, with each array it takes and returns (`launch_seconds`), and each array a
step feeds its modules likewise (`feed_seconds`). They were measured with every device of
the calibration working; where its `concurrency` table says devices share a host (virtual
CPU devices), compute on a cluster cut to fewer devices (a plan that leaves the rest idle)
costs between the every-device tables and the one-alone ones (`Calibration.alone_tables`;
without them, the concurrency share of the every-device ones), launching likewise between
its every-device and its one-alone figures.
"""

from __future__ import annotations

import math

import numpy as np

from alpac.plan.calibration import POLL_FIRST_S, between, polls
from alpac.plan.mesh import LogicalMesh
from alpac.plan.sharding import parse_xla_sharding


def launch_seconds(cluster, arrays: int = 0, arguments: int = 0) -> float:
    """Launching one module execution that takes `arguments` arrays and returns `arrays`: the
    host's work (0 unless calibrated). Where devices share a host, a cluster cut to fewer
    devices pays less of it (`Calibration.host_seconds`)."""
    calibration = cluster.calibration
    if calibration is None:
        return 0.0
    return calibration.host_seconds(arrays, cluster.num_devices, arguments)


def feed_seconds(cluster, carried: bool) -> float:
    """alpa-run's host work for each array a step feeds its modules; 0 unless calibrated.
    An output carried into the next step's input is priced as an array a module returns and
    the argument it is taken as (`launch_seconds` of one of each without the launch): on
    this machine a one-device GPT step spent 1.4 ms beside its module feeding and carrying
    207 arrays, 6.8 µs each against 5.0 µs for an array a module returns with the other
    devices idle; on an H100 the same step 2.35 ms (11 µs each, against 13.7 µs). An array
    copied from the host (a microbatch of an input) costs the calibration's `feed_s` where
    measured: in a two-stage MLP pipeline here such a feed took 0.12 ms, a carried array 4
    µs."""
    calibration = cluster.calibration
    if not carried and calibration is not None and calibration.feed_s:
        return calibration.feed_s
    return launch_seconds(cluster, 1, 1) - launch_seconds(cluster, 0)


def free_seconds(cluster) -> float:
    """alpa-run freeing an array once no task reads it (the calibration's `free_s`, timed as
    the runtime frees between modules; 0 where not measured)."""
    calibration = cluster.calibration
    return calibration.free_s if calibration is not None else 0.0


def launch_cpu_seconds(cluster) -> float:
    """The CPU time beyond `launch_seconds` that a module execution launched after its rank
    sat idle takes, all of the rank's threads (the calibration's `launch_cpu_s`, between its
    one-alone and every-device figures as `launch_seconds` goes; 0 where not measured). A
    pipeline's ranks launch every module so, after waiting for a message; where ranks share a
    host's cores (`host_cores_seconds`) that time is the cores'. Here a launch on 2 CPU
    devices took 53 µs of CPU back to back, 150-240 µs after a 1 ms sleep."""
    calibration = cluster.calibration
    if calibration is None or not calibration.launch_cpu_s:
        return 0.0
    cpu = between(calibration.launch_cpu_alone_s or calibration.launch_cpu_s,
                  calibration.launch_cpu_s, calibration.toward_every(cluster.num_devices))
    return max(cpu - launch_seconds(cluster), 0.0)


def waiting_cpu_seconds(cluster, wait: float) -> float:
    """The CPU time alpa-run's polling takes in a wait of `wait` seconds for a message: its
    sleeps (`polls`), each the calibration's `pause_cpu_s` (0 where not measured)."""
    calibration = cluster.calibration
    if calibration is None or not calibration.pause_cpu_s:
        return 0.0
    late = max(calibration.pause_s - POLL_FIRST_S, 0.0)
    return calibration.pause_cpu_s * polls(wait, late)


def staging_seconds(cluster, nbytes: float) -> float:
    """alpa-run's host work on the sending side of a transfer between meshes: its devices'
    pieces copied to the host and packed into messages, priced by a calibrated file's
    `send.intra_node` table (a piece moved between two devices of one rank through the
    host); 0 unless calibrated, like all host work. The receiving stage pays the whole hop
    (the `send` table, this copy in it): it waits while the sender copies. A small
    transfer's sends took 0.05-0.14 ms each in a two-stage MLP pipeline here."""
    calibration = cluster.calibration
    table = calibration.send.get("intra_node") if calibration is not None else None
    return table(nbytes) if table is not None else 0.0


def node_bytes(nbytes: float, dst_sharding: str, devices: list[int], cluster) -> float:
    """The most bytes of a value (`nbytes` in all) that one node of the destination holds and
    so receives: the distinct tiles of its sharding (an XLA string) that the node's devices
    (`devices`, the mesh's in partition order) hold. alpa-run receives per rank (node)."""
    x = parse_xla_sharding(dst_sharding)
    if x.kind != "tiled":
        return nbytes
    grid = x.tile_dims[:-1] if x.replicate_last else x.tile_dims
    tiles = np.array(x.devices).reshape(x.tile_dims)
    held: dict[int, set] = {}
    for index in np.ndindex(*x.tile_dims):
        node = cluster.node_of(devices[int(tiles[index])])
        held.setdefault(node, set()).add(index[:len(grid)])
    return nbytes * max(map(len, held.values())) / math.prod(grid)


def rank_cpu_seconds(cluster, devices, host_work: float, compute: float
                     ) -> dict[int, tuple[float, float]] | None:
    """Per rank (node) of a stage on `devices`, the CPU time per step it spends on the stage
    where ranks share a host's cores (None unless a calibrated file says how many ranks ran
    on each host, on how many cores): its host work (launching, receiving, sending, feeding,
    freeing; `host_work` per step), and its devices' compute (`compute` seconds per step
    each) where devices share the cores too (virtual CPU devices; 0 otherwise). A second of
    a device's compute takes the share of the cores it was priced with: the cores over the
    cluster's devices on the host, as the tables and the concurrency share price every one
    of them working. The host work's figures were measured as time, with the ranks doing
    it at once; they count as CPU time here: in two-stage pipelines of 4 ranks on 2 cores
    here, a rank's host thread used about what its stage's host work is priced at (11.2-12.3
    ms of CPU per GPT step against 9.4-9.8 ms priced, 3.5-4.0 ms per MLP step against
    3.9-4.1), each host operation taking more CPU in a pipeline's interleaving than alone."""
    calibration = cluster.calibration
    if calibration is None or not calibration.host_cores or not calibration.ranks_per_host:
        return None
    k, ranks = cluster.devices_per_node, calibration.ranks_per_host
    working: dict[int, int] = {}  # host -> the cluster's devices on it, all of them working
    for d in range(cluster.num_devices):
        working[d // k // ranks] = working.get(d // k // ranks, 0) + 1
    mine: dict[int, int] = {}  # node -> the stage's devices on it
    for d in devices:
        mine[d // k] = mine.get(d // k, 0) + 1
    share = calibration.host_cores if calibration.devices_share_cores else 0.0
    return {node: (host_work, compute * share * n / working[node // ranks])
            for node, n in mine.items()}


def host_cores_seconds(cluster, stages) -> float:
    """The least time a step takes on the busiest host where ranks share a host's cores (0
    unless calibrated so: `rank_cpu_seconds`). `stages`: per stage, (its devices, the host
    work each of its ranks does per step, the compute each of its devices does per step)."""
    calibration = cluster.calibration
    busy: dict[int, float] = {}
    for devices, host_work, compute in stages:
        per_rank = rank_cpu_seconds(cluster, devices, host_work, compute)
        if per_rank is None:
            return 0.0
        for node, cpu in per_rank.items():
            h = node // calibration.ranks_per_host
            busy[h] = busy.get(h, 0.0) + sum(cpu)
    return max(busy.values(), default=0.0) / calibration.host_cores


class CostModel:
    def __init__(self, cluster, mesh: LogicalMesh):
        self.cluster = cluster
        self.mesh = mesh
        self._links: dict[tuple[int, ...], object] = {}
        calibration = cluster.calibration
        self._share = calibration.compute_share(cluster.num_devices) if calibration else 1.0
        # one device's tables where a cluster cut to fewer devices works between the two
        self._alone = calibration.alone_tables() if calibration and self._share < 1 else None
        if self._alone is not None:
            self._toward_every = calibration.toward_every(cluster.num_devices)

    def _link(self, axes: tuple[int, ...]) -> tuple[object, str, int]:
        """The link a collective over `axes` uses, its kind (intra_node or inter_node), and
        how many of its groups cross that node's link at once."""
        found = self._links.get(axes)
        if found is None:
            sharing = self.mesh.groups_leaving_a_node(axes, self.cluster)
            kind = "inter_node" if sharing else "intra_node"
            found = self._links[axes] = (self.cluster.effective_link(kind), kind, sharing)
        return found

    def group_size(self, axes) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def collective(self, kind: str, nbytes: float, axes: tuple[int, ...]) -> float:
        """Seconds for one collective of `kind` over mesh `axes` (see the module docstring for
        what `nbytes` means per kind)."""
        axes = tuple(sorted(axes))
        n = self.group_size(axes)
        if n <= 1 or nbytes <= 0:
            return 0.0
        measured = self._measured(kind, nbytes, axes)
        return measured if measured is not None else _ring(kind, nbytes, n,
                                                           self._link(axes)[0])

    def combined_all_reduce(self, nbytes: float, axes: tuple[int, ...]) -> float:
        """An all-reduce XLA combined with others into one instruction: its operand, as the
        calibration's `combined-all-reduce` table prices it (alpac.intraop.combine); as an
        all-reduce alone where not measured."""
        axes = tuple(sorted(axes))
        if self.group_size(axes) <= 1 or nbytes <= 0:
            return 0.0
        measured = self._measured("combined-all-reduce", nbytes, axes)
        return measured if measured is not None else self.collective("all-reduce", nbytes,
                                                                     axes)

    def _measured(self, kind: str, nbytes: float, axes: tuple[int, ...]) -> float | None:
        """`collective` from a calibrated cluster's tables (None without one for it)."""
        n = self.group_size(axes)
        link, where, sharing = self._link(axes)
        calibration = self.cluster.calibration
        measured = None
        if calibration is not None:
            if sharing > 1:  # groups crossing the nodes at once, as measured so
                measured = calibration.shared_seconds(
                    kind, n, nbytes, sharing, self.cluster.devices_per_node,
                    lambda m: _ring(kind, nbytes, m, link))
            if measured is None:  # else as one group carrying every group's bytes
                carried = nbytes * max(sharing, 1)
                measured = calibration.collective_seconds(
                    where, kind, n, carried, lambda m: _ring(kind, carried, m, link))
        return measured

    @property
    def prices_kernels(self) -> bool:
        """Whether `compute` wants fused kernels' bytes (`kernel_bytes`): the measured tables
        time one kernel at a time, the roofline the bytes kernels move through memory; without
        a memory bandwidth only FLOPs count."""
        return self.cluster.calibration is not None or bool(self.cluster.device.memory_bandwidth)

    def compute(self, flops: float, nbytes: float, dtype: str = "f32",
                kind: str = "elementwise", kernel_bytes: float | None = None,
                transcendentals: float = 0.0, matrices: float = 0.0) -> float:
        """Seconds of an instruction's work: `kind` is dot, reduce or elementwise (which
        measured table prices it, on a calibrated cluster). With `kernel_bytes` (the bytes of
        the fused kernel the instruction runs in, alpac.analysis.fusion) the instruction
        costs its share, `nbytes` of them, of the kernel's memory time, or its arithmetic
        at the measured per-op rates where that takes longer (sqrt, exp, divide chains).
        A dot's `matrices`: those of a batched dot whose lhs holds them transposed, each
        dearer on a CPU (`Calibration.dot_seconds`). On a cluster cut to fewer devices that
        share a host, between this with every device working and with one alone (module
        docstring)."""
        calibration = self.cluster.calibration
        every = self._compute(calibration, flops, nbytes, dtype, kind, kernel_bytes,
                              transcendentals, matrices)
        if self._alone is None:
            return self._share * every
        alone = self._compute(self._alone, flops, nbytes, dtype, kind, kernel_bytes,
                              transcendentals, matrices)
        return between(alone, every, self._toward_every)

    def _compute(self, calibration, flops: float, nbytes: float, dtype: str, kind: str,
                 kernel_bytes: float | None, transcendentals: float, matrices: float
                 ) -> float:
        """`compute` by `calibration`'s tables (the roofline without them)."""
        if calibration is not None and kind == "dot" and flops:
            measured = calibration.dot_seconds(flops, dtype, matrices)
            if measured is not None:
                return measured
        elif calibration is not None:
            table = (calibration.reduce if kind == "reduce" else None) or \
                calibration.elementwise
            if table is not None and kernel_bytes is not None and kind != "dot":
                memory = table(kernel_bytes) * nbytes / kernel_bytes if kernel_bytes > 0 else 0.0
                return max(memory, flops * calibration.flop_s +
                           transcendentals * calibration.transcendental_s)
            if table is not None:
                return table(nbytes)
        t = flops / self.cluster.dot_flops(dtype) if flops else 0.0
        memory = self.cluster.memory_throughput
        return max(t, nbytes / memory) if memory else t

    def send(self, nbytes: float, src_device: int, dst_device: int) -> float:
        """Point-to-point time between two physical devices (cross-mesh transfers)."""
        where = self.cluster.link_kind(src_device, dst_device)
        link = self.cluster.effective_link(where)
        calibration = self.cluster.calibration
        if calibration is not None:
            table = calibration.send.get(where)
            if table is not None:
                return table(nbytes)
        return link.latency + nbytes / link.bandwidth


def _ring(kind: str, nbytes: float, n: int, link) -> float:
    """The alpha-beta ring estimate of a collective over n devices."""
    if kind == "collective-permute":
        return link.latency + nbytes / link.bandwidth
    step = (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth
    return 2 * step if kind == "all-reduce" else step
