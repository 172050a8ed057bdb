"""Timelines as Chrome trace-event files (ui.perfetto.dev, chrome://tracing): the file format,
shared by `alpa-run --trace` (measured), and the schedule a plan predicts (`alpac explain
--trace`), so the two open alike.

The format is the JSON object form: `{"traceEvents": [...], "displayTimeUnit": "ms"}`, one
complete event (`"ph": "X"`, `ts` and `dur` in microseconds) per task and metadata events
(`"ph": "M"`) naming the process and each track (a thread of it). Tracks are ranks (measured)
or stages (predicted); events of one track never overlap.

The prediction: every stage runs its tasks in the order of `schedule.stage_tasks`; a task
starts when the stage's previous task is done and its inputs are ready (a forward needs the
previous stage's forward of the microbatch, a backward the next stage's backward); receiving
the values from the other stage is part of a task's time, as alpa-run receives on the host
between modules (plan.json's `receive_s`). The updates run once the pipeline has drained, as
the plan's formula (`schedule.step_seconds`) prices them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from alpac.plan.io import write_replacing
from alpac.plan.program import Role
from alpac.plan.schedule import stage_tasks

# The forward's part of a stage's time per microbatch where plan.json does not give it (a plan
# written before `forward_share`): a backward computes two products (gradients of activations
# and of weights) per forward one.
FORWARD_SHARE = 1 / 3
# distinct processes, so that a measured and a predicted file concatenate into one trace
MEASURED_PID, PREDICTED_PID = 1, 2


@dataclass(frozen=True)
class Span:
    """One task on one track; times in seconds from the start of the trace."""
    track: int
    name: str
    category: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


def chrome_trace(process: str, tracks: dict[int, str], spans: list[Span], pid: int) -> dict:
    """The trace-event object: the process and its tracks named, then the spans."""
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
               "args": {"name": process}}]
    for tid, name in sorted(tracks.items()):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
    for s in sorted(spans, key=lambda s: (s.track, s.start, s.end)):
        ts = _microseconds(s.start)
        dur = max(round(_microseconds(s.end) - ts, 3), 0.0)
        events.append({"ph": "X", "name": s.name, "cat": s.category, "ts": ts, "dur": dur,
                       "pid": pid, "tid": s.track, "args": s.args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def task_name(role: str, m: int | None) -> str:
    """`F3`, `B3` (forward, backward of microbatch 3), else the role: as `alpac explain` draws."""
    if role in (Role.FORWARD, Role.BACKWARD) and m is not None:
        return f"{role[0].upper()}{m}"
    return str(role) if m is None else f"{role} {m}"


def _microseconds(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def write_trace(trace: dict, path: Path) -> None:
    write_replacing(path, json.dumps(trace) + "\n", "trace")


# ---- the predicted schedule -----------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    tracks: dict[int, str]  # stage -> track name
    spans: list[Span]
    iteration_s: float


def _pipelined(plan: dict) -> bool:
    return all("time_per_microbatch_s" in s["estimate"] for s in plan["stages"])


def _stage_meshes(plan: dict) -> dict[int, int]:
    """Stage index -> the program's mesh of its modules."""
    found = {m["stage"]: m["mesh"] for m in plan.get("program", {}).get("modules", [])}
    return {s["index"]: found.get(s["index"], s["index"]) for s in plan["stages"]}


def module_estimates(plan: dict, forward_share: float | None = None) -> dict[str, float]:
    """Module name -> estimated seconds per execution (of the modules the plan prices);
    `forward_share` overrides each stage's split between its forward and backward."""
    by_stage = {s["index"]: s["estimate"] for s in plan["stages"]}
    backward = _has_backward(plan)
    out = {}
    for m in plan.get("program", {}).get("modules", []):
        est = by_stage.get(m["stage"], {})
        t = est.get("time_per_microbatch_s")
        beside = beside_modules(est)
        if t is not None and m["role"] in (Role.FORWARD, Role.BACKWARD):
            share = _share(est, forward_share, backward)
            t -= beside[0]
            seconds = t * share if m["role"] == Role.FORWARD else t * (1 - share)
        else:
            step = est.get("time_s")
            apply = est.get("apply_s")
            launched = None if step is None else step + launch_seconds(plan, est)
            seconds = {Role.APPLY: None if apply is None else apply - beside[1],
                       Role.STEP: launched}.get(m["role"])
        if seconds is not None:
            out[m["name"]] = seconds
    return out


def launch_seconds(plan: dict, est: dict) -> float:
    """Launching a one-stage plan's module, with its arrays, on a calibrated cluster (the
    pipelined figures have their launches in them already); a plan written before emit
    priced the arrays has the cluster's `launch_s`."""
    if "launch_s" in est:
        return est["launch_s"]["per_step"]
    return (plan["cluster"].get("calibration") or {}).get("launch_s", 0.0)


def transfer_seconds(est: dict) -> tuple[float, float]:
    """Seconds a stage's estimate counts for receiving from and sending to other stages, per
    microbatch and per step (in its time, not in its modules')."""
    (r_mb, r_step), (s_mb, s_step) = _per(est, "receive_s"), _per(est, "send_s")
    return r_mb + s_mb, r_step + s_step


def fed_and_freed_seconds(est: dict) -> tuple[float, float]:
    """Seconds a stage's estimate counts for feeding the program's inputs on its mesh and
    freeing its values, per microbatch and per step (in its time or the iteration's, not in
    its modules')."""
    (f_mb, f_step), (d_mb, d_step) = _per(est, "feed_s"), _per(est, "free_s")
    return f_mb + d_mb, f_step + d_step


