"""The tasks of one step of a `Program`, in one global order that every rank computes alike.

A task runs a module (once per step, or for microbatch m), feeds an input (a whole value or
microbatch m's slice), or zeroes an accumulator. The order is:

1. feeds of whole inputs and zeroed accumulators, on the mesh of their value;
2. `prologue` modules and the `step` modules that need nothing the pipeline computes, as listed;
3. the pipeline: per stage the tasks of `alpac.schedule.stage_tasks` (a stage's task for
   microbatch m runs all its forward, or all its backward, modules as listed), interleaved
   one task per stage per round in stage order, each task once its per-microbatch inputs
   exist (from the dataflow, not from assumptions about it);
4. `apply` modules and the remaining `step` modules, as listed.

A microbatch input (or the microbatch index) is fed just before the first task that reads it.
Every rank runs the subsequence of tasks on the meshes it holds devices of, in this order.
Since the order is a topological order of the dataflow and sends never block, every task
eventually finds its inputs: no rank waits on one that waits on it.

Values are versioned: a module that gives a value it took (an accumulator) makes a new
version, and a task reads the latest version before it. A version read on another mesh than
its own moves there once per (version, destination mesh), as the `Transfer` of the program
for that (value, source mesh, destination mesh) says: sent right after the producing task,
received right before the first reader. A version is freed after its last read on its mesh;
the final versions of step outputs are kept to the end of the step.

Nothing here touches jax or MPI: it is the same on every rank, and unit-testable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alpac.errors import UserError
from alpac.program import ModuleSpec, OutputSpec, Program, ValueSpec
from alpac.schedule import KINDS, stage_tasks

Key = tuple[str, "int | None", int]  # (value, microbatch or None, mesh holding it)

ROLES = ("step", "prologue", "forward", "backward", "apply")


class ProgramError(UserError):
    """The plan's program cannot be run as written."""


@dataclass
class Read:
    param: int
    key: Key
    version: int
    last_use: bool  # no later reader of this version on this mesh, and not kept to the end


@dataclass
class Task:
    index: int
    kind: str  # run | feed | zero
    mesh: int
    m: int | None = None
    module: ModuleSpec | None = None
    value: str | None = None  # feed / zero
    parameter: int | None = None  # feed: entry parameter (None: the microbatch index)
    batch_dim: int | None = None  # feed of a microbatch slice
    sharding: str = ""  # feed / zero: as fed
    reads: list[Read] = field(default_factory=list)
    writes: list[tuple[Key, int]] = field(default_factory=list)
    recv_before: list[int] = field(default_factory=list)
    send_after: list[int] = field(default_factory=list)
    free_after: list[Key] = field(default_factory=list)
    collect_after: list[tuple[int, Key]] = field(default_factory=list)  # (output pos, key)

    def describe(self) -> str:
        if self.kind == "run":
            mb = f" microbatch {self.m}" if self.m is not None else ""
            return f"module {self.module.name}{mb}"
        mb = f" (microbatch {self.m})" if self.m is not None else ""
        return f"{self.kind} {self.value}{mb}"


@dataclass
class TransferInst:
    id: int
    value: str
    m: int | None
    src_mesh: int
    dst_mesh: int
    src_key: Key
    dst_key: Key
    src_sharding: str
    dst_sharding: str
    shape: list[int]
    dtype: str
    bytes: int
    producer: int  # task index
    consumer: int  # task index of the first reader


@dataclass
class OutputSlot:
    position: int  # in the flattened output tuple
    spec: OutputSpec
    value: ValueSpec
    mesh: int
    key: Key | None  # step outputs: the final version's key (kept to the end of the step)
    per_microbatch: bool  # concatenated over microbatches along spec.concat_dim


@dataclass
class Carry:
    """An input whose next-step value is an output of this step (an alias)."""
    input_value: str
    parameter: int
    output: int  # position
    src_key: Key
    dst_mesh: int
    dst_sharding: str


@dataclass
class Timeline:
    program: Program
    kind: str
    tasks: list[Task]
    transfers: list[TransferInst]
    outputs: list[OutputSlot]
    carries: list[Carry]
    stages: list[int]  # pipeline stage numbers, in order
    stage_mesh: dict[int, int]  # stage -> mesh of its modules

    def tasks_for(self, meshes: set[int]) -> list[Task]:
        return [t for t in self.tasks if t.mesh in meshes]

    def predicted_bytes(self) -> int:
        return self.program.transfer_bytes()


