"""Pipeline schedules: in which order each stage runs its forward and backward tasks.

A step of a pipelined program runs, on every stage s (0 = first), a forward task F(m) and a
backward task B(m) for each microbatch m = 0 .. B-1. A schedule fixes the order of these tasks
per stage; stages run concurrently, and a task waits for its inputs (F(m) on stage s needs F(m)
of stage s-1; B(m) on stage s needs B(m) of stage s+1 and F(m) of stage s).

Schedules (S stages, B microbatches, stage index i from 0):

- ``gpipe`` (GPipe): every stage runs F(0) .. F(B-1), then B(0) .. B(B-1). All B microbatches'
  activations are alive on every stage at the turn: at most B per stage.
- ``1f1b`` (PipeDream-Flush, as in Megatron-LM and Alpa's PipeDreamFlush): stage i first runs
  w = min(S - i - 1, B) warm-up forwards F(0) .. F(w-1); then alternates one forward and one
  backward, F(w+k), B(k) for k = 0 .. B-w-1; then the cool-down backwards B(B-w) .. B(B-1).
  A microbatch's activations live on stage i from its F to its B, so at most
  min(S - i, B) microbatches are alive on stage i at once.

Both schedules run the backwards of a stage in the order 0 .. B-1, so gradient accumulation
adds the microbatches in the same order and the two give bitwise identical results.

Forward-only programs (inference) have no backward tasks: every stage runs F(0) .. F(B-1)
under either schedule, and a microbatch's activations live on a stage only during its task.

`stage_tasks` gives the per-stage orders, `max_live_microbatches` the bound per stage, and
`timeline` a unit-time simulation of the schedule (which task each stage runs at each tick)
for estimates of the pipeline bubble. All are deterministic and pure Python.
"""

from __future__ import annotations

from alpac.plan.program import Role

KINDS = ("gpipe", "1f1b")

Task = tuple[Role, int]  # (Role.FORWARD | Role.BACKWARD, microbatch)


def _check(num_stages: int, num_micro_batches: int, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of "
                         f"{', '.join(KINDS)}")
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need at least one stage and one microbatch, got "
                         f"{num_stages} stages and {num_micro_batches} microbatches")


def stage_tasks(num_stages: int, num_micro_batches: int, kind: str = "1f1b",
                backward: bool = True) -> list[list[Task]]:
    """The ordered tasks of every stage: ``[[("forward", 0), ...], ...]``, one list per stage."""
    _check(num_stages, num_micro_batches, kind)
    S, B = num_stages, num_micro_batches
    out: list[list[Task]] = []
    for i in range(S):
        if not backward:
            out.append([(Role.FORWARD, m) for m in range(B)])
        elif kind == "gpipe":
            out.append([(Role.FORWARD, m) for m in range(B)]
                       + [(Role.BACKWARD, m) for m in range(B)])
        else:
            w = min(S - i - 1, B)
            tasks: list[Task] = [(Role.FORWARD, m) for m in range(w)]
            for k in range(B - w):
                tasks += [(Role.FORWARD, w + k), (Role.BACKWARD, k)]
            tasks += [(Role.BACKWARD, m) for m in range(B - w, B)]
            out.append(tasks)
    return out


def max_live_microbatches(num_stages: int, num_micro_batches: int, kind: str = "1f1b",
                          backward: bool = True) -> list[int]:
    """Per stage, the most microbatches whose activations are alive at once under the schedule
    (a microbatch is alive on a stage from the start of its forward to the end of its
    backward)."""
    _check(num_stages, num_micro_batches, kind)
    out = []
    for tasks in stage_tasks(num_stages, num_micro_batches, kind, backward):
        live, peak = set(), 0
        for what, m in tasks:
            live.add(m)
            peak = max(peak, len(live))
            if what == Role.BACKWARD or not backward:
                live.discard(m)
        out.append(peak)
    return out


def timeline(num_stages: int, num_micro_batches: int, kind: str = "1f1b",
             backward: bool = True) -> list[list[Task | None]]:
    """Unit-time simulation: per tick, per stage, the task it runs (None: idle). A stage runs
    its next task as soon as that task's inputs were produced at an earlier tick."""
    tasks = stage_tasks(num_stages, num_micro_batches, kind, backward)
    S = num_stages
    done: set[tuple[int, str, int]] = set()
    pos = [0] * S
    ticks: list[list[Task | None]] = []
    while any(pos[s] < len(tasks[s]) for s in range(S)):
        row: list[Task | None] = []
        for s in range(S):
            task = tasks[s][pos[s]] if pos[s] < len(tasks[s]) else None
            if task is not None and _ready(s, task, S, done):
                row.append(task)
            else:
                row.append(None)
        if all(t is None for t in row):
            raise AssertionError(f"schedule {kind} deadlocks")  # cannot happen for KINDS
        for s, task in enumerate(row):
            if task is not None:
                done.add((s, *task))
                pos[s] += 1
        ticks.append(row)
    return ticks


def _ready(s: int, task: Task, S: int, done: set) -> bool:
    what, m = task
    if what == Role.FORWARD:
        return s == 0 or (s - 1, Role.FORWARD, m) in done
    return (s, Role.FORWARD, m) in done and (s == S - 1 or (s + 1, Role.BACKWARD, m) in done)


def bubble_fraction(num_stages: int, num_micro_batches: int, kind: str = "1f1b",
                    backward: bool = True) -> float:
    """Idle share of stage-ticks in `timeline` (forward and backward taking one tick each):
    (S - 1) / (B + S - 1) for both schedules."""
    ticks = timeline(num_stages, num_micro_batches, kind, backward)
    busy = sum(t is not None for row in ticks for t in row)
    return 1.0 - busy / (len(ticks) * num_stages)


# ---- the one pipeline formula ---------------------------------------------------------------
# What every estimate of a pipelined step uses (the stage DP, the layer pricing, the plan's
# figures): stages taking t_s seconds per microbatch together (`total` = sum t_s, `slowest` =
# max t_s) finish B microbatches after filling and draining once plus B - 1 steady ticks of the
# slowest stage; the once-per-step update follows, as long as the slowest stage's. Sums are
# taken by the caller, so numpy and Python callers keep their own rounding.

def pipeline_seconds(total: float, slowest: float, num_micro_batches: int) -> float:
    """Forward and backward of B microbatches: sum t + (B - 1)·max t."""
    return total + (num_micro_batches - 1) * slowest


def step_seconds(total: float, slowest: float, slowest_apply: float,
                 num_micro_batches: int, host_cores: float = 0.0) -> float:
    """A whole step: the pipeline, then the slowest stage's update; at least `host_cores`,
    the least time the busiest host's cores need for the step's host work and compute where
    ranks share them (`costmodel.host_cores_seconds`; the stage DP leaves it out)."""
    return max(pipeline_seconds(total, slowest, num_micro_batches) + slowest_apply, host_cores)


def bubble_share(total: float, slowest: float, num_stages: int,
                 num_micro_batches: int) -> float:
    """Idle share of the stages' time in the pipeline: 1 - B·mean t / (sum t + (B-1)·max t)."""
    pipeline = pipeline_seconds(total, slowest, num_micro_batches)
    return 1 - num_micro_batches * total / num_stages / pipeline if pipeline > 0 else 0.0


def microbatches_in_flight(num_stages: int, index: int, num_micro_batches: int) -> int:
    """Microbatches whose activations stage `index` holds at once under 1F1B."""
    return min(num_stages - index, num_micro_batches)
