"""What a stage receives from the stages beside it, for the stage DP: the values its layers read
that layers outside it make, priced as the emitted plan prices them (`CostModel.send` of the
bytes one node of the destination holds, `node_bytes`).

Which values cross is read off the step with every layer a stage of its own: a value made by
layer p and read by layers C crosses into a stage of layers f..l when p is outside it and some
layer of C inside, once (at the first of them). The stage's ILP takes it in the sharding
whose receiving and resharding to what that layer's ILP chose cost least
(`intraop.receiving`); so is it priced here.
A value between adjacent layers moves between adjacent stages, taken to be the devices right
after the submesh (another node for a submesh of whole nodes, the same node for part of one);
any other (a tied embedding's weight and gradient, between the first and the last stage) is
taken to cross nodes where the cluster has several. Without these prices the DP chose 41
stages for GPT-39.1B on 512 A100s at 40.5 ms per microbatch, which built cost 67.4 ms: each
stage received three 201 MB activations per microbatch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from alpac.analysis.costmodel import CostModel, node_bytes
from alpac.hlo.shape import Shape
from alpac.intraop.collectives import reshard
from alpac.intraop.space import array_shardings
from alpac.plan.mesh import LogicalMesh
from alpac.plan.sharding import Sharding


class Crossing(NamedTuple):
    """A value received by a stage whose first reader of it is `layer`."""

    layer: int
    position: int  # of the parameter among the layer module's instructions
    shape: Shape  # at the reference microbatch count
    per_microbatch: bool
    adjacent: bool  # made by the layer before or after `layer`


class TransferPrices:
    """Seconds per microbatch and per step a stage of layers first..last receives, per mesh
    config and microbatch count (tabulated for every range at once, like `RangeCosts`)."""

    def __init__(self, layers, hashes: list, chosen: dict, configs, submeshes, cluster,
                 reference: int):
        self.hashes, self.chosen, self.configs = hashes, chosen, configs
        self.submeshes, self.cluster, self.reference = submeshes, cluster, reference
        self.crossings, masks = _crossings(layers, len(hashes))
        self.masks = np.array(masks, dtype=np.float64).reshape(len(masks), -1)
        self.tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.cheapest: dict[tuple, tuple[float, float]] = {}  # see _cheapest

    def __call__(self, first: int, last: int, m: int, c: int, B: int) -> tuple[float, float]:
        key = (m, c, B)
        if key not in self.tables:
            self.tables[key] = self._tables(m, c, B)
        per_microbatch, per_step = self.tables[key]
        return float(per_microbatch[first, last]), float(per_step[first, last])

    def _tables(self, m: int, c: int, B: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.hashes)
        if not self.crossings:
            return np.zeros((n, n)), np.zeros((n, n))
        model, devices = self._model(m, c)
        size = len(devices)
        total, per_cluster_node = self.cluster.num_devices, self.cluster.devices_per_node
        neighbour = size % total
        far = per_cluster_node % total if size < per_cluster_node else neighbour
        seconds = np.zeros((2, len(self.crossings)))
        for k, x in enumerate(self.crossings):
            source = neighbour if x.adjacent else far
            held, resharding = self._cheapest(x, m, c, source, model, devices)
            scale = self.reference / B if x.per_microbatch else 1.0
            seconds[0 if x.per_microbatch else 1, k] = model.send(held * scale, source, 0) \
                + resharding * scale
        per_microbatch, per_step = (seconds @ self.masks).reshape(2, n, n)
        return per_microbatch, per_step

    def _model(self, m: int, c: int) -> tuple[CostModel, list[int]]:
        nodes, per_node = self.submeshes[m]
        devices = list(range(nodes * per_node))
        return CostModel(self.cluster, LogicalMesh(self.configs[m][c].shape,
                                                   tuple(devices))), devices

    def _cheapest(self, x: Crossing, m: int, c: int, source: int, model: CostModel,
                  devices: list[int]) -> tuple[float, float]:
        """The bytes one node receives and the seconds resharding to its layer's choice, at the
        reference count, of the sharding that makes their sum least (`model`, `devices`:
        config c of submesh m)."""
        wanted = self.chosen[(self.hashes[x.layer], m, c)][x.position] \
            or Sharding.replicated(x.shape.rank)
        key = (m, c, x.shape, wanted, source)
        if key not in self.cheapest:
            shape = tuple(model.mesh.shape)

            def cost(sharding) -> tuple[float, float, float]:
                held = node_bytes(x.shape.byte_size, sharding.to_xla(shape), devices,
                                  self.cluster)
                resharding = sum(step.seconds(model) for step in reshard(
                    x.shape.dims, x.shape.element_bits, sharding, wanted, shape))
                return model.send(held, source, 0) + resharding, held, resharding

            self.cheapest[key] = min(map(cost, array_shardings(x.shape.dims, shape)),
                                     default=cost(wanted))[1:]
        return self.cheapest[key]


def _crossings(layers, n: int) -> tuple[list[Crossing], list[np.ndarray]]:
    """Every (value, first reader in a range) that crosses into some range of layers, with the
    ranges (first, last) it crosses into."""
    made: dict[str, int] = {}
    readers: dict[str, list[tuple[int, int, Shape, bool]]] = {}  # layer, position, ..
    for layer in range(n):
        stage = layers.layers[layer][0]
        for value in stage.output_values:
            made.setdefault(value, layer)
        position = {x.name: i for i, x in enumerate(stage.module.entry.instructions)}
        for p, value in zip(stage.module.entry.parameters, stage.param_values):
            if not p.shape.is_tuple:
                readers.setdefault(value, []).append(
                    (layer, position[p.name], p.shape, stage.scope.get(value) == "microbatch"))
    first, last = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    crossings, masks = [], []
    for value, read in readers.items():
        read.sort(key=lambda r: r[0])
        maker = made.get(value, read[0][0])  # an input lives where it is first read
        previous = -1
        for layer, position, shape, per_microbatch in read:
            # ranges whose first reader is `layer`, without the maker
            mask = (first > previous) & (first <= layer) & (last >= layer) \
                & ~((first <= maker) & (maker <= last))
            previous = layer
            if mask.any():
                crossings.append(Crossing(layer, position, shape, per_microbatch,
                                          abs(layer - maker) == 1))
                masks.append(mask)
    return crossings, masks
