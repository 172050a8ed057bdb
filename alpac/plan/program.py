"""What `alpa-run` executes: the program part of a plan.

A program is a set of HLO modules, each compiled for one logical mesh, that pass named values
to each other. Everything the runtime does follows from it:

- `inputs`: entry parameter i becomes a value; with `batch_dim` set, the runtime feeds
  microbatch m the m-th of `num_micro_batches` equal slices along that dimension.
- `modules`: per module its mesh, its `role` (step, prologue, forward, backward, apply) and
  stage, the values it takes (in parameter order, with the sharding it expects) and gives (in
  output order, with the sharding it produces). Forward and backward modules run once per
  microbatch; the others once per step.
- `accumulators`: per-step values that start at zero each step and that per-microbatch
  modules take and give back updated (their buffers are donated).
- `transfers`: a value produced on one mesh and taken on another moves between them, from the
  producer's sharding to the consumer's.
- `outputs`: entry output k is a value; a per-microbatch value is concatenated along its
  batch dimension over microbatches. `aliases` says which outputs are the next step's value
  of which inputs (the module's input_output_alias), for running several steps.
- `schedule`: the pipeline schedule's name; `alpac.plan.schedule` turns it into the order of tasks.
- `layout` (plans whose layer loops the compiler cut: unrolled, or one loop per stage): the
  program's parameters and outputs are pieces of the source module's. Per program parameter
  and output position `[source, first, stop, axis]`: rows [first, stop) of that source
  parameter or output on its layer axis, one row without that axis (first null: all of it);
  `aliases` are the source module's (output position, parameter).
  alpa-run reads inputs for the source's parameters and gives the source's outputs.

Values that live per microbatch have `scope` "microbatch"; the runtime keeps one instance per
microbatch in flight.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path


class Role(enum.StrEnum):
    """What a module does in the step (the plan's `role`; a str, so it is written to and
    compared with the plan's text as it is). `accumulate` names only the compiler's step-graph
    nodes that add a microbatch's gradient to its accumulator: they run in the backward
    module."""

    STEP = "step"  # the whole step, unpipelined
    PROLOGUE = "prologue"
    FORWARD = "forward"
    BACKWARD = "backward"
    ACCUMULATE = "accumulate"
    APPLY = "apply"


@dataclass
class Param:
    value: str
    sharding: str  # XLA sharding string the module expects


@dataclass
class ModuleSpec:
    name: str
    file: str
    mesh: int
    role: str  # a Role: step | prologue | forward | backward | apply
    stage: int
    parameters: list[Param]
    outputs: list[Param]
    donated: list[int] = field(default_factory=list)  # parameter indices whose buffers it reuses


@dataclass
class ValueSpec:
    shape: list[int]
    dtype: str
    mesh: int  # where it is produced (or fed, for inputs)
    sharding: str  # as produced
    scope: str = "step"  # step | microbatch
    bytes: int = 0


@dataclass
class InputSpec:
    parameter: int
    value: str
    batch_dim: int | None = None


@dataclass
class OutputSpec:
    index: list[int]  # position in the entry's output tuple
    value: str
    concat_dim: int | None = None  # per-microbatch values are concatenated along it


@dataclass
class Transfer:
    value: str
    src_mesh: int
    dst_mesh: int
    src_sharding: str
    dst_sharding: str
    bytes: int  # of the whole array; each destination shard receives only its slice
    scope: str = "step"


@dataclass
class MeshSpec:
    devices: list[int]
    shape: list[int]


@dataclass
class Program:
    meshes: list[MeshSpec]
    values: dict[str, ValueSpec]
    inputs: list[InputSpec]
    outputs: list[OutputSpec]
    modules: list[ModuleSpec]
    accumulators: list[str] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    aliases: list[tuple[list[int], int]] = field(default_factory=list)  # (output, parameter)
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    microbatch_index: str | None = None  # a value the runtime sets to m (s32[]) per microbatch
    layout: dict | None = None  # how inputs and outputs are pieces of the source's (above)

    def to_dict(self) -> dict:
        d = _plain(self)
        if d["layout"] is None:  # (plans without cut layer loops are as they were)
            del d["layout"]
        return d

    @staticmethod
    def from_dict(d: dict) -> "Program":
        return Program(
            meshes=[MeshSpec(**m) for m in d["meshes"]],
            values={k: ValueSpec(**v) for k, v in d["values"].items()},
            inputs=[InputSpec(**i) for i in d["inputs"]],
            outputs=[OutputSpec(**o) for o in d["outputs"]],
            modules=[ModuleSpec(**{**m, "parameters": [Param(**p) for p in m["parameters"]],
                                   "outputs": [Param(**p) for p in m["outputs"]]})
                     for m in d["modules"]],
            accumulators=list(d.get("accumulators", [])),
            transfers=[Transfer(**t) for t in d.get("transfers", [])],
            aliases=[(list(o), int(p)) for o, p in d.get("aliases", [])],
            num_micro_batches=d.get("num_micro_batches", 1),
            schedule=d.get("schedule", "1f1b"),
            microbatch_index=d.get("microbatch_index"),
            layout=d.get("layout"))

    def transfer_bytes(self) -> int:
        """Bytes that cross between meshes in one step (per-microbatch transfers counted once
        per microbatch)."""
        return sum(t.bytes * (self.num_micro_batches if t.scope == "microbatch" else 1)
                   for t in self.transfers)


def _plain(value):
    """`dataclasses.asdict` without its deep copy of every leaf, which made writing the
    program of a module with many inputs and outputs slow: the program holds only
    dataclasses, lists, tuples, dicts, strings and numbers, so copying the containers is
    enough."""
    if isinstance(value, (str, int, float)) or value is None:
        return value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    items = value.items() if isinstance(value, dict) else vars(value).items()
    return {k: _plain(v) for k, v in items}


def module_signature(module) -> tuple[list[str], list[str]]:
    """XLA sharding strings of a sharded module's parameters and (flattened) outputs."""
    params = [p.sharding_text or "{replicated}" for p in module.entry.parameters]
    root = module.entry.root
    text = root.sharding_text or "{replicated}"
    if not root.shape.is_tuple:
        return params, [text]
    from alpac.plan.sharding import parse_xla_sharding
    parsed = parse_xla_sharding(text)
    leaves = len(root.shape.leaves())
    if parsed.kind == "tuple":
        return params, [e.text.strip() for e in parsed.elements]
    return params, [text] * leaves


def input_value(parameter: int) -> str:
    """The program's name for the value of entry parameter `parameter` (`inputs`)."""
    return f"arg{parameter}"


def single_stage_program(source, sharded, mesh, file: str) -> Program:
    """The program of a one-stage plan without microbatches: one module does the whole step."""
    params, outs = module_signature(sharded)
    values: dict[str, ValueSpec] = {}
    inputs, outputs = [], []
    for p, sharding in zip(source.entry.parameters, params):
        name = input_value(p.parameter_number)
        values[name] = ValueSpec(list(p.shape.dims), p.shape.dtype, 0, sharding, "step",
                                 p.shape.byte_size)
        inputs.append(InputSpec(p.parameter_number, name))
    out_names = []
    for k, ((idx, shape), sharding) in enumerate(zip(source.entry.root.shape.leaves(), outs)):
        name = f"out{k}"
        values[name] = ValueSpec(list(shape.dims), shape.dtype, 0, sharding, "step",
                                 shape.byte_size)
        outputs.append(OutputSpec(list(idx), name))
        out_names.append(name)
    donated = sorted({a.parameter_number for a in source.input_output_alias}
                     | {p for p, _ in source.buffer_donors})
    module = ModuleSpec("stage0", file, 0, Role.STEP, 0,
                        [Param(input_value(p.parameter_number), s)
                         for p, s in zip(source.entry.parameters, params)],
                        [Param(n, s) for n, s in zip(out_names, outs)], donated)
    return Program([MeshSpec(list(mesh.devices), list(mesh.shape))], values, inputs, outputs,
                   [module], aliases=[(list(a.output_index), a.parameter_number)
                                      for a in source.input_output_alias])


def load_program(plan_dir) -> tuple[dict, dict, "Program", str]:
    """The plan, its compile stats, its program and the path errors name (UserError when
    the plan has no readable program)."""
    from alpac.errors import UserError
    from alpac.plan.io import load_plan
    plan, stats = load_plan(Path(plan_dir))
    where = str(Path(plan_dir) / "plan.json")
    if "program" not in plan:
        raise UserError("the plan has no program (alpac wrote it without one; recompile it)",
                        path=where)
    try:
        program = Program.from_dict(plan["program"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"the plan's program is malformed: {type(e).__name__}: {e}",
                        path=where) from None
    return plan, stats, program, where
