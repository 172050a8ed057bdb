"""The one cost model: seconds for compute and for collectives, from the cluster spec.

Collectives use ring formulas per group of devices with alpha-beta links: a group that stays
inside a node uses the intra-node link, one that crosses nodes the inter-node link. For a
group of n devices and S bytes (S = the full, gathered size of the array on each device):

    all-gather / reduce-scatter : (n-1)·alpha + (n-1)/n · S / bandwidth
    all-reduce                  : 2 × the above
    all-to-all                  : (n-1)·alpha + (n-1)/n · S / bandwidth   (S = local bytes)
    collective-permute          : alpha + S / bandwidth

Compute is a roofline: max(FLOPs / peak FLOP/s of the element type, bytes / memory
bandwidth) per device; work that every device repeats (replicated) costs its full time.
Unlike XLA's auto-sharding costs, nothing is rounded to integers.

A calibrated cluster (`alpac calibrate`, alpac/plan/calibration.py) replaces these formulas by
its measured tables where it has one: dots by FLOPs, elementwise work and reductions by bytes,
each collective by link kind, group size and bytes, point-to-point sends by bytes. The tables
hold work inside a module (measured repeated within one execution); launching a module is
counted once per module execution instead (`launch_seconds`).
"""

from __future__ import annotations

import math

from alpac.plan.mesh import LogicalMesh


class CostModel:
    def __init__(self, cluster, mesh: LogicalMesh):
        self.cluster = cluster
        self.mesh = mesh
        self._links: dict[tuple[int, ...], object] = {}

    def _link(self, axes: tuple[int, ...]) -> tuple[object, str]:
        """The link a collective over `axes` uses, and its kind (intra_node or inter_node)."""
        found = self._links.get(axes)
        if found is None:
            crosses = self.mesh.axis_crosses_nodes(axes, self.cluster)
            found = (self.cluster.inter_node, "inter_node") if crosses else \
                (self.cluster.intra_node, "intra_node")
            self._links[axes] = found
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
        link, where = self._link(axes)
        calibration = self.cluster.calibration
        if calibration is not None:
            measured = calibration.collective_seconds(
                where, kind, n, nbytes, lambda m: _ring(kind, nbytes, m, link))
            if measured is not None:
                return measured
        return _ring(kind, nbytes, n, link)

    @property
    def prices_kernels(self) -> bool:
        """Whether `compute` prices fused kernels (`kernel_bytes`): the measured tables time
        one kernel at a time; the roofline is linear in bytes and prices instructions."""
        return self.cluster.calibration is not None

    def compute(self, flops: float, nbytes: float, dtype: str = "f32",
                kind: str = "elementwise", kernel_bytes: float | None = None,
                transcendentals: float = 0.0) -> float:
        """Seconds of an instruction's work: `kind` is dot, reduce or elementwise (which
        measured table prices it, on a calibrated cluster). With `kernel_bytes` (the bytes of
        the fused kernel the instruction runs in, alpac.analysis.fusion) the instruction
        costs its share, `nbytes` of them, of the kernel's memory time, or its arithmetic
        at the measured per-op rates where that takes longer (sqrt, exp, divide chains)."""
        calibration = self.cluster.calibration
        if calibration is not None:
            if kind == "dot" and flops:
                table = calibration.dot.get(dtype) or calibration.dot.get("f32")
                size = flops
            else:
                table = calibration.reduce if kind == "reduce" else None
                table = table or calibration.elementwise
                size = nbytes
            if table is not None and kernel_bytes is not None and kind != "dot":
                memory = table(kernel_bytes) * nbytes / kernel_bytes if kernel_bytes > 0 else 0.0
                return max(memory, flops * calibration.flop_s +
                           transcendentals * calibration.transcendental_s)
            if table is not None:
                return table(size)
        device = self.cluster.device
        t = flops / self.cluster.peak_flops(dtype) if flops else 0.0
        if device.memory_bandwidth:
            t = max(t, nbytes / device.memory_bandwidth)
        return t

    @property
    def launch_seconds(self) -> float:
        """Launching one module execution (0 unless calibrated)."""
        calibration = self.cluster.calibration
        return calibration.launch_s if calibration is not None else 0.0

    def send(self, nbytes: float, src_device: int, dst_device: int) -> float:
        """Point-to-point time between two physical devices (cross-mesh transfers)."""
        link = self.cluster.link(src_device, dst_device)
        calibration = self.cluster.calibration
        if calibration is not None:
            where = "intra_node" if self.cluster.node_of(src_device) == \
                self.cluster.node_of(dst_device) else "inter_node"
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
