"""`alpac explain PLAN`: what was decided, why, and what it should cost."""

from __future__ import annotations

import re
from pathlib import Path

from rich.console import Console
from rich.table import Table

from alpac.errors import UserError
from alpac.plan import shape
from alpac.plan.io import PLAN_FILE, load_plan, parse_json, read_plan_text
from alpac.plan.program import Role
from alpac.units import duration, si


def load(plan_dir: str | Path) -> dict:
    """The plan with run-dependent figures (solve times) merged in: the JSON summary.
    UserError naming the key where plan.json lacks what explain reads (`shape.PLAN`);
    compile-stats.json of another shape is left out, as one that is not JSON."""
    plan, stats = load_plan(plan_dir)
    if found := shape.plan_problem(plan):
        raise UserError(f"the plan file is malformed: {found}",
                        path=str(Path(plan_dir) / PLAN_FILE))
    if shape.problem(stats, shape.STATS) is not None:  # timings only: a plan reads without
        stats = {}
    times = {s["index"]: s["ilp_solve_time_s"] for s in stats.get("stages", [])}
    for stage in plan.get("stages", []):
        stage["ilp"]["solve_time_s"] = times.get(stage["index"])
    plan["compile_seconds"] = stats.get("pass_seconds", {})
    return plan


def decisions(plan_dir: str | Path, stage: dict) -> list[dict]:
    path = Path(plan_dir) / stage["decisions"]
    rows = parse_json(read_plan_text(plan_dir, stage["decisions"], "decisions file"), path,
                      "stage's decisions file")
    shape.check(rows, shape.DECISIONS, path, "stage's decisions file")
    return rows


def render(plan: dict, plan_dir: Path, console: Console, pattern: str | None,
           limit: int) -> None:
    est = plan.get("estimate", {})
    console.print(f"[bold]{plan['source']['file']}[/] ({plan['source']['module']}) on "
                  f"[bold]{plan['cluster']['name']}[/]: {len(plan['stages'])} stage(s), "
                  f"{plan['num_micro_batches']} microbatch(es)")
    console.print(f"  estimated iteration {duration(est.get('iteration_time_s', 0))}, peak "
                  f"{si(est.get('peak_memory_bytes', 0))}B per device")
    cores = est.get("host_cores_s", 0)
    if cores and cores >= est.get("iteration_time_s", 0):
        cal = plan["cluster"].get("calibration", {})
        console.print(f"  bound by the host's cores: {cal.get('ranks_per_host')} ranks share "
                      f"{cal.get('host_cores')} core(s), and each rank's host work (launching, "
                      f"moving, feeding, freeing) with each device's compute needs "
                      f"{duration(cores)} of them per iteration, longer than the pipeline")
    if used := plan.get("devices_used"):
        total = plan["cluster"]["nodes"] * plan["cluster"]["devices_per_node"]
        tables = "concurrency and alone tables" if plan["cluster"].get(
            "calibration", {}).get("alone") else "concurrency table"
        console.print(f"  runs on {used} of the cluster's {total} devices, the rest idle: "
                      f"they share a host, and with fewer working each is faster (the "
                      f"calibration's {tables})")
    for what in ("pipelining", "microbatching"):
        if reason := (plan.get(what) or {}).get("refused"):
            console.print(f"  [bold]{what} refused[/]: {reason}")
    loops = plan.get("layer_loops") or {}
    for loop in loops.get("loops", []):
        if loops.get("per_stage"):
            console.print(f"  layer loop cut into one loop per stage (stacked arrays cut per "
                          f"stage): {loop}")
        else:
            console.print(f"  layer loop unrolled (stacked arrays cut per layer): {loop}"
                          + (f"; {loops['why']}" if loops.get("why") else ""))
    if len(plan["stages"]) > 1:
        _pipeline_picture(plan, console)
    updates = {r["stage"]: r for r in plan.get("reduce_scatter") or []}
    for stage in plan["stages"]:
        render_stage(stage, plan_dir, console, pattern, limit, updates.get(stage["index"]))