def output_positions(outputs: list[OutputSpec]) -> list[int]:
    """Position of each output in the flattened output tuple (outputs sorted by index)."""
    order = sorted(range(len(outputs)), key=lambda k: list(outputs[k].index))
    pos = [0] * len(outputs)
    for p, k in enumerate(order):
        pos[k] = p
    return pos


def build(program: Program, kind: str | None = None, where: str = "plan.json") -> Timeline:
    kind = kind or program.schedule
    if kind not in KINDS:
        raise ProgramError(f"unknown schedule {kind!r}; expected one of {', '.join(KINDS)}",
                           path=where)
    _validate(program, where)
    B = program.num_micro_batches
    values = program.values
    by_role = {r: [m for m in program.modules if m.role == r] for r in ROLES}
    pipeline = by_role["forward"] + by_role["backward"]
    stages = sorted({m.stage for m in pipeline})
    stage_mesh: dict[int, int] = {}
    for mod in pipeline:
        if stage_mesh.setdefault(mod.stage, mod.mesh) != mod.mesh:
            raise ProgramError(f"stage {mod.stage} has modules on meshes "
                               f"{stage_mesh[mod.stage]} and {mod.mesh}", path=where)

    # ---- phases ------------------------------------------------------------------------
    late = {p.value for mod in pipeline for p in mod.outputs}
    early, after = [], []
    for mod in program.modules:
        if mod.role in ("forward", "backward"):
            continue
        needs_pipeline = any(p.value in late for p in mod.parameters)
        if mod.role == "apply" or (mod.role == "step" and needs_pipeline):
            after.append(mod)
            late |= {p.value for p in mod.outputs}
        elif needs_pipeline:
            raise ProgramError(f"{mod.role} module {mod.name} takes a value the pipeline "
                               f"computes", path=where)
        else:
            early.append(mod)

    runs: list[tuple[ModuleSpec, int | None]] = [(mod, None) for mod in early]
    runs += _pipeline_order(program, kind, stages, by_role, where)
    runs += [(mod, None) for mod in after]

    # ---- feeds, versions, transfers ----------------------------------------------------
    inputs_mb = {i.value: i for i in program.inputs if i.batch_dim is not None}
    inputs_whole = {i.value: i for i in program.inputs if i.batch_dim is None}
    mb_index = program.microbatch_index
    tasks: list[Task] = []
    # (value, microbatch) -> (version, mesh, sharding as produced, producing task)
    current: dict[tuple[str, int | None], tuple[int, int, str, int]] = {}
    local: dict[Key, int] = {}  # key -> version held there
    versions = [0]
    uses: dict[tuple[Key, int], list[int]] = {}
    created: dict[tuple[Key, int], int] = {}
    superseded: set[tuple[Key, int]] = set()
    transfers: dict[tuple[int, int], TransferInst] = {}
    listed = {(t.value, t.src_mesh, t.dst_mesh): t for t in program.transfers}

    def new_version(task: Task, value: str, m, mesh: int, sharding: str) -> None:
        versions[0] += 1
        ver = versions[0]
        key = (value, m, mesh)
        if key in local:
            superseded.add((key, local[key]))
        local[key] = ver
        current[(value, m)] = (ver, mesh, sharding, task.index)
        created[(key, ver)] = task.index
        task.writes.append((key, ver))

    def add(task: Task) -> Task:
        task.index = len(tasks)
        tasks.append(task)
        return task

    def feed(value: str, m: int | None) -> None:
        v = values[value]
        spec = inputs_mb.get(value) if m is not None else inputs_whole.get(value)
        task = add(Task(0, "feed", v.mesh, m, value=value, sharding=v.sharding,
                        parameter=spec.parameter if spec else None,
                        batch_dim=spec.batch_dim if spec else None))
        new_version(task, value, m, v.mesh, v.sharding)

    for spec in program.inputs:
        if spec.batch_dim is None and spec.value not in current:
            feed(spec.value, None)
    for name in program.accumulators:
        v = values[name]
        task = add(Task(0, "zero", v.mesh, None, value=name, sharding=v.sharding))
        new_version(task, name, None, v.mesh, v.sharding)

    for mod, m in runs:
        reads_spec = []
        for k, p in enumerate(mod.parameters):
            v = values[p.value]
            per_mb = v.scope == "microbatch" or p.value in inputs_mb or p.value == mb_index
            if per_mb and m is None:
                raise ProgramError(f"{mod.role} module {mod.name} runs once per step but "
                                   f"takes the per-microbatch value {p.value}", path=where)
            mm = m if per_mb else None
            if (p.value, mm) not in current:
                if p.value in inputs_mb or p.value == mb_index:
                    feed(p.value, mm)
                else:
                    raise ProgramError(f"module {mod.name} takes {p.value} before any "
                                       f"module gives it", path=where)
            reads_spec.append((k, p, mm))
        task = add(Task(0, "run", mod.mesh, m, module=mod))
        for k, p, mm in reads_spec:
            ver, src_mesh, src_sharding, producer = current[(p.value, mm)]
            key = (p.value, mm, mod.mesh)
            if src_mesh != mod.mesh and local.get(key) != ver:
                t = listed.get((p.value, src_mesh, mod.mesh))
                if t is None:
                    raise ProgramError(f"module {mod.name} on mesh {mod.mesh} takes "
                                       f"{p.value} from mesh {src_mesh}, but the program "
                                       f"lists no transfer for it", path=where)
                inst = TransferInst(len(transfers), p.value, mm, src_mesh, mod.mesh,
                                    (p.value, mm, src_mesh), key, src_sharding,
                                    t.dst_sharding, list(values[p.value].shape),
                                    values[p.value].dtype, t.bytes, producer, task.index)
                transfers[(ver, mod.mesh)] = inst
                tasks[producer].send_after.append(inst.id)
                task.recv_before.append(inst.id)
                uses.setdefault(((p.value, mm, src_mesh), ver), []).append(producer)
                if key in local:
                    superseded.add((key, local[key]))
                local[key] = ver
                created[(key, ver)] = task.index
            elif src_mesh != mod.mesh:
                pass  # received earlier for another reader on this mesh
            uses.setdefault((key, ver), []).append(task.index)
            task.reads.append(Read(k, key, ver, False))
        for p in mod.outputs:
            v = values[p.value]
            mm = m if v.scope == "microbatch" else None
            if v.scope == "microbatch" and m is None:
                raise ProgramError(f"{mod.role} module {mod.name} gives the per-microbatch "
                                   f"value {p.value}", path=where)
            new_version(task, p.value, mm, mod.mesh, p.sharding)

    # ---- outputs, carries --------------------------------------------------------------
    positions = output_positions(program.outputs)
    outputs: list[OutputSlot] = []
    keep: set[tuple[Key, int]] = set()
    for spec, pos in sorted(zip(program.outputs, positions), key=lambda x: x[1]):
        v = values[spec.value]
        per_mb = v.scope == "microbatch" or spec.value in inputs_mb or spec.value == mb_index
        if per_mb:
            if spec.concat_dim is None:
                raise ProgramError(f"output {list(spec.index)} is the per-microbatch value "
                                   f"{spec.value} but has no concat_dim", path=where)
            mesh = None
            for m in range(B):
                if (spec.value, m) not in current:
                    raise ProgramError(f"output {spec.value} is never given for microbatch "
                                       f"{m}", path=where)
                ver, mesh, _, producer = current[(spec.value, m)]
                tasks[producer].collect_after.append((pos, (spec.value, m, mesh)))
            outputs.append(OutputSlot(pos, spec, v, mesh, None, True))
        else:
            if (spec.value, None) not in current:
                if spec.value in inputs_whole:
                    raise AssertionError("whole inputs are always fed")
                raise ProgramError(f"output {spec.value} is never given", path=where)
            ver, mesh, _, _ = current[(spec.value, None)]
            key = (spec.value, None, mesh)
            keep.add((key, ver))
            outputs.append(OutputSlot(pos, spec, v, mesh, key, False))
    carries = []
    by_index = {tuple(s.spec.index): s for s in outputs}
    for out_index, param in program.aliases:
        slot = by_index.get(tuple(out_index))
        targets = [i for i in program.inputs if i.parameter == param]
        if slot is None or not targets:
            continue  # the alias names an output or input the program does not use
        for inp in targets:
            if inp.batch_dim is not None or slot.per_microbatch:
                raise ProgramError(f"output {list(out_index)} feeds parameter {param} of the "
                                   f"next step, but one of them is per microbatch", path=where)
            v = values[inp.value]
            carries.append(Carry(inp.value, param, slot.position, slot.key, v.mesh,
                                 v.sharding))

    # ---- last uses and frees -----------------------------------------------------------
    for (key, ver), first in created.items():
        inst = (key, ver)
        if inst in keep:
            continue
        readers = uses.get(inst, [])
        last = max(readers + [first])
        if inst not in superseded:
            tasks[last].free_after.append(key)
    for task in tasks:
        for r in task.reads:
            inst = (r.key, r.version)
            later = [i for i in uses.get(inst, []) if i > task.index]
            r.last_use = not later and inst not in keep and \
                sum(1 for x in task.reads if x.key == r.key) == 1
    return Timeline(program, kind, tasks, sorted(transfers.values(), key=lambda t: t.id),
                    outputs, carries, stages, stage_mesh)


