"""`alpa-run --trace FILE.json`: every rank's measured timeline as a Chrome trace-event file
(the format: `alpac.plan.trace`, shared with `alpac explain --trace`'s prediction).

One track per rank, named by the meshes and stages it holds. Per step, the events the executor
recorded (`StepStats.events`): module executions (named as in the prediction: `F3`, `B3`,
`apply`), sends, receives and the waits before them, at the time they happened: every rank's
clock read as rank 0's (`alpac.runtime.worker._clock_offsets`), so that a message is
received after it was sent and the gaps between iterations (each starts with a barrier) show.
"""

from __future__ import annotations

from alpac.plan.trace import MEASURED_PID, Span, chrome_trace, task_name


def measured_trace(plan_dir: str, timeline, per_rank: list, offsets: list[float]) -> dict:
    """`per_rank[r]`: rank r's `StepStats` per iteration; `offsets[r]`: what to add to rank
    r's clock to read rank 0's."""
    program = timeline.program
    tracks = {r: _track_name(r, program, stats) for r, stats in enumerate(per_rank)}
    origin = min((stats[0].started + offsets[r] for r, stats in enumerate(per_rank) if stats),
                 default=0.0)
    spans = []
    for r, stats in enumerate(per_rank):
        for k, step in enumerate(stats):
            at = step.started + offsets[r] - origin
            for kind, ref, start, end in step.events:
                name, category, args = _describe(timeline, kind, ref)
                spans.append(Span(r, name, category, at + start, at + end,
                                  {**args, "iteration": k}))
    return chrome_trace(f"alpa-run {plan_dir} (measured)", tracks, spans, MEASURED_PID)


def _describe(timeline, kind: str, ref: int) -> tuple[str, str, dict]:
    """(name, category, args) of one recorded event."""
    if kind == "run":
        task = timeline.tasks[ref]
        mod = task.module
        return task_name(mod.role, task.m), str(mod.role), {
            "module": mod.name, "stage": mod.stage, "role": str(mod.role),
            "microbatch": task.m, "mesh": task.mesh}
    t = timeline.transfers[ref]
    where = f" (microbatch {t.m})" if t.m is not None else ""
    return f"{kind} {t.value}{where}", kind, {
        "value": t.value, "microbatch": t.m, "src_mesh": t.src_mesh, "dst_mesh": t.dst_mesh,
        "bytes": t.bytes}


def _track_name(rank: int, program, stats: list) -> str:
    """'rank 3 (mesh 1: stage 1)': the meshes the rank holds devices of and their stages."""
    parts = []
    for mesh in sorted(stats[0].busy) if stats else []:
        stages = sorted({m.stage for m in program.modules if m.mesh == mesh})
        label = "stage" if len(stages) == 1 else "stages"
        parts.append(f"mesh {mesh}: {label} {','.join(map(str, stages))}")
    return f"rank {rank}" + (f" ({'; '.join(parts)})" if parts else "")
