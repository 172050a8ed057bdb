"""Logical device meshes over physical devices.

A logical mesh arranges the devices of one stage as an n-D array (1-D, 2-D or 3-D). Its
devices are physical device ids of the cluster, in row-major mesh order; position i in that
order is partition id i in the sharded HLO that XLA compiles for the stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from alpac.errors import UserError


@dataclass(frozen=True)
class LogicalMesh:
    shape: tuple[int, ...]
    devices: tuple[int, ...]  # physical device ids, row-major over `shape`

    def __post_init__(self):
        if math.prod(self.shape) != len(self.devices):
            raise ValueError(f"mesh {self.shape} needs {math.prod(self.shape)} devices, got "
                             f"{len(self.devices)}")

    @staticmethod
    def parse(text: str, available=None) -> "LogicalMesh":
        """`2x4`, `8`, `2x2x2` over the first devices of `available` (default 0..n-1)."""
        try:
            shape = tuple(int(x) for x in text.lower().split("x"))
        except ValueError:
            raise UserError(f"mesh '{text}' should look like 8, 2x4 or 2x2x2") from None
        if not shape or any(s <= 0 for s in shape) or len(shape) > 3:
            raise UserError(f"mesh '{text}' should have 1 to 3 positive axis sizes, "
                            f"like 8, 2x4 or 2x2x2")
        n = math.prod(shape)
        devs = tuple(range(n)) if available is None else tuple(available)[:n]
        if len(devs) != n:
            raise UserError(f"mesh {text} needs {n} devices, the cluster has {len(devs)}")
        return LogicalMesh(shape, devs)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.shape)

    @cached_property
    def _grid(self) -> np.ndarray:
        return np.arange(self.num_devices).reshape(self.shape)

    def groups(self, axes: tuple[int, ...]) -> list[list[int]]:
        """Partition-id groups that vary along `axes` (the others fixed): the participants of
        one collective over those axes."""
        others = [a for a in range(self.ndim) if a not in axes]
        grid = np.transpose(self._grid, others + list(axes))
        size = math.prod(self.shape[a] for a in axes)
        return [list(map(int, g)) for g in grid.reshape(-1, size)]

    def axis_crosses_nodes(self, axes: tuple[int, ...], cluster) -> bool:
        """Whether a collective over `axes` has participants on different nodes."""
        return self.groups_leaving_a_node(axes, cluster) > 0

    def groups_leaving_a_node(self, axes: tuple[int, ...], cluster) -> int:
        """How many groups of a collective over `axes` reach from one node to another at
        once, counted at the node most have members on: they share its link."""
        per_node: dict[int, int] = {}
        for group in self.groups(axes):
            nodes = {cluster.node_of(self.devices[p]) for p in group}
            if len(nodes) > 1:
                for node in nodes:
                    per_node[node] = per_node.get(node, 0) + 1
        return max(per_node.values(), default=0)
