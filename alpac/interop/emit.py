"""The plan's files and entries from the sharded stages: one sharded HLO module per stage
(cut into its role modules when pipelined), the ILP's decisions, the program alpa-run runs,
and the estimates."""

from __future__ import annotations

import json
from dataclasses import dataclass

from alpac.analysis.costmodel import (CostModel, feed_seconds, free_seconds,
                                      host_cores_seconds, launch_cpu_seconds, launch_seconds,
                                      node_bytes, rank_cpu_seconds, staging_seconds,
                                      waiting_cpu_seconds)
from alpac.hlo import Module, print_module
from alpac.interop.pipeline import assemble, role_modules
from alpac.interop.pricing import pipelined_peak, role_seconds
from alpac.interop.remat import checkpointed_layers, remat_split
from alpac.interop.stage import ShardedStage, ShardedStages
from alpac.interop.unroll import Unrolled
from alpac.plan.program import Program, Role, Transfer, single_stage_program
from alpac.plan.schedule import bubble_share, step_seconds


# a stage's host work in plan.json's estimate: per key, seconds per microbatch and per step
HOST_WORK = ("launch_s", "receive_s", "send_s", "feed_s", "free_s")


@dataclass(frozen=True)
class EmittedPlan:
    """What goes into the plan directory: files by plan-relative path, and plan.json's
    `num_micro_batches`, `stages`, `program` and `estimate`."""

    files: dict[str, str]
    entries: dict
    solve_seconds: tuple[dict, ...]  # per stage: run-dependent, for compile-stats.json

    def plan_entries(self) -> dict:
        return self.entries


def emit_plan(source: Module, sharded: ShardedStages, cluster=None,
              unrolled: Unrolled | None = None) -> EmittedPlan:
    """`cluster`: prices the module launches (a calibrated cluster's, per module run and per
    array it returns) and the transfers between meshes; `unrolled`: the layer loops
    unrolled before planning (the program's inputs and outputs are then pieces of the module
    before)."""
    cluster = sharded.assignment.runs_on or cluster
    files: dict[str, str] = {}
    stages = [_stage_entry(s, files) for s in sharded.stages]
    entries = {"num_micro_batches": sharded.assignment.micro_batches, "stages": stages}
    unrolled = unrolled if unrolled is not None and unrolled.loops else None
    files["source.hlo"] = unrolled.source_text if unrolled else print_module(source)  # --check
    first = sharded.stages[0]
    if first.stage.pipeline_stage is None:
        program = single_stage_program(source, first.sharding.module, first.stage.mesh,
                                       stages[0]["module"])
        program.layout = unrolled.layout() if unrolled else None
        _loop_iterations(program, stages)
        host = {key: per_stage.get(0, (0.0, 0.0))[1] for key, per_stage in _host_work(
            program, [first.stage.mesh], cluster, _role_launches(program, cluster)).items()}
        for key, seconds in host.items():
            stages[0]["estimate"][key] = {"per_microbatch": 0.0, "per_step": seconds}
        entries["program"] = program.to_dict()
        cores = _host_cores(stages, cluster, 1)
        entries["estimate"] = {
            "iteration_time_s": max(sum(e["estimate"]["time_s"] for e in stages)
                                    + sum(host.values()), cores),
            "peak_memory_bytes": max(e["estimate"]["peak_memory_bytes"] for e in stages),
            **({"host_cores_s": cores} if cores else {}),
        }
    else:
        entries.update(_pipelined(source, sharded, stages, files, unrolled, cluster))
    solves = tuple({"index": s.stage.index, "ilp_solve_time_s": s.sharding.solution.solve_time}
                   for s in sharded.stages)
    return EmittedPlan(files, entries, solves)


def _stage_entry(done: ShardedStage, files: dict[str, str]) -> dict:
    """A stage's sharded module and decisions (into `files`) and its plan.json entry."""
    stage, result = done.stage, done.sharding
    module_file = f"stage{stage.index}.hlo"
    decisions_file = f"stage{stage.index}.decisions.json"
    files[module_file] = print_module(result.module)
    files[decisions_file] = json.dumps(result.decisions(), indent=1, sort_keys=True) + "\n"
    sol = result.solution
    comm = result.communication_seconds()
    seconds = result.seconds()
    return {
        "index": stage.index,
        "layers": list(stage.layers) if stage.layers else None,
        "mesh": {"devices": list(stage.mesh.devices),
                 "logical_shape": list(stage.mesh.shape),
                 "physical_shape": list(stage.physical_shape or ())},
        "module": module_file,
        "decisions": decisions_file,
        "weights_stored_split": stage.weights_stored_split,
        "remat": None if stage.pipeline_stage is None else _remat_entry(stage.pipeline_stage),
        "ilp": {"objective_s": sol.objective, "gap": sol.gap, "status": sol.status,
                "graph_before_reduction": sol.size_before,
                "graph_after_reduction": sol.size_after,
                "rounds": [list(r) for r in result.rounds],
                "memory_budget_bytes": result.budget},
        "collectives": result.collective_summary(),
        "estimate": {"time_s": seconds, "communication_s": comm,
                     "compute_s": max(seconds - comm, 0.0),
                     "peak_memory_bytes": sol.peak_memory},
    }