def _pipeline_picture(plan: dict, console: Console) -> None:
    """The schedule as a timeline: a row per stage, a cell per task (F/B and the microbatch),
    in unit ticks; the real lengths are the stage times printed next to each row."""
    from alpac.plan.schedule import timeline
    program = plan.get("program", {})
    kind = program.get("schedule", "1f1b")
    S, B = len(plan["stages"]), plan["num_micro_batches"]
    shown = min(B, 12)
    backward = any(m.get("role") == Role.BACKWARD for m in program.get("modules", []))
    ticks = timeline(S, shown, kind, backward)
    est = plan.get("estimate", {})
    console.print(f"pipeline ({kind}, {B} microbatches"
                  + (f", first {shown} shown" if shown < B else "")
                  + f"; bubble {est.get('bubble_fraction', 0):.1%}, "
                  f"{si(est.get('bytes_between_meshes', 0))}B between meshes per step):")
    for s, stage in enumerate(plan["stages"]):
        cells = []
        for row in ticks:
            task = row[s]
            if task is None:
                cells.append("[dim]·[/]")
            else:
                what, m = task
                color = "cyan" if what == Role.FORWARD else "magenta"
                cells.append(f"[{color}]{'FB'[what == Role.BACKWARD]}{m % 10}[/]")
        console.print(f"  stage {s} │" + "".join(c if "·" not in c else c + " "
                                               for c in cells)
                      + f"│ {duration(stage['estimate']['time_per_microbatch_s'])}/mb")


def _weight_update(entry: dict, console: Console) -> None:
    """What the reduce-scatter rewrite did to this stage's weight update."""
    if not entry.get("rewritten"):
        console.print("weight update: not rewritten"
                      + ("" if entry["optimizer_state_params"] else " (no optimizer state)"))
        return
    verb = "rewritten" if entry["applied"] else \
        "as the ILP chose it" if entry.get("already_split") == len(entry["rewritten"]) else \
        "not rewritten (slower)"
    console.print(f"weight update {verb} (zero={entry['zero']}): {len(entry['rewritten'])} of "
                  f"{entry['optimizer_state_params']} optimizer-state parameters split "
                  f"({entry.get('already_split', 0)} before)"
                  + (f"; time {duration(entry['time_before_s'])} -> "
                     f"{duration(entry['time_after_s'])}, peak "
                     f"{si(entry['peak_memory_before_bytes'])}B -> "
                     f"{si(entry['peak_memory_after_bytes'])}B per device"
                     if "time_after_s" in entry else "")
                  + (f"; gradients accumulated {entry['accumulation']}"
                     if entry["accumulation"] != "none" else ""))
    names = entry["rewritten"]
    more = f", and {len(names) - 6} more (explain --json lists all)" if len(names) > 6 else ""
    console.print("  split: " + ", ".join(names[:6]) + more, overflow="fold")


def render_stage(stage: dict, plan_dir: Path, console: Console, pattern: str | None,
                 limit: int, update: dict | None = None) -> None:
    mesh = stage["mesh"]
    ilp = stage["ilp"]
    e = stage["estimate"]
    layers = stage["layers"]
    console.rule(f"stage {stage['index']}" + (f": layers {layers[0]}–{layers[1]}"
                                               if layers else ""))
    console.print(f"mesh {'x'.join(map(str, mesh['logical_shape']))} over devices "
                  f"{_ranges(mesh['devices'])}"
                  + (" — weights and optimizer state stored split (ZeRO-3: the model would "
                     "not fit otherwise)" if stage.get("weights_stored_split") else ""))
    _mesh_map(mesh, console)
    console.print(f"time {duration(e['time_s'])} (compute {duration(e['compute_s'])}, "
                  f"communication {duration(e['communication_s'])}), peak memory "
                  f"{si(e['peak_memory_bytes'])}B per device")
    if stage.get("loop_iterations"):
        console.print(f"holds iterations {_ranges(stage['loop_iterations'])} of the layer "
                      f"loops (their rows of the stacked weights and optimizer state)")
    if stage.get("remat"):
        console.print(_remat_line(stage["remat"], e))
    solve = ilp.get("solve_time_s")
    before, after = ilp["graph_before_reduction"], ilp["graph_after_reduction"]
    console.print(f"ILP: {ilp['status']}, gap {ilp['gap']:.2%}, "
                  + (f"solved in {solve:.2f} s, " if solve is not None else "")
                  + f"{before['nodes']} nodes / {before['strategies']} strategies / "
                  f"{before['edges']} edges, after reduction {after['nodes']} / "
                  f"{after['strategies']} / {after['edges']}"
                  + (" (solved axis by axis)" if len(ilp["rounds"]) > 1 else ""))
    if stage["collectives"]:
        table = Table(title="predicted collectives", show_edge=False, title_justify="left")
        for col in ("kind", "count", "bytes", "seconds"):
            table.add_column(col, justify="left" if col == "kind" else "right")
        for kind, c in stage["collectives"].items():
            table.add_row(kind, str(c["count"]), f"{si(c['bytes'])}B", duration(c["seconds"]))
        console.print(table)
    if update is not None:
        _weight_update(update, console)
    rows = decisions(plan_dir, stage)
    if pattern:
        rx = re.compile(pattern)
        rows = [r for r in rows if rx.search(r["instruction"]) or rx.search(r["opcode"])]
    else:  # the decisions that matter most: sources of work and of communication
        rows = [r for r in rows if r["opcode"] in ("dot", "convolution", "parameter", "gather",
                                                   "scatter", "reduce") or r["collectives"]]
    table = Table(title=f"shardings ({len(rows)} shown of those matching; axes 0.."
                        f"{len(mesh['logical_shape']) - 1}, R = replicated)",
                  show_edge=False, title_justify="left")
    for col in ("instruction", "opcode", "shape", "sharding", "strategy", "collectives"):
        table.add_column(col)
    for r in rows[:limit]:
        colls = ", ".join(f"{c['kind']} {si(c['bytes'])}B" for c in r["collectives"])
        table.add_row(r["instruction"], r["opcode"], r["shape"], r["sharding"], r["strategy"],
                      colls)
    if len(rows) > limit:
        table.add_row(f"… {len(rows) - limit} more (--limit, --filter)", "", "", "", "", "")
    console.print(table)


