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
"""

from __future__ import annotations

import math

from alpac.plan.mesh import LogicalMesh


class CostModel:
    def __init__(self, cluster, mesh: LogicalMesh):
        self.cluster = cluster
        self.mesh = mesh
        self._links: dict[tuple[int, ...], object] = {}

    def _link(self, axes: tuple[int, ...]):
        link = self._links.get(axes)
        if link is None:
            crosses = self.mesh.axis_crosses_nodes(axes, self.cluster)
            link = self.cluster.inter_node if crosses else self.cluster.intra_node
            self._links[axes] = link
        return link

    def group_size(self, axes) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def collective(self, kind: str, nbytes: float, axes: tuple[int, ...]) -> float:
        """Seconds for one collective of `kind` over mesh `axes` (see the module docstring for
        what `nbytes` means per kind)."""
        axes = tuple(sorted(axes))
        n = self.group_size(axes)
        if n <= 1 or nbytes <= 0:
            return 0.0
        link = self._link(axes)
        if kind == "collective-permute":
            return link.latency + nbytes / link.bandwidth
        step = (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth
        return 2 * step if kind == "all-reduce" else step

    def compute(self, flops: float, nbytes: float, dtype: str = "f32") -> float:
        device = self.cluster.device
        t = flops / self.cluster.peak_flops(dtype) if flops else 0.0
        if device.memory_bandwidth:
            t = max(t, nbytes / device.memory_bandwidth)
        return t

    def send(self, nbytes: float, src_device: int, dst_device: int) -> float:
        """Point-to-point time between two physical devices (cross-mesh transfers)."""
        link = self.cluster.link(src_device, dst_device)
        return link.latency + nbytes / link.bandwidth