def _pipeline_order(program: Program, kind: str, stages: list[int], by_role, where: str
                    ) -> list[tuple[ModuleSpec, int]]:
    """Forward/backward module runs: per stage the schedule's order, interleaved one stage
    task per round as soon as its per-microbatch inputs were given in an earlier round."""
    if not stages:
        return []
    B = program.num_micro_batches
    has_backward = bool(by_role["backward"])
    per_stage = stage_tasks(len(stages), B, kind, backward=has_backward)
    mods = {(s, r): [m for m in by_role[r] if m.stage == s] for s in stages
            for r in ("forward", "backward")}
    producers: dict[str, set[str]] = {}
    for mod in by_role["forward"] + by_role["backward"]:
        for p in mod.outputs:
            producers.setdefault(p.value, set()).add(mod.name)
    queues = []
    for s, tasks in zip(stages, per_stage):
        queues.append([(what, m, mods[(s, what)]) for what, m in tasks if mods[(s, what)]])
    done: set[tuple[str, int]] = set()
    pos = [0] * len(stages)
    order: list[tuple[ModuleSpec, int]] = []

    def ready(group, m) -> bool:
        inside = {mod.name for mod in group}
        for mod in group:
            for p in mod.parameters:
                for name in producers.get(p.value, ()):
                    if name not in inside and (name, m) not in done:
                        return False
        return True

    while any(pos[i] < len(q) for i, q in enumerate(queues)):
        ran = []
        for i, q in enumerate(queues):
            if pos[i] < len(q):
                what, m, group = q[pos[i]]
                if ready(group, m):
                    ran.append((i, m, group))
        if not ran:
            stuck = [f"stage {stages[i]} {q[pos[i]][0]} {q[pos[i]][1]}"
                     for i, q in enumerate(queues) if pos[i] < len(q)]
            raise ProgramError(f"the program cannot run under the {kind} schedule: "
                               f"{', '.join(stuck)} wait for values no task gives first",
                               path=where)
        for i, m, group in ran:
            for mod in group:
                order.append((mod, m))
            pos[i] += 1
        for i, m, group in ran:
            done.update((mod.name, m) for mod in group)
    return order


