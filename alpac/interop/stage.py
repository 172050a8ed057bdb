"""What the stage levels hand each other: stages with their meshes (the stage assignment),
the same stages sharded, and what the weight-update rewrite changed. All frozen: a later
step makes a new result instead of editing an earlier one."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo import Module
from alpac.plan.mesh import LogicalMesh


@dataclass(frozen=True)
class Stage:
    """A part of the program and the logical mesh it runs on."""

    index: int
    mesh: LogicalMesh
    module: Module  # the program this stage runs
    layers: tuple[int, int] | None = None  # first and last layer, when layers are known
    physical_shape: tuple[int, int] | None = None  # (nodes, devices per node) of its submesh
    pipeline_stage: object = None  # alpac.interop.pipeline.StageModule when pipelined
    hints: dict | None = None  # instruction name -> sharding its layer's ILP chose
    rule: object = None  # a filter on the ILP's choices (a forced strategy), or None
    weights_stored_split: bool = False  # the memory-lean (ZeRO-3) option of the stage DP


@dataclass(frozen=True)
class StageAssignment:
    """Stages covering the step, how many microbatches it runs in, and why it is not
    microbatched or pipelined where it is not."""

    stages: tuple[Stage, ...]
    num_micro_batches: int | None = None  # None: not microbatched (one stage)
    pipeline: tuple | None = None  # (StepGraph, [StageModule]) when pipelined
    summary: dict | None = None  # the stage DP's figures
    strategy: str | None = None  # a forced strategy (data-parallel, zero2/3, megatron:..)
    microbatching_refused: str | None = None
    pipelining_refused: str | None = None
    # the plan leaves devices idle: the cluster cut to the ones it uses (`Cluster.cut`), which
    # the later passes price on (None: every device)
    runs_on: object | None = None
    # the stages' ILPs where choosing them meant solving them (ShardedStages), and the
    # (time limit, gap) they were solved with: the intra-op pass keeps them at those settings
    solved: ShardedStages | None = None
    solved_with: tuple[float, float] | None = None

    @property
    def micro_batches(self) -> int:
        return self.num_micro_batches or 1

    def plan_entries(self) -> dict:
        entries = {}
        if self.strategy:
            entries["strategy"] = self.strategy
        if self.microbatching_refused:
            entries["microbatching"] = {"refused": self.microbatching_refused}
        if self.pipelining_refused:
            entries["pipelining"] = {"refused": self.pipelining_refused}
        if self.runs_on is not None:
            entries["devices_used"] = self.runs_on.num_devices
        if self.num_micro_batches is not None:
            entries["num_micro_batches"] = self.num_micro_batches
        if self.summary is not None:
            entries["pipeline"] = self.summary
        return entries

    def modules(self) -> list[Module]:
        return [s.module for s in self.stages]

    def check(self) -> str | None:
        """Stages cover every layer, in order, once."""
        ranges = [s.layers for s in self.stages if s.layers is not None]
        if not ranges:
            return None if len(self.stages) == 1 else "several stages without layer ranges"
        expected = 0
        for first, last in ranges:
            if first != expected or last < first:
                return f"stage layer ranges {ranges} do not cover the layers in order"
            expected = last + 1
        layers = self.summary.get("layers") if self.summary else expected
        return None if expected == layers else f"stages cover {expected} of {layers} layers"


@dataclass(frozen=True)
class ShardedStage:
    """A stage with the sharding its ILP chose, and the filter the ILP ran under."""

    stage: Stage
    sharding: object  # alpac.intraop.autoshard.ShardingResult
    rule: object = None


@dataclass(frozen=True)
class ShardedStages:
    """Every stage of the assignment sharded within the memory budget."""

    assignment: StageAssignment
    stages: tuple[ShardedStage, ...]
    budget: float
    peaks: tuple[float, ...]  # per stage, its peak bytes per device as it is judged

    def plan_entries(self) -> dict:
        return {"memory_budget_bytes": self.budget}

    def modules(self) -> list[Module]:
        return [s.sharding.module for s in self.stages]

    def check(self) -> str | None:
        """Every stage has a sharding, within the budget."""
        if len(self.stages) != len(self.assignment.stages):
            return f"{len(self.stages)} sharded stages for {len(self.assignment.stages)} stages"
        over = [s.stage.index for s, peak in zip(self.stages, self.peaks) if peak > self.budget]
        return f"stages {over} exceed the memory budget" if over else None


@dataclass(frozen=True)
class WeightUpdate:
    """What the weight-update rewrite (ZeRO) did per stage."""

    report: tuple[dict, ...]

    def plan_entries(self) -> dict:
        return {"reduce_scatter": list(self.report)}
