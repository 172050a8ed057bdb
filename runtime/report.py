"""The run report: built on rank 0 from every rank's statistics, printed with rich and written
as JSON (`--report FILE.json`).

JSON fields: `plan`, `source_sha256` and `program_sha256` (which plan ran), `ranks`,
`devices_per_rank`, `schedule`, `num_micro_batches`, `num_stages`, `iterations`,
`iteration_time_s` (list, one per iteration, the slowest rank's), `median_iteration_time_s`,
`throughput` (`steps_per_s`, and `samples_per_s` with `batch_size` when the batch size is
known), `stages` (per mesh: `mesh`, `stages`, `devices`, `ranks`, `busy_s` and `idle_s` per
iteration, `peak_live_microbatches`, `schedule_max_live_microbatches`),
`bytes_between_meshes` (measured in one step, the most of any iteration),
`bytes_between_meshes_per_iteration`, `bytes_between_meshes_by_pair`,
`predicted_bytes_between_meshes` (the plan's `Program.transfer_bytes()`),
`bytes_between_steps` (aliased outputs moved to another mesh for the next step),
`transfer_time_s`, `per_rank` (per rank: `rank`, `meshes`, and per iteration where its
step's time went, `modules_s`, `transfers_s` (sending, and receiving once the data came),
`waiting_s` (for another rank's data) and `other_s` (the rest: feeding inputs, zeroing
accumulators, moving outputs to the next step, bookkeeping), `cpu_s`, the CPU time its
process used per iteration, every thread of it, and `own_cpu_s`, of it alpa-run's own
threads' (its host work; the rest is XLA's threads: compute and collectives)), `hosts` (per
host: `host`, `ranks`, `cores` they may run on, `cpu_s` per iteration: their CPU time
together), `modules` (per module that ran: `name`, `stage`, `role`, `mesh`,
`executions_per_step`, `median_s` per execution over every rank and iteration), and when
`--check` ran `check` (`rtol`, `max_rel_error`: per output `out<k>` and `overall`, `passed`;
`rounding_floor`: on an accelerator where the error was over `rtol`, what the original module
on it and on the host's CPU differ by, `devices` and `max_rel_error`, else null).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from alpac.plan.program import Role
from alpac.plan.schedule import max_live_microbatches


def build(*, plan_dir: str, identity: dict, timeline, ranks: int, devices_per_rank: int,
          per_rank: list, placement: list, batch_size: int | None,
          check: dict | None) -> dict:
    """`per_rank[r]` is rank r's list of `StepStats`, one per iteration; `placement[r]` its
    host's name and the cores it may run on."""
    program = timeline.program
    iters = len(per_rank[0]) if per_rank else 0
    times = [max(stats[i].seconds for stats in per_rank) for i in range(iters)]
    median = statistics.median(times) if times else 0.0
    bound = {}
    if timeline.stages:
        has_backward = any(m.role == Role.BACKWARD for m in program.modules)
        for s, n in zip(timeline.stages, max_live_microbatches(
                len(timeline.stages), program.num_micro_batches, timeline.kind, has_backward)):
            bound[timeline.stage_mesh[s]] = n
    meshes = []
    for i, mesh in enumerate(program.meshes):
        holders = [r for r, stats in enumerate(per_rank) if stats and i in stats[0].busy]
        busy = [max((per_rank[r][k].busy[i] for r in holders), default=0.0)
                for k in range(iters)]
        meshes.append({
            "mesh": i,
            "stages": sorted({m.stage for m in program.modules if m.mesh == i}),
            "devices": list(mesh.devices),
            "ranks": holders,
            "busy_s": busy,
            "idle_s": [max(t - b, 0.0) for t, b in zip(times, busy)],
            "peak_live_microbatches": max((per_rank[r][k].peak_live[i] for r in holders
                                           for k in range(iters)), default=0),
            "schedule_max_live_microbatches": bound.get(i),
        })
    per_iter, pairs = [], {}
    for k in range(iters):
        total = 0
        for stats in per_rank:
            for (src, dst), n in stats[k].bytes.items():
                total += n
                if k == iters - 1:
                    pairs[(src, dst)] = pairs.get((src, dst), 0) + n
        per_iter.append(total)
    report = {
        "plan": plan_dir,
        **identity,
        "ranks": ranks,
        "devices_per_rank": devices_per_rank,
        "schedule": timeline.kind,
        "num_micro_batches": program.num_micro_batches,
        "num_stages": max(len(timeline.stages), 1),
        "iterations": iters,
        "iteration_time_s": times,
        "median_iteration_time_s": median,
        "throughput": {"steps_per_s": 1.0 / median if median > 0 else None,
                       "batch_size": batch_size,
                       "samples_per_s": batch_size / median if median > 0 and batch_size
                       else None},
        "stages": meshes,
        "bytes_between_meshes": max(per_iter, default=0),
        "bytes_between_meshes_per_iteration": per_iter,
        "bytes_between_meshes_by_pair": [{"src_mesh": s, "dst_mesh": d, "bytes": n}
                                         for (s, d), n in sorted(pairs.items())],
        "predicted_bytes_between_meshes": program.transfer_bytes(),
        "bytes_between_steps": max((sum(st[k].carry_bytes for st in per_rank)
                                    for k in range(iters)), default=0),
        "transfer_time_s": [max(st[k].transfer_seconds for st in per_rank)
                            for k in range(iters)],
        "per_rank": rank_times(per_rank),
        "hosts": host_cpu(per_rank, placement),
        "modules": module_times(timeline, per_rank),
    }
    if check is not None:
        report["check"] = check
    return report


SPENT = {"run": "modules_s", "send": "transfers_s", "recv": "transfers_s",
         "wait": "waiting_s"}


