"""The tasks of one step of a `Program`, in one global order that every rank computes alike.

A task runs a module (once per step, or for microbatch m), feeds an input (a whole value or
microbatch m's slice), or zeroes an accumulator. The order is:

1. feeds of whole inputs and zeroed accumulators, on the mesh of their value;
2. `prologue` modules and the `step` modules that need nothing the pipeline computes, as listed;
3. the pipeline: per stage the tasks of `alpac.plan.schedule.stage_tasks` (a stage's task for
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
from typing import NoReturn

from alpac.errors import UserError
from alpac.plan.program import ModuleSpec, OutputSpec, Program, Role, ValueSpec
from alpac.plan.schedule import KINDS, stage_tasks

Key = tuple[str, "int | None", int]  # (value, microbatch or None, mesh holding it)

ROLES = (Role.STEP, Role.PROLOGUE, Role.FORWARD, Role.BACKWARD, Role.APPLY)


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
    """The tasks of one step of `program` under schedule `kind` (default: the program's own).

    Raises ProgramError (naming `where`) for a program that cannot run as written."""
    kind = kind or program.schedule
    if kind not in KINDS:
        raise ProgramError(f"unknown schedule {kind!r}; expected one of {', '.join(KINDS)}",
                           path=where)
    _validate(program, where)
    b = _TimelineBuilder(program, where)
    stage_mesh = b.stage_meshes()
    stages = sorted(stage_mesh)
    early, after = b.split_phases()
    runs = [(mod, None) for mod in early]
    runs += _pipeline_order(program, kind, stages, b.by_role, where)
    runs += [(mod, None) for mod in after]
    b.feed_whole_inputs()
    b.zero_accumulators()
    for mod, m in runs:
        b.run(mod, m)
    outputs = b.output_slots()
    carries = b.carries(outputs)
    b.free_after_last_reads()
    b.mark_last_uses()
    return Timeline(program, kind, b.tasks, sorted(b.transfers.values(), key=lambda t: t.id),
                    outputs, carries, stages, stage_mesh)


class _TimelineBuilder:
    """The state `build` threads through its phases: the tasks so far, which version of each
    value every mesh holds, and who created and read each version (for frees and last uses).

    A version instance is `(key, version)`: version `version` of a value held at `key`."""

    def __init__(self, program: Program, where: str):
        self.program = program
        self.where = where
        self.values = program.values
        self.by_role = {r: [m for m in program.modules if m.role == r] for r in ROLES}
        self.pipeline = self.by_role[Role.FORWARD] + self.by_role[Role.BACKWARD]
        self.inputs_mb = {i.value: i for i in program.inputs if i.batch_dim is not None}
        self.inputs_whole = {i.value: i for i in program.inputs if i.batch_dim is None}
        self.listed = {(t.value, t.src_mesh, t.dst_mesh): t for t in program.transfers}
        self.tasks: list[Task] = []
        # (value, microbatch) -> (version, mesh, sharding as produced, producing task)
        self.current: dict[tuple[str, int | None], tuple[int, int, str, int]] = {}
        self.local: dict[Key, int] = {}  # key -> version held there
        self.last_version = 0
        self.uses: dict[tuple[Key, int], list[int]] = {}  # instance -> reading (sending) tasks
        self.created: dict[tuple[Key, int], int] = {}  # instance -> task that made it there
        self.superseded: set[tuple[Key, int]] = set()  # replaced there by a newer version
        self.keep: set[tuple[Key, int]] = set()  # step outputs, held to the end of the step
        # (version, destination mesh) -> the transfer that moves it there
        self.transfers: dict[tuple[int, int], TransferInst] = {}

    def fail(self, message: str) -> NoReturn:
        raise ProgramError(message, path=self.where)

    # ---- phases ------------------------------------------------------------------------
    def stage_meshes(self) -> dict[int, int]:
        """Stage -> the one mesh all its forward and backward modules run on."""
        stage_mesh: dict[int, int] = {}
        for mod in self.pipeline:
            if stage_mesh.setdefault(mod.stage, mod.mesh) != mod.mesh:
                self.fail(f"stage {mod.stage} has modules on meshes {stage_mesh[mod.stage]} "
                          f"and {mod.mesh}")
        return stage_mesh

    def split_phases(self) -> tuple[list[ModuleSpec], list[ModuleSpec]]:
        """The once-per-step modules before the pipeline and after it: `apply` modules and
        `step` modules that need (transitively) what the pipeline computes go after it."""
        late = {p.value for mod in self.pipeline for p in mod.outputs}
        early, after = [], []
        for mod in self.program.modules:
            if mod.role in (Role.FORWARD, Role.BACKWARD):
                continue
            needs_pipeline = any(p.value in late for p in mod.parameters)
            if mod.role == Role.APPLY or (mod.role == Role.STEP and needs_pipeline):
                after.append(mod)
                late |= {p.value for p in mod.outputs}
            elif needs_pipeline:
                self.fail(f"{mod.role} module {mod.name} takes a value the pipeline computes")
            else:
                early.append(mod)
        return early, after

    # ---- feeds, versions, transfers ----------------------------------------------------
    def feed_whole_inputs(self) -> None:
        for spec in self.program.inputs:
            if spec.batch_dim is None and spec.value not in self.current:
                self._feed(spec.value, None)

    def zero_accumulators(self) -> None:
        for name in self.program.accumulators:
            v = self.values[name]
            task = self._add(Task(0, "zero", v.mesh, None, value=name, sharding=v.sharding))
            self._new_version(task, name, None, v.mesh, v.sharding)

    def run(self, mod: ModuleSpec, m: int | None) -> None:
        """A task running `mod` (for microbatch m): microbatch inputs it needs are fed first,
        it reads the latest versions (received onto its mesh) and versions what it gives."""
        wanted = [(k, p, self._feed_if_needed(mod, p, m)) for k, p in enumerate(mod.parameters)]
        task = self._add(Task(0, "run", mod.mesh, m, module=mod))
        for k, p, mm in wanted:
            self._read(task, k, p.value, mm)
        for p in mod.outputs:
            v = self.values[p.value]
            if v.scope == "microbatch" and m is None:
                self.fail(f"{mod.role} module {mod.name} gives the per-microbatch value "
                          f"{p.value}")
            self._new_version(task, p.value, m if v.scope == "microbatch" else None, mod.mesh,
                              p.sharding)

    def _per_microbatch(self, value: str) -> bool:
        return (self.values[value].scope == "microbatch" or value in self.inputs_mb
                or value == self.program.microbatch_index)

    def _feed_if_needed(self, mod: ModuleSpec, p, m: int | None) -> int | None:
        """The microbatch (or None) of `mod`'s parameter `p`, fed now if it is an input not
        fed yet (a microbatch slice is fed just before its first reader)."""
        per_mb = self._per_microbatch(p.value)
        if per_mb and m is None:
            self.fail(f"{mod.role} module {mod.name} runs once per step but takes the "
                      f"per-microbatch value {p.value}")
        mm = m if per_mb else None
        if (p.value, mm) not in self.current:
            if p.value in self.inputs_mb or p.value == self.program.microbatch_index:
                self._feed(p.value, mm)
            else:
                self.fail(f"module {mod.name} takes {p.value} before any module gives it")
        return mm

    def _feed(self, value: str, m: int | None) -> None:
        v = self.values[value]
        spec = self.inputs_mb.get(value) if m is not None else self.inputs_whole.get(value)
        task = self._add(Task(0, "feed", v.mesh, m, value=value, sharding=v.sharding,
                              parameter=spec.parameter if spec else None,
                              batch_dim=spec.batch_dim if spec else None))
        self._new_version(task, value, m, v.mesh, v.sharding)

    def _add(self, task: Task) -> Task:
        task.index = len(self.tasks)
        self.tasks.append(task)
        return task

    def _new_version(self, task: Task, value: str, m, mesh: int, sharding: str) -> None:
        self.last_version += 1
        ver = self.last_version
        key = (value, m, mesh)
        self._hold(task, key, ver)
        self.current[(value, m)] = (ver, mesh, sharding, task.index)
        task.writes.append((key, ver))

    def _hold(self, task: Task, key: Key, ver: int) -> None:
        """`task` puts version `ver` at `key`, superseding the version held there before."""
        if key in self.local:
            self.superseded.add((key, self.local[key]))
        self.local[key] = ver
        self.created[(key, ver)] = task.index

    def _read(self, task: Task, param: int, value: str, mm: int | None) -> None:
        """`task` reads the latest version of (value, mm), received first if it is elsewhere
        and this mesh has not received it yet."""
        ver, src_mesh, src_sharding, producer = self.current[(value, mm)]
        key = (value, mm, task.mesh)
        if src_mesh != task.mesh and self.local.get(key) != ver:
            self._transfer(task, key, ver, src_mesh, src_sharding, producer)
        self.uses.setdefault((key, ver), []).append(task.index)
        task.reads.append(Read(param, key, ver, False))

    def _transfer(self, task: Task, key: Key, ver: int, src_mesh: int, src_sharding: str,
                  producer: int) -> None:
        """Move version `ver` to `key`: sent right after its producer, received right before
        `task`, as the program's transfer for (value, source mesh, task's mesh) says."""
        value, mm, dst_mesh = key
        t = self.listed.get((value, src_mesh, dst_mesh))
        if t is None:
            self.fail(f"module {task.module.name} on mesh {dst_mesh} takes {value} from mesh "
                      f"{src_mesh}, but the program lists no transfer for it")
        v = self.values[value]
        src_key = (value, mm, src_mesh)
        inst = TransferInst(len(self.transfers), value, mm, src_mesh, dst_mesh, src_key, key,
                            src_sharding, t.dst_sharding, list(v.shape), v.dtype, t.bytes,
                            producer, task.index)
        self.transfers[(ver, dst_mesh)] = inst
        self.tasks[producer].send_after.append(inst.id)
        task.recv_before.append(inst.id)
        self.uses.setdefault((src_key, ver), []).append(producer)
        self._hold(task, key, ver)

    # ---- outputs, carries --------------------------------------------------------------
    def output_slots(self) -> list[OutputSlot]:
        """The outputs in tuple order; a per-step output's final version is kept to the end,
        a per-microbatch one is collected right after each microbatch's producer."""
        positions = output_positions(self.program.outputs)
        slots = []
        for spec, pos in sorted(zip(self.program.outputs, positions), key=lambda x: x[1]):
            if self._per_microbatch(spec.value):
                slots.append(self._collected_slot(spec, pos))
            else:
                slots.append(self._kept_slot(spec, pos))
        return slots

    def _collected_slot(self, spec: OutputSpec, pos: int) -> OutputSlot:
        if spec.concat_dim is None:
            self.fail(f"output {list(spec.index)} is the per-microbatch value {spec.value} "
                      f"but has no concat_dim")
        mesh = None
        for m in range(self.program.num_micro_batches):
            if (spec.value, m) not in self.current:
                self.fail(f"output {spec.value} is never given for microbatch {m}")
            _, mesh, _, producer = self.current[(spec.value, m)]
            self.tasks[producer].collect_after.append((pos, (spec.value, m, mesh)))
        return OutputSlot(pos, spec, self.values[spec.value], mesh, None, True)

    def _kept_slot(self, spec: OutputSpec, pos: int) -> OutputSlot:
        if (spec.value, None) not in self.current:
            if spec.value in self.inputs_whole:
                raise AssertionError("whole inputs are always fed")
            self.fail(f"output {spec.value} is never given")
        ver, mesh, _, _ = self.current[(spec.value, None)]
        key = (spec.value, None, mesh)
        self.keep.add((key, ver))
        return OutputSlot(pos, spec, self.values[spec.value], mesh, key, False)

    def carries(self, outputs: list[OutputSlot]) -> list[Carry]:
        """The program's aliases as carries: output -> the input(s) of its parameter."""
        carries = []
        by_index = {tuple(s.spec.index): s for s in outputs}
        for out_index, param in self.program.aliases:
            slot = by_index.get(tuple(out_index))
            targets = [i for i in self.program.inputs if i.parameter == param]
            if slot is None or not targets:
                continue  # the alias names an output or input the program does not use
            for inp in targets:
                if inp.batch_dim is not None or slot.per_microbatch:
                    self.fail(f"output {list(out_index)} feeds parameter {param} of the next "
                              f"step, but one of them is per microbatch")
                v = self.values[inp.value]
                carries.append(Carry(inp.value, param, slot.position, slot.key, v.mesh,
                                     v.sharding))
        return carries

    # ---- last uses and frees -----------------------------------------------------------
    def free_after_last_reads(self) -> None:
        """Free each instance after its last reader (or its creator, if never read), unless
        it is kept, or superseded: storing the newer version frees it, and the key names that."""
        for inst, first in self.created.items():
            if inst in self.keep or inst in self.superseded:
                continue
            last = max(self.uses.get(inst, []) + [first])
            self.tasks[last].free_after.append(inst[0])

    def mark_last_uses(self) -> None:
        """A read is the last use when no later task reads the instance, it is not kept, and
        the task reads the key once: the executor may then give the buffer away."""
        for task in self.tasks:
            for r in task.reads:
                inst = (r.key, r.version)
                later = [i for i in self.uses.get(inst, []) if i > task.index]
                r.last_use = not later and inst not in self.keep and \
                    sum(1 for x in task.reads if x.key == r.key) == 1


def _pipeline_order(program: Program, kind: str, stages: list[int], by_role, where: str
                    ) -> list[tuple[ModuleSpec, int]]:
    """Forward/backward module runs: per stage the schedule's order, interleaved one stage
    task per round as soon as its per-microbatch inputs were given in an earlier round."""
    if not stages:
        return []
    B = program.num_micro_batches
    has_backward = bool(by_role[Role.BACKWARD])
    per_stage = stage_tasks(len(stages), B, kind, backward=has_backward)
    mods = {(s, r): [m for m in by_role[r] if m.stage == s] for s in stages
            for r in (Role.FORWARD, Role.BACKWARD)}
    producers: dict[str, set[str]] = {}
    for mod in by_role[Role.FORWARD] + by_role[Role.BACKWARD]:
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
