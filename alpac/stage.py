"""A pipeline stage: a part of the program, the logical mesh it runs on, and its sharding."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo import Module
from alpac.mesh import LogicalMesh


@dataclass
class Stage:
    index: int
    mesh: LogicalMesh
    module: Module  # the program this stage runs
    layers: tuple[int, int] | None = None  # first and last layer, when layers are known
    physical_shape: tuple[int, int] | None = None  # (nodes, devices per node) of its submesh
    sharding: object = None  # alpac.autoshard.ShardingResult, set by intra-op-sharding
    pipeline_stage: object = None  # alpac.pipeline.StageModule when the step is pipelined
    hints: dict | None = None  # instruction name -> sharding its layer's ILP chose
    allow: object = None  # a filter on the ILP's choices (a forced strategy), or None
    weights_stored_split: bool = False  # the memory-lean (ZeRO-3) option of the stage DP