def rank_times(per_rank: list) -> list[dict]:
    """Per rank, where each iteration's step went (the module docstring's `per_rank`)."""
    out = []
    for r, stats in enumerate(per_rank):
        row = {"rank": r, "meshes": sorted(stats[0].busy) if stats else [],
               "modules_s": [], "transfers_s": [], "waiting_s": [], "other_s": []}
        for step in stats:
            spent = dict.fromkeys(("modules_s", "transfers_s", "waiting_s"), 0.0)
            for kind, _, start, end in step.events:
                spent[SPENT[kind]] += end - start
            for key, seconds in spent.items():
                row[key].append(seconds)
            row["other_s"].append(step.seconds - sum(spent.values()))
        row["cpu_s"] = [step.cpu_seconds for step in stats]
        row["own_cpu_s"] = [step.own_cpu_seconds for step in stats]
        out.append(row)
    return out


def host_cpu(per_rank: list, placement: list[tuple[str, list[int]]]) -> list[dict]:
    """Per host: its ranks, the cores they may run on, and per iteration the CPU time they
    used together. Over the cores, that is the least time the host needed for the iteration:
    where ranks outnumber cores (simulated devices), it can set the measured time."""
    hosts: dict[str, dict] = {}
    for r, (host, mine) in enumerate(placement):
        h = hosts.setdefault(host, {"host": host, "ranks": [], "cores": set()})
        h["ranks"].append(r)
        h["cores"].update(mine)
    iters = len(per_rank[0]) if per_rank else 0
    return [{"host": h["host"], "ranks": h["ranks"], "cores": len(h["cores"]),
             "cpu_s": [sum(per_rank[r][k].cpu_seconds for r in h["ranks"])
                       for k in range(iters)]}
            for h in hosts.values()]


def module_times(timeline, per_rank: list) -> list[dict]:
    """Per module that ran: executions per step and the median seconds of one execution."""
    seconds: dict[str, list[float]] = {}
    for stats in per_rank:
        for step in stats:
            for kind, ref, start, end in step.events:
                if kind == "run":
                    seconds.setdefault(timeline.tasks[ref].module.name, []).append(end - start)
    runs: dict[str, int] = {}
    for task in timeline.tasks:
        if task.kind == "run":
            runs[task.module.name] = runs.get(task.module.name, 0) + 1
    return [{"name": m.name, "stage": m.stage, "role": str(m.role), "mesh": m.mesh,
             "executions_per_step": runs.get(m.name, 0),
             "median_s": statistics.median(seconds[m.name])}
            for m in timeline.program.modules if m.name in seconds]


def write(report: dict, path: Path) -> None:
    from alpac.plan.io import write_replacing
    write_replacing(path, json.dumps(report, indent=1) + "\n", "report")


def render(report: dict, console) -> None:
    from rich.table import Table
    ms = 1e3
    t = report["iteration_time_s"]
    head = (f"[bold]alpa-run[/] {report['plan']}: {report['ranks']} ranks x "
            f"{report['devices_per_rank']} devices, {report['num_stages']} stage(s), "
            f"{report['num_micro_batches']} microbatch(es), schedule {report['schedule']}")
    console.print(head)
    if t:
        tp = report["throughput"]
        line = (f"{report['iterations']} iterations: " +
                ", ".join(f"{x * ms:.2f}" for x in t) + f" ms; median "
                f"{report['median_iteration_time_s'] * ms:.2f} ms = "
                f"{tp['steps_per_s']:.1f} steps/s")
        if tp.get("samples_per_s"):
            line += f", {tp['samples_per_s']:.0f} samples/s (batch {tp['batch_size']})"
        console.print(line)
    table = Table(title="per mesh (median over iterations)", show_edge=False)
    for col in ("mesh", "stages", "devices", "ranks", "busy ms", "idle ms", "live mb (bound)"):
        table.add_column(col, justify="right" if col not in ("devices",) else "left")
    for m in report["stages"]:
        busy = statistics.median(m["busy_s"]) if m["busy_s"] else 0.0
        idle = statistics.median(m["idle_s"]) if m["idle_s"] else 0.0
        b = m["schedule_max_live_microbatches"]
        table.add_row(str(m["mesh"]), ",".join(map(str, m["stages"])),
                      _devices(m["devices"]), ",".join(map(str, m["ranks"])),
                      f"{busy * ms:.2f}", f"{idle * ms:.2f}",
                      f"{m['peak_live_microbatches']}" + (f" ({b})" if b is not None else ""))
    console.print(table)
    console.print(f"bytes between meshes per step: {report['bytes_between_meshes']:,} measured, "
                  f"{report['predicted_bytes_between_meshes']:,} planned" +
                  (f"; {report['bytes_between_steps']:,} between steps"
                   if report["bytes_between_steps"] else ""))
    check = report.get("check")
    if check:
        errs = check["max_rel_error"]
        worst = sorted(((k, v) for k, v in errs.items() if k != "overall"),
                       key=lambda kv: -kv[1])[:5]
        status = "[green]passed[/]" if check["passed"] else "[red bold]FAILED[/]"
        floor = check.get("rounding_floor")
        within = (f"; the original module on {floor['devices']} differs by "
                  f"{floor['max_rel_error']:.3g}: the rounding floor" if floor else "")
        console.print(f"check against one device: max relative error {errs['overall']:.3g} "
                      f"(rtol {check['rtol']:g}{within}) {status}; worst: " +
                      ", ".join(f"{k} {v:.3g}" for k, v in worst))


def _devices(devices: list[int]) -> str:
    if len(devices) > 2 and devices == list(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(map(str, devices))