def beside_modules(est: dict) -> tuple[float, float]:
    """Transfers, feeding and freeing: what a stage's time holds beside its modules' work."""
    (t_mb, t_step), (f_mb, f_step) = transfer_seconds(est), fed_and_freed_seconds(est)
    return t_mb + f_mb, t_step + f_step


def _per(est: dict, key: str) -> tuple[float, float]:
    r = est.get(key) or {}
    return r.get("per_microbatch", 0.0), r.get("per_step", 0.0)


def stage_busy_estimate(plan: dict, stage: dict) -> float:
    """Seconds a stage's modules compute per iteration: every microbatch and its update."""
    est = stage["estimate"]
    if "time_per_microbatch_s" not in est:
        return est["time_s"] + launch_seconds(plan, est)
    per_microbatch, per_step = beside_modules(est)
    return plan["num_micro_batches"] * (est["time_per_microbatch_s"] - per_microbatch) + \
        est.get("apply_s", 0.0) - per_step


def _share(est: dict, forward_share: float | None, backward: bool) -> float:
    """The forward's part of a stage's time per microbatch: `forward_share` when given, else
    the stage's own (plan.json), else `FORWARD_SHARE`; all of it in a plan without a
    backward."""
    if not backward:
        return 1.0
    return forward_share if forward_share is not None else \
        est.get("forward_share", FORWARD_SHARE)


def predict(plan: dict, forward_share: float | None = None) -> Prediction:
    """The plan's schedule in time (a stage's receives from other stages are in its tasks'
    times, as alpa-run receives on the host between modules)."""
    meshes = _stage_meshes(plan)
    devices = {s["index"]: s["mesh"]["devices"] for s in plan["stages"]}
    tracks = {i: f"stage {i} (mesh {meshes[i]}: devices {_devices(devices[i])})"
              for i in sorted(meshes)}
    if not _pipelined(plan):
        spans, t = [], 0.0
        for s in plan["stages"]:  # one module per step (a one-stage plan)
            end = t + s["estimate"]["time_s"] + launch_seconds(plan, s["estimate"]) + \
                fed_and_freed_seconds(s["estimate"])[1]
            spans.append(Span(s["index"], "step", Role.STEP, t, end, {"stage": s["index"]}))
            t = spans[-1].end
        return Prediction(tracks, spans, t)
    spans = _pipeline_spans(plan, forward_share)
    drained = max((s.end for s in spans), default=0.0)
    for s in plan["stages"]:
        apply = s["estimate"].get("apply_s", 0.0)
        if apply > 0:
            spans.append(Span(s["index"], "apply", Role.APPLY, drained, drained + apply,
                              {"stage": s["index"]}))
    return Prediction(tracks, spans, max((s.end for s in spans), default=0.0))


def predicted_trace(plan: dict, title: str) -> tuple[dict, float]:
    """The trace-event object of the plan's predicted schedule, and its iteration seconds."""
    p = predict(plan)
    return chrome_trace(title, p.tracks, p.spans, PREDICTED_PID), p.iteration_s


def _has_backward(plan: dict) -> bool:
    return any(m["role"] == Role.BACKWARD for m in plan.get("program", {}).get("modules", []))


def _pipeline_spans(plan: dict, forward_share: float | None) -> list[Span]:
    """Each stage's tasks in schedule order, each once the stage is free and its inputs are."""
    stages = sorted(plan["stages"], key=lambda s: s["index"])
    S, B = len(stages), plan["num_micro_batches"]
    kind = plan.get("program", {}).get("schedule", "1f1b")
    backward = _has_backward(plan)
    order = stage_tasks(S, B, kind, backward)
    seconds = []
    for s in stages:
        est = s["estimate"]
        t, share = est["time_per_microbatch_s"], _share(est, forward_share, backward)
        seconds.append({Role.FORWARD: t * share, Role.BACKWARD: t * (1 - share)})
    done: dict[tuple, float] = {}
    free, pos, spans = [0.0] * S, [0] * S, []
    while any(pos[i] < len(order[i]) for i in range(S)):
        moved = False
        for i in range(S):
            while pos[i] < len(order[i]):
                role, m = order[i][pos[i]]
                ready = _ready_at(i, role, m, S, done)
                if ready is None:
                    break
                start = max(free[i], ready)
                free[i] = done[(i, role, m)] = start + seconds[i][role]
                spans.append(Span(i, task_name(role, m), role, start, free[i],
                                  {"stage": i, "role": str(role), "microbatch": m}))
                pos[i] += 1
                moved = True
        if not moved:
            raise AssertionError(f"schedule {kind} deadlocks")  # cannot happen for KINDS
    return spans


def _ready_at(i: int, role: str, m: int, S: int, done: dict) -> float | None:
    """When task (role, m) of stage i has its inputs (None: not yet known)."""
    if role == Role.FORWARD:
        needs = [] if i == 0 else [(i - 1, Role.FORWARD, m)]
    else:
        needs = [(i, Role.FORWARD, m)]
        if i < S - 1:
            needs.append((i + 1, Role.BACKWARD, m))
    if any(n not in done for n in needs):
        return None
    return max((done[n] for n in needs), default=0.0)


def _devices(devices: list[int]) -> str:
    if len(devices) > 2 and devices == list(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(map(str, devices))