def _loop_iterations(program: Program, entries: list[dict]) -> None:
    """Per stage of a plan whose layer loops were unrolled, the loop iterations (rows of the
    stacked inputs) its modules take."""
    if not program.layout:
        return
    rows_of = {}
    for i in program.inputs:
        _, first, stop, _ = program.layout["parameters"][i.parameter]
        if first is not None:
            rows_of[i.value] = range(first, stop)
    for entry in entries:
        rows = {r for m in program.modules if m.stage == entry["index"]
                for p in m.parameters for r in rows_of.get(p.value, ())}
        entry["loop_iterations"] = sorted(rows)


def _host_work(program: Program, meshes: list, cluster, role_launches
               ) -> dict[str, dict[int, tuple[float, float]]]:
    """Per kind of alpa-run's host work (`HOST_WORK`): stage (each on its own mesh) ->
    seconds per microbatch and per step, beside the ILP's."""
    return dict(zip(HOST_WORK, (
        _launch_seconds(role_launches), _receive_seconds(program, meshes, cluster),
        _send_seconds(program, cluster), _feed_seconds(program, cluster),
        _free_seconds(program, cluster))))


def _receive_seconds(program: Program, meshes: list, cluster
                     ) -> dict[int, tuple[float, float]]:
    """Mesh -> seconds its ranks spend per microbatch and per step receiving values from
    other meshes. alpa-run receives on the host, between the destination's modules (wait for
    the message, put it on the devices), so a stage's time includes them; every rank of the
    destination receives the pieces its devices hold at once, so each transfer is priced as
    the cluster's send (a calibrated file's measured table), from the source mesh's first
    device to the destination's, of the most bytes one destination rank receives."""
    if cluster is None:
        return {}

    def seconds(t) -> float:
        src, dst = (program.meshes[m].devices[0] for m in (t.src_mesh, t.dst_mesh))
        return CostModel(cluster, meshes[t.dst_mesh]).send(
            node_bytes(t.bytes, t.dst_sharding, program.meshes[t.dst_mesh].devices, cluster),
            src, dst)
    return _by_mesh((t.dst_mesh, t.scope, seconds(t)) for t in program.transfers)


def _send_seconds(program: Program, cluster) -> dict[int, tuple[float, float]]:
    """Mesh -> seconds its ranks spend per microbatch and per step sending values to other
    meshes (`staging_seconds`: copying them off the devices and packing them, between the
    source's modules)."""
    if cluster is None:
        return {}
    return _by_mesh((t.src_mesh, t.scope, staging_seconds(cluster, t.bytes))
                    for t in program.transfers)


def _feed_seconds(program: Program, cluster) -> dict[int, tuple[float, float]]:
    """Mesh -> seconds its ranks spend per microbatch and per step feeding the program's
    inputs there (`feed_seconds` each): a per-microbatch input once per microbatch, copied
    from the host, the others once per step, carried from the step before (or copied from
    the host where no output of the step becomes them)."""
    if cluster is None:
        return {}
    carried = _carried_inputs(program)
    return _by_mesh((program.values[i.value].mesh, program.values[i.value].scope,
                     feed_seconds(cluster, i.value in carried)) for i in program.inputs)


def _carried_inputs(program: Program) -> set[str]:
    """The inputs alpa-run takes over from the step before (an output of the step becomes
    them); it copies the others from the host."""
    aliased = {parameter for _, parameter in program.aliases}
    return {i.value for i in program.inputs if i.parameter in aliased and i.batch_dim is None}


def _free_seconds(program: Program, cluster) -> dict[int, tuple[float, float]]:
    """Mesh -> seconds its ranks spend per microbatch and per step freeing arrays
    (`free_seconds` each). alpa-run frees every array a step makes on a mesh once no task
    reads it or a newer version replaces it: what its modules return, what it receives,
    what it copies from the host, the zeroed accumulators; except those a module takes as
    donated buffers (XLA reuses them). The results the next step takes over stand for the
    inputs carried from the step before, which it frees or donates in their place. Counted
    so, a two-stage GPT step frees 334 and 383 arrays per step on its meshes, as many as
    alpa-run freed (335 and 381)."""
    if cluster is None:
        return {}
    per_array = free_seconds(cluster)
    carried = _carried_inputs(program)
    per_microbatch = (Role.FORWARD, Role.BACKWARD)
    made = [(m.mesh, "microbatch" if m.role in per_microbatch else "step",
             per_array * (len(m.outputs) - len(m.donated))) for m in program.modules]
    received = [(t.dst_mesh, t.scope, per_array) for t in program.transfers]
    copied = [(program.values[i.value].mesh, program.values[i.value].scope, per_array)
              for i in program.inputs if i.value not in carried]
    zeroed = [(program.values[a].mesh, "step", per_array) for a in program.accumulators]
    return _by_mesh(made + received + copied + zeroed)