def _validate(program: Program, where: str) -> None:
    n = len(program.meshes)
    if n == 0:
        raise ProgramError("the program has no meshes", path=where)
    if program.num_micro_batches < 1:
        raise ProgramError("num_micro_batches must be at least 1", path=where)
    for i, mesh in enumerate(program.meshes):
        if not mesh.devices or len(set(mesh.devices)) != len(mesh.devices) or \
                any(not isinstance(d, int) or d < 0 for d in mesh.devices):
            raise ProgramError(f"mesh {i} has bad devices {mesh.devices}", path=where)
    names = set()
    for mod in program.modules:
        if mod.name in names:
            raise ProgramError(f"two modules are named {mod.name}", path=where)
        names.add(mod.name)
        if mod.role not in ROLES:
            raise ProgramError(f"module {mod.name} has role {mod.role!r}; expected one of "
                               f"{', '.join(ROLES)}", path=where)
        if not 0 <= mod.mesh < n:
            raise ProgramError(f"module {mod.name} is on mesh {mod.mesh}, but the program has "
                               f"{n} meshes", path=where)
        for p in mod.parameters + mod.outputs:
            if p.value not in program.values:
                raise ProgramError(f"module {mod.name} names the unknown value {p.value}",
                                   path=where)
    for i in program.inputs:
        if i.value not in program.values:
            raise ProgramError(f"input {i.parameter} names the unknown value {i.value}",
                               path=where)
    for o in program.outputs:
        if o.value not in program.values:
            raise ProgramError(f"output {list(o.index)} names the unknown value {o.value}",
                               path=where)
    for name in program.accumulators:
        if name not in program.values:
            raise ProgramError(f"accumulator {name} is not a value", path=where)
    if program.microbatch_index and program.microbatch_index not in program.values:
        raise ProgramError(f"microbatch_index {program.microbatch_index} is not a value",
                           path=where)
    for name, v in program.values.items():
        if not 0 <= v.mesh < n:
            raise ProgramError(f"value {name} is on mesh {v.mesh}, but the program has {n} "
                               f"meshes", path=where)
