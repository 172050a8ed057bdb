"""Runs this rank's part of a `Timeline`: its tasks in the global order, the transfers around
them, freeing, and the accounting the report and the tests read.

Per task: receive the versions it reads from other meshes; run it (feed an input, zero an
accumulator, or run a module: arguments laid out as the module expects, a copy for a donated
argument that is read again later); send what other meshes read; keep host copies of
per-microbatch outputs when asked; free what is read no more; count, per mesh, the
microbatches whose values are alive.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from alpac.errors import UserError
from alpac.plan.io import read_plan_text
from alpac.runtime.collectives import rejoin_reduce_scatters
from alpac.runtime.comm import Comm
from alpac.runtime.timeline import Task, Timeline
from alpac.runtime.transfers import TAG_BASE, TAG_CARRY, Move, Mover, host_dtype, zeros_module
from alpac.xla.bridge import (compile_hlo, execute_unchecked, host_to_devices,
                              jax_parameter_shardings)


@dataclass
class StepStats:
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time in the step (every thread of it)
    own_cpu_seconds: float = 0.0  # of it, alpa-run's own threads' (`Comm.own_cpu`)
    started: float = 0.0  # this rank's perf_counter at the step's start (the trace aligns)
    busy: dict[int, float] = field(default_factory=dict)  # mesh -> seconds running modules
    transfer_seconds: float = 0.0
    bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    carry_bytes: int = 0
    peak_live: dict[int, int] = field(default_factory=dict)  # mesh -> microbatches
    # (kind, ref, start, end): kind "run" (ref: task index), "send", "recv" or "wait" (ref:
    # transfer id; a wait is a receive's time until its data came in, the receive the rest);
    # seconds from the step's start. Tuples, so keeping them costs nothing measurable.
    events: list[tuple[str, int, float, float]] = field(default_factory=list)


class Executor:
    def __init__(self, timeline: Timeline, plan_dir: Path, comm: Comm, devices: list,
                 devices_per_rank: int, timeout: float, allgather_min_bytes: int = 0):
        self.tl = timeline
        self.program = timeline.program
        self.comm = comm
        self.rank = comm.rank
        self.timeout = timeout
        k = devices_per_rank
        mine = set(range(self.rank * k, (self.rank + 1) * k))
        self.meshes = [[devices[d] for d in m.devices] for m in self.program.meshes]
        self.my_meshes = {i for i, m in enumerate(self.program.meshes) if mine & set(m.devices)}
        rank_of = {d: d // k for m in self.program.meshes for d in m.devices}
        self.mover = Mover(comm, self.meshes, rank_of,
                           [list(m.devices) for m in self.program.meshes], timeout,
                           allgather_min_bytes)
        self.stream = timeline.tasks_for(self.my_meshes)
        self.exes: dict[str, object] = {}
        self.param_shardings: dict[str, list] = {}
        self.moves = [self._move(t) for t in timeline.transfers]
        self._compile(plan_dir)
        self.slots: dict[tuple, object] = {}
        self.live: dict[int, dict[int, int]] = {m: {} for m in self.my_meshes}  # mesh -> mb -> n
        self.host_out: list[tuple[int, int, tuple, np.ndarray]] = []
        self.tasks_done = 0
        self._checked: set[int] = set()  # run tasks whose arguments were checked once
        self._zero_blocks = zero_blocks(self.stream)
        self._zero_makers: dict[int, object] = {}  # first task of a block -> its zeros module
        self._zeros: dict[int, object] = {}  # task index -> its array, made with its block
        self._hooks = _test_hooks(self.rank)

    # ---- setup -------------------------------------------------------------------------
    def _compile(self, plan_dir: Path) -> None:
        texts: dict[str, str] = {}
        for mod in self.program.modules:
            if mod.mesh not in self.my_meshes or mod.name in self.exes:
                continue
            path = plan_dir / mod.file
            if mod.file not in texts:
                texts[mod.file] = read_plan_text(plan_dir, mod.file, "module file")
            text = texts[mod.file]
            devices = self.meshes[mod.mesh]
            if devices[0].platform == "cpu" and len({d.process_index for d in devices}) > 1:
                # gloo's reduce-scatter may send overwritten data (runtime/collectives.py)
                text = rejoin_reduce_scatters(text)
            try:
                exe = compile_hlo(text, devices)
            except ValueError as e:
                raise UserError(str(e), path=str(path)) from None
            if len(exe.parameter_types) != len(mod.parameters) or \
                    len(exe.output_types) != len(mod.outputs):
                raise UserError(f"module {mod.name} takes {len(exe.parameter_types)} and gives "
                                f"{len(exe.output_types)} values; the program says "
                                f"{len(mod.parameters)} and {len(mod.outputs)}", path=str(path))
            self.exes[mod.name] = exe
            self.param_shardings[mod.name] = jax_parameter_shardings(exe)

    def _move(self, t) -> Move:
        where = f" microbatch {t.m}" if t.m is not None else ""
        return Move(t.id, TAG_BASE + 4 * t.id, f"{t.value}{where} (mesh {t.src_mesh} -> "
                    f"{t.dst_mesh})", t.src_mesh, t.dst_mesh, t.src_sharding, t.dst_sharding,
                    t.shape, t.dtype)

    # ---- one step ----------------------------------------------------------------------
    def run_step(self, host_inputs: dict[int, np.ndarray], carried: dict[str, object],
                 collect: bool) -> StepStats:
        """Run this rank's tasks of one step. `carried` maps input values to arrays from the
        previous step; returns the statistics; the step outputs stay in `self.slots`."""
        stats = StepStats(busy={m: 0.0 for m in self.my_meshes},
                          peak_live={m: 0 for m in self.my_meshes})
        self.mover.bytes = {}
        self.mover.seconds = 0.0
        self.host_out = []
        t0 = stats.started = time.perf_counter()
        for task in self.stream:
            for tid in task.recv_before:
                self._store(self.tl.transfers[tid].dst_key, self._receive(tid, t0, stats))
            if task.kind == "run":
                start, end = self._run(task)
                stats.busy[task.mesh] += end - start
                stats.events.append(("run", task.index, start - t0, end - t0))
            elif task.kind == "feed":
                self._feed(task, host_inputs, carried)
            else:
                self._zero(task)
            for tid in task.send_after:
                start = time.perf_counter()
                self.mover.send(self.moves[tid], self.slots[self.tl.transfers[tid].src_key])
                stats.events.append(("send", tid, start - t0, time.perf_counter() - t0))
            if collect:
                for pos, key in task.collect_after:
                    self._collect(pos, key)
            for key in task.free_after:
                self._drop(key)
            if task.m is not None or task.recv_before:
                self._account(task.mesh, stats)
            self.comm.progress()
            self.tasks_done += 1
            if self._hooks:
                self._hooks(self.tasks_done, task)
        self.comm.flush("the receivers of this step's transfers")
        stats.seconds = time.perf_counter() - t0
        stats.bytes = dict(self.mover.bytes)
        stats.transfer_seconds = self.mover.seconds
        return stats

    def _receive(self, tid: int, t0: float, stats: StepStats):
        start = time.perf_counter()
        array = self.mover.receive(self.moves[tid])
        end = time.perf_counter()
        if self.mover.arrived is not None:
            stats.events.append(("wait", tid, start - t0, self.mover.arrived - t0))
            start = self.mover.arrived
        stats.events.append(("recv", tid, start - t0, end - t0))
        return array

    def _feed(self, task: Task, host_inputs, carried) -> None:
        v = self.program.values[task.value]
        sharding = self.mover.sharding(task.sharding, task.mesh)
        key = task.writes[0][0]
        if task.m is None and task.value in carried:
            self._store(key, self.mover.reshard(carried.pop(task.value), task.sharding,
                                                task.mesh, v.dtype))
            return
        if task.parameter is None:  # the microbatch index
            data = np.asarray(task.m, host_dtype(v.dtype))
        else:
            data = host_inputs[task.parameter]
            if task.m is not None:
                n = data.shape[task.batch_dim] // self.program.num_micro_batches
                index = [slice(None)] * data.ndim
                index[task.batch_dim] = slice(task.m * n, (task.m + 1) * n)
                data = data[tuple(index)]
        self._store(key, host_to_devices(tuple(data.shape), sharding,
                                         lambda i, a=data: np.array(a[i], copy=True)))

    def _zero(self, task: Task) -> None:
        """The zeros of a block of zero tasks (a stage's accumulators) are made together on
        the devices, by one module: one launch instead of a host copy per array (~70 per
        step for a small GPT: 10 ms on CPU, more on a GPU)."""
        block = self._zero_blocks.get(task.index)
        if block is not None:
            make = self._zero_makers.get(task.index)
            if make is None:
                make = self._zero_makers[task.index] = self._zero_maker(block)
            self._zeros.update(zip((t.index for t in block), make()))
        self._store(task.writes[0][0], self._zeros.pop(task.index))

    def _zero_maker(self, block: list[Task]):
        values = [self.program.values[t.value] for t in block]
        exe = compile_hlo(zeros_module([(list(v.shape), v.dtype, t.sharding or "{replicated}")
                                        for v, t in zip(values, block)]),
                          self.meshes[block[0].mesh])
        return lambda: execute_unchecked(exe, [])  # no arguments to check

    def _run(self, task: Task) -> tuple[float, float]:
        """Run the task's module: the perf_counter times its execution started and ended."""
        mod = task.module
        exe = self.exes[mod.name]
        expected = self.param_shardings[mod.name]
        donated = exe.donated_parameters

        def relaid(r, a, copy: bool):
            a = self.mover.reshard(a, _text(expected[r.param], a.ndim), task.mesh,
                                   self.program.values[r.key[0]].dtype, copy=copy)
            if not copy and r.last_use:
                self._store(r.key, a)
            return a
        args = handed_over(task.reads, self.slots, expected, donated, self.mover.equivalent,
                           relaid)
        what = f"running {task.describe()} on mesh {task.mesh}"
        self.comm.watchdog.arm(what + " (its collectives wait for the mesh's other ranks)",
                               self.timeout)
        t0 = time.perf_counter()
        try:
            if task.index in self._checked:
                outs = execute_unchecked(exe, args)
            else:  # the first run checks every argument; later ones get alike arrays
                outs = exe.run_sharded(args)
                self._checked.add(task.index)
            for o in outs:
                o.block_until_ready()
        finally:
            self.comm.watchdog.disarm()
        t1 = time.perf_counter()
        if donated:
            for r in task.reads:
                if r.param in donated:
                    a = self.slots.get(r.key)
                    if a is not None and a.is_deleted():
                        self._pop(r.key)
        for (key, _), out in zip(task.writes, outs):
            self._store(key, out)
        return t0, t1

    def _store(self, key, array) -> None:
        old = self.slots.get(key)
        if old is None:
            if key[1] is not None:
                live = self.live[key[2]]
                live[key[1]] = live.get(key[1], 0) + 1
        elif old is not array and not old.is_deleted():
            old.delete()  # a superseded version: every reader of it has run
        self.slots[key] = array

    def _pop(self, key):
        a = self.slots.pop(key, None)
        if a is not None and key[1] is not None:
            live = self.live[key[2]]
            live[key[1]] -= 1
            if not live[key[1]]:
                del live[key[1]]
        return a

    def _drop(self, key) -> None:
        a = self._pop(key)
        if a is not None and not a.is_deleted():
            a.delete()

    def _collect(self, pos: int, key) -> None:
        """Host copies of this rank's distinct shards of a per-microbatch output."""
        self.host_out += host_pieces(self.slots[key], pos, key[1])

    def _account(self, mesh: int, stats: StepStats) -> None:
        n = len(self.live[mesh])
        if n > stats.peak_live[mesh]:
            stats.peak_live[mesh] = n

    # ---- between steps -----------------------------------------------------------------
    def step_outputs(self) -> dict[int, object]:
        """Output position -> array, for the step outputs whose final version is here."""
        out = {}
        for slot in self.tl.outputs:
            if slot.key is not None and slot.key in self.slots:
                out[slot.position] = self.slots[slot.key]
        return out

    def carry(self) -> tuple[dict[str, object], int]:
        """Move the outputs that feed the next step's inputs (aliases) to where those inputs
        are fed; free everything else. Returns (input value -> array, bytes moved)."""
        outputs = self.step_outputs()
        carried: dict[str, object] = {}
        used: set[int] = set()
        before = sum(self.mover.bytes.values())
        for i, c in enumerate(self.tl.carries):
            src_mesh = c.src_key[2]
            v = self.program.values[c.input_value]
            if src_mesh == c.dst_mesh:
                if c.dst_mesh in self.my_meshes:
                    a = outputs[c.output]
                    if id(a) in used:  # one output feeds two inputs: each gets its own
                        a = self.mover.reshard(a, v.sharding, c.dst_mesh, v.dtype, copy=True)
                    carried[c.input_value] = a
                    used.add(id(a))
                continue
            out_v = self.tl.outputs[c.output].value
            mv = Move(i, TAG_CARRY + 4 * i, f"{c.input_value} for the next step (mesh "
                      f"{src_mesh} -> {c.dst_mesh})", src_mesh, c.dst_mesh, out_v.sharding,
                      v.sharding, list(v.shape), v.dtype)
            if src_mesh in self.my_meshes:
                self.mover.send(mv, outputs[c.output])
            if c.dst_mesh in self.my_meshes:
                carried[c.input_value] = self.mover.receive(mv)
        self.comm.flush("the next step's inputs to move")
        keep = {id(a) for a in carried.values()}
        for key in list(self.slots):
            a = self._pop(key)
            if id(a) not in keep and not a.is_deleted():
                a.delete()
        return carried, sum(self.mover.bytes.values()) - before


def handed_over(reads, slots: dict, expected: list, donated, same_layout, relaid) -> list:
    """The arrays a module execution takes, as alpa-run hands them over: each read's array
    from the rank's slots, laid out as the module expects (`same_layout`), or
    `relaid(read, array, copy)`: laid out so (copy False), or copied where the module
    donates an array that is read again later (copy True). `alpac calibrate` times this per
    argument (`argument_s`)."""
    args = []
    for r in reads:
        a = slots[r.key]
        if not same_layout(a.sharding, expected[r.param], a.ndim):
            a = relaid(r, a, False)
        elif r.param in donated and not r.last_use:
            a = relaid(r, a, True)
        args.append(a)
    return args


def host_pieces(array, pos: int, m: int | None) -> list[tuple[int, int | None, tuple, np.ndarray]]:
    """(output position, microbatch, region, data) for the distinct regions whose first
    holder (in device-list order) is a device of this process."""
    from alpac.runtime.resharding import region_of
    shape = list(array.shape)
    index = array.sharding.devices_indices_map(tuple(shape))
    first: dict[tuple, int] = {}
    for dev in sorted(index, key=lambda d: d.id):
        first.setdefault(region_of(index[dev], shape), dev.id)
    out = []
    for s in array.addressable_shards:
        region = region_of(index[s.device], shape)
        if first[region] == s.device.id:
            out.append((pos, m, region, np.array(s.data, copy=True)))
    return out


def _text(sharding, ndim: int) -> str:
    from alpac.xla.bridge import sharding_text_of
    return sharding_text_of(sharding, ndim)


def zero_blocks(stream: list[Task]) -> dict[int, list[Task]]:
    """The zero tasks of each mesh in runs that no other task of that mesh interrupts, by
    their first task's index. Every rank of a mesh sees the mesh's tasks in one order, so
    they make the same blocks (a mesh spanning ranks runs each block's module on all)."""
    blocks: dict[int, list[Task]] = {}
    open_block: dict[int, list[Task]] = {}  # mesh -> the run being collected
    for t in stream:
        if t.kind != "zero":
            open_block.pop(t.mesh, None)
        elif t.mesh in open_block:
            open_block[t.mesh].append(t)
        else:
            open_block[t.mesh] = blocks[t.index] = [t]
    return blocks


def _test_hooks(rank: int):
    """Fault injection for the tests: ALPAC_TEST_{KILL,FAIL,HANG}_RANK=r with
    ALPAC_TEST_{KILL,FAIL,HANG}_AFTER=n make rank r, after its n-th task, kill itself
    (SIGKILL), raise, or stop responding."""
    actions = {}
    for what in ("KILL", "FAIL", "HANG"):
        r = os.environ.get(f"ALPAC_TEST_{what}_RANK")
        if r is not None and int(r) == rank:
            actions[what] = int(os.environ.get(f"ALPAC_TEST_{what}_AFTER", "1"))
    if not actions:
        return None

    def hook(done: int, task: Task) -> None:
        if actions.get("KILL") == done:
            os.kill(os.getpid(), signal.SIGKILL)
        if actions.get("FAIL") == done:
            raise RuntimeError(f"injected failure after {task.describe()} "
                               f"(ALPAC_TEST_FAIL_RANK)")
        if actions.get("HANG") == done:
            time.sleep(10 ** 6)
    return hook