def _host_cores(entries: list[dict], cluster, B: int) -> float:
    """`host_cores_seconds` of the stages, from their entries' estimates: the host work
    each of a stage's ranks does per step (its figures per microbatch, B times, and per
    step; and `idle_cpu_s`, where pipelined) and the compute each of its devices does. Each
    entry gets its ranks' CPU per step (`rank_cpu_seconds`, the busiest rank's) as
    `cpu_per_rank_s` (host, compute), which `alpac explain --against` sets beside alpa-run's
    and XLA's threads' measured CPU."""
    if cluster is None:
        return 0.0
    loads = []
    for entry in entries:
        e = entry["estimate"]
        work = sum(B * e[key]["per_microbatch"] + e[key]["per_step"] for key in HOST_WORK
                   if key in e)
        loads.append((entry["mesh"]["devices"], work + e.get("idle_cpu_s", 0.0),
                      e["compute_s"]))
        per_rank = rank_cpu_seconds(cluster, *loads[-1])
        if per_rank:  # XLA's threads wake for a launch after a wait: not alpa-run's CPU
            host, compute = max(per_rank.values(), key=sum)
            wake = e.get("wake_cpu_s", 0.0)
            e["cpu_per_rank_s"] = {"host": host - wake, "compute": compute + wake}
    return host_cores_seconds(cluster, loads)


def _idle_cpu(program: Program, cluster, B: int, step: float, busy: list[float]
              ) -> list[tuple[float, float]]:
    """Per stage, the CPU time per step its ranks spend beyond their host work's figures,
    for having waited between tasks (a pipeline's, `step` seconds long, in which the stage
    is `busy` for its time): each module execution launched after a wait
    (`launch_cpu_seconds`: XLA's threads waking), and the polling of each wait for the
    messages of one task of another mesh (`waiting_cpu_seconds`: alpa-run's), the stage's
    idle time shared among its waits."""
    if cluster is None:
        return [(0.0, 0.0)] * len(busy)
    per = {"microbatch": B, "step": 1}
    launches = [0] * len(busy)
    for m in program.modules:
        launches[m.stage] += B if m.role in (Role.FORWARD, Role.BACKWARD) else 1
    for mesh in {program.values[name].mesh for name in program.accumulators}:
        launches[mesh] += 1  # the module zeroing its gradient accumulators, once per step
    waits = [0] * len(busy)
    for _, dst, scope in {(t.src_mesh, t.dst_mesh, t.scope) for t in program.transfers}:
        waits[dst] += per[scope]
    return [(n * launch_cpu_seconds(cluster),
             w * waiting_cpu_seconds(cluster, max(step - b, 0.0) / w) if w else 0.0)
            for n, w, b in zip(launches, waits, busy)]


def _by_mesh(items) -> dict[int, tuple[float, float]]:
    """(mesh, scope, seconds) items summed per mesh: (per microbatch, per step)."""
    out: dict[int, list[float]] = {}
    for mesh, scope, seconds in items:
        out.setdefault(mesh, [0.0, 0.0])[0 if scope == "microbatch" else 1] += seconds
    return {mesh: (mb, step) for mesh, (mb, step) in out.items()}


def _role_launches(program: Program, cluster) -> dict[tuple[int, str], float]:
    """(stage, role) -> seconds of launching that stage's modules of that role once each (a
    calibrated cluster's `launch_seconds`): `launch_s` per execution, `array_s` per array
    it returns (the host's work per result; a small GPT's one-stage step returns ~200: its
    weights and optimizer state) and `argument_s` per array it takes (a GPT step of 4
    microbatches here takes 1383, each ~1.4 µs as alpa-run hands it over); and (stage,
    "zero"): the module alpa-run runs at the start of each step that zeroes the stage's
    gradient accumulators (it takes none)."""
    if cluster is None:
        return {}
    out: dict[tuple[int, str], float] = {}
    for m in program.modules:
        out[m.stage, m.role] = out.get((m.stage, m.role), 0.0) + \
            launch_seconds(cluster, len(m.outputs), len(m.parameters))
    zeroed: dict[int, int] = {}
    for name in program.accumulators:
        mesh = program.values[name].mesh
        zeroed[mesh] = zeroed.get(mesh, 0) + 1
    for mesh, arrays in zeroed.items():  # one mesh per stage
        out[mesh, "zero"] = launch_seconds(cluster, arrays)
    return out