def _remat_line(remat: dict[str, str], e: dict) -> str:
    """Which layers recompute how, and what a microbatch in flight then keeps."""
    by_mode: dict[str, list[int]] = {}
    for layer, mode in remat.items():
        by_mode.setdefault(mode, []).append(int(layer))
    parts = [f"{mode} (layers {_ranges(sorted(layers))})" for mode, layers in by_mode.items()]
    kept = e.get("activation_bytes_per_microbatch")
    return ("recomputation in the backward: " + "; ".join(parts)
            + (f" — keeps {si(kept)}B per microbatch, {e['microbatches_in_flight']} in flight"
               if kept is not None else ""))


def _mesh_map(mesh: dict, console: Console) -> None:
    """The logical mesh as a grid of device ids (the last axis across)."""
    shape = mesh["logical_shape"]
    devices = mesh["devices"]
    if len(shape) == 1:
        shape = [1, shape[0]]
    cols = shape[-1]
    rows = len(devices) // cols
    width = max(len(str(d)) for d in devices) + 2
    for r in range(rows):
        cells = "".join(f"[on grey23]{str(d).center(width)}[/] "
                        for d in devices[r * cols:(r + 1) * cols])
        console.print("  " + cells)


def _ranges(ids: list[int]) -> str:
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}–{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids))


def verify(plan: dict, plan_dir: Path, console: Console) -> bool:
    """Compile every stage module with XLA on virtual CPU devices and compare the collectives
    XLA inserted with the prediction. True when they agree."""
    from alpac.plan.verify import compiled_collectives
    from alpac.xla.bridge import compile_hlo, cpu_devices, ensure_host_device_count

    need = max(len(s["mesh"]["devices"]) for s in plan["stages"])
    ensure_host_device_count(need)
    ok = True
    for stage in plan["stages"]:
        text = read_plan_text(plan_dir, stage["module"], "module file")
        try:
            exe = compile_hlo(text, cpu_devices(len(stage["mesh"]["devices"])))
        except ValueError as e:  # XLA refused the module: the check fails, naming why
            console.print(f"[red]stage {stage['index']} ({stage['module']}): {e}")
            ok = False
            continue
        actual = compiled_collectives(exe.compiled_text())
        predicted = {k: {"count": v["count"], "bytes": v["bytes"]}
                     for k, v in stage["collectives"].items()}
        table = Table(title=f"stage {stage['index']}: predicted vs XLA", show_edge=False,
                      title_justify="left")
        for col in ("kind", "predicted count", "XLA count", "predicted bytes", "XLA bytes", ""):
            table.add_column(col, justify="left" if col == "kind" else "right")
        for kind in sorted(set(actual) | set(predicted)):
            p = predicted.get(kind, {"count": 0, "bytes": 0})
            a = actual.get(kind, {"count": 0, "bytes": 0})
            same = p == a
            ok &= same
            table.add_row(kind, str(p["count"]), str(a["count"]), str(p["bytes"]),
                          str(a["bytes"]), "[green]same" if same else "[red]DIFFERS")
        console.print(table)
        xla_peak = exe.peak_bytes()
        est = stage["estimate"]["peak_memory_bytes"]
        console.print(f"peak memory per device: estimated {si(est)}B, XLA "
                      f"{si(xla_peak)}B (arguments + outputs - aliased + temporaries)")
    return ok