def _launch_seconds(role_launches: dict[tuple[int, str], float]
                    ) -> dict[int, tuple[float, float]]:
    """Stage -> seconds per microbatch (its forward and backward modules) and per step (the
    others) of launching its modules, from `_role_launches`."""
    out: dict[int, list[float]] = {}
    for (stage, role), seconds in role_launches.items():
        per = out.setdefault(stage, [0.0, 0.0])
        per[0 if role in (Role.FORWARD, Role.BACKWARD) else 1] += seconds
    return {stage: (mb, step) for stage, (mb, step) in out.items()}


def _forward_share(done: ShardedStage, launches: dict[tuple[int, str], float], B: int
                   ) -> float:
    """The forward module's part of the stage's forward and backward seconds per microbatch,
    its launch included: where the predicted trace and `explain --against` split a stage's
    time between its two modules."""
    stage, index = done.stage.pipeline_stage, done.stage.index
    seconds = role_seconds(stage, done.sharding, remat_split(stage))
    forward, backward = (seconds[role] / B + launches.get((index, role), 0.0)
                         for role in (Role.FORWARD, Role.BACKWARD))
    return forward / (forward + backward) if forward + backward > 0 else 0.5


def _remat_entry(stage) -> dict[str, str]:
    """Layer -> how its backward recomputes: the stage's choice, or `program` where the
    program recomputes itself (alpac then adds nothing)."""
    checkpointed = checkpointed_layers(stage)
    return {str(layer): "program" if checkpointed is None or layer in checkpointed
            else str(mode) for layer, mode in sorted(stage.remat.items())}


def _pipelined(source: Module, sharded: ShardedStages, entries: list[dict],
               files: dict[str, str], unrolled: Unrolled | None, cluster) -> dict:
    """Role modules of every stage, the program, and the pipeline's estimates."""
    graph, modules = sharded.assignment.pipeline
    B = sharded.assignment.micro_batches
    roles = []
    for done, entry in zip(sharded.stages, entries):
        mine = role_modules(done.stage.pipeline_stage, done.sharding.module)
        roles += mine
        entry["modules"] = {rm.role: f"stage{done.stage.index}.{rm.role}.hlo" for rm in mine}
    program, role_files = assemble(graph, modules, roles,
                                   [s.stage.mesh for s in sharded.stages],
                                   source, B)
    files.update(role_files)
    program.layout = unrolled.layout() if unrolled else None
    _loop_iterations(program, entries)
    S = len(sharded.stages)
    role_launches = _role_launches(program, cluster)
    host = _host_work(program, [s.stage.mesh for s in sharded.stages], cluster, role_launches)
    times, applies, peaks = [], [], []
    for s, (done, entry) in enumerate(zip(sharded.stages, entries)):
        figures, in_flight, peak = pipelined_peak(done.stage.pipeline_stage, done.sharding,
                                                  S, s, B)
        mine = {key: per_stage.get(s, (0.0, 0.0)) for key, per_stage in host.items()}
        figures = figures.plus(sum(mb for mb, _ in mine.values()),
                               sum(step for _, step in mine.values()))
        entry["estimate"].update({key: dict(zip(("per_microbatch", "per_step"), pair))
                                  for key, pair in mine.items()})
        entry["estimate"].update({
            "time_per_microbatch_s": figures.t, "apply_s": figures.apply,
            "static_bytes": figures.static_bytes,
            "transient_bytes": figures.transient_bytes,
            "activation_bytes_per_microbatch": figures.activation_bytes,
            "microbatches_in_flight": in_flight, "peak_memory_bytes": peak,
            "forward_share": _forward_share(done, role_launches, B)})
        times.append(figures.t)
        applies.append(figures.apply)
        peaks.append(peak)
    idle = _idle_cpu(program, cluster, B,
                     step_seconds(sum(times), max(times), max(applies), B),
                     [B * t + a for t, a in zip(times, applies)])
    for entry, (wake, poll) in zip(entries, idle):
        entry["estimate"].update(idle_cpu_s=wake + poll, wake_cpu_s=wake)
    cores = _host_cores(entries, cluster, B)
    return {"program": program.to_dict(), "estimate": {
        "iteration_time_s": step_seconds(sum(times), max(times), max(applies), B, cores),
        **({"host_cores_s": cores} if cores else {}),
        "bubble_fraction": bubble_share(sum(times), max(times), S, B),
        "peak_memory_bytes": max(peaks),
        "bytes_between_meshes": program.transfer_bytes(),
    }}
