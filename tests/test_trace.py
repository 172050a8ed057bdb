"""Timelines and predicted against measured: `alpa-run --trace` and `alpac explain --trace`
write trace-event JSON that Perfetto and chrome://tracing load (checked against the format's
rules), `alpac explain --against` compares a run's report with the plan and refuses another
plan's, and the predicted schedule agrees with the plan's one pipeline formula where that
formula is exact.

One two-stage plan of the MLP step (4 microbatches, 1F1B) is compiled and run once per module.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TESTDATA

from alpac.plan.schedule import step_seconds
from alpac.plan.trace import predict

BIN = Path(sys.executable).parent
B = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The compiled plan and its alpa-run report and trace (2 iterations, 2 ranks x 4)."""
    root = tmp_path_factory.mktemp("trace")
    plan = root / "plan"
    subprocess.run([str(BIN / "alpac"), "compile", str(TESTDATA / "models" / "mlp_train.hlo"),
                    "--cluster", str(TESTDATA / "clusters" / "local-cpu.yaml"),
                    "--stages", "0-0,1-1", "--micro-batches", str(B), "-o", str(plan)],
                   check=True, capture_output=True, timeout=300)
    r = subprocess.run([str(BIN / "alpa-run"), str(plan), "--iters", "2", "--devices-per-rank",
                        "4", "--report", str(root / "report.json"), "--trace",
                        str(root / "trace.json"), "--", "np", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "timeline written to" in r.stdout
    return {"root": root, "plan": plan, "report": root / "report.json",
            "trace": root / "trace.json"}


def alpac(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "alpac"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def validate_trace(trace: dict) -> dict[tuple[int, int], list[dict]]:
    """The trace-event rules Perfetto and chrome://tracing rely on; the complete events by
    track."""
    assert set(trace) == {"traceEvents", "displayTimeUnit"} and trace["displayTimeUnit"] == "ms"
    processes, threads, tracks = set(), set(), {}
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and \
            isinstance(e["tid"], int) and isinstance(e["args"], dict), e
        if e["ph"] == "M":
            if e["name"] == "process_name":
                processes.add(e["pid"])
            elif e["name"] == "thread_name":
                threads.add((e["pid"], e["tid"]))
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index"), e
            continue
        assert isinstance(e["cat"], str) and e["cat"], e
        for key in ("ts", "dur"):
            assert isinstance(e[key], (int, float)) and math.isfinite(e[key]), e
        assert e["ts"] >= 0 and e["dur"] >= 0, e
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    assert tracks, "no complete events"
    for (pid, tid), events in tracks.items():
        assert pid in processes and (pid, tid) in threads, (pid, tid)
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)  # one track: no overlap
    json.dumps(trace, allow_nan=False)
    return tracks


def thread_names(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_measured_trace(run):
    trace = json.loads(run["trace"].read_text())
    tracks = validate_trace(trace)
    assert thread_names(trace) == {0: "rank 0 (mesh 0: stage 0)", 1: "rank 1 (mesh 1: stage 1)"}
    for (_, rank), events in tracks.items():
        runs = [e for e in events if e["cat"] in ("forward", "backward", "apply")]
        assert len(runs) == 2 * (2 * B + 1)  # F and B per microbatch and one update, 2 steps
        assert {e["args"]["stage"] for e in runs} == {rank}
        assert sorted(e["name"] for e in runs if e["args"]["iteration"] == 1) == sorted(
            [f"F{m}" for m in range(B)] + [f"B{m}" for m in range(B)] + ["apply"])
        assert {"send", "recv"} <= {e["cat"] for e in events}
    assert any(e["cat"] == "wait" for events in tracks.values() for e in events)
    report = json.loads(run["report"].read_text())
    start = min(e["ts"] for e in tracks[(1, 0)] if e["args"]["iteration"] == 1)
    assert start >= report["iteration_time_s"][0] * 1e6  # iterations one after another
    assert_received_after_sent(tracks)
    modules = {m["name"]: m for m in report["modules"]}
    assert modules["stage1.forward"]["executions_per_step"] == B
    assert modules["stage0.apply"]["executions_per_step"] == 1
    assert all(m["median_s"] > 0 for m in modules.values())


def assert_received_after_sent(tracks: dict) -> None:
    """The ranks' clocks are one time axis: every piece of a transfer comes in (its `recv`
    starts when the data came) after the first of its sends started, on another rank's track."""
    def key(e):
        return e["args"]["value"], e["args"]["microbatch"], e["args"]["iteration"]
    events = [e for track in tracks.values() for e in track]
    sent = {}
    for e in events:
        if e["cat"] == "send":
            sent[key(e)] = min(sent.get(key(e), math.inf), e["ts"])
    received = [e for e in events if e["cat"] == "recv"]
    assert received and all(key(e) in sent for e in received)
    late = [(e["name"], e["ts"] - sent[key(e)]) for e in received if e["ts"] < sent[key(e)]]
    assert not late, late


def test_measured_trace_puts_ranks_on_one_time_axis(run):
    """Two ranks that left the step's barrier 3 ms apart, one on a clock 5 s behind: each
    event lands at the time it happened on rank 0's clock, iterations included."""
    from alpac.plan.program import load_program
    from alpac.runtime.executor import StepStats
    from alpac.runtime.timeline import build
    from alpac.runtime.trace import measured_trace
    _, _, program, where = load_program(run["plan"])
    timeline = build(program, None, where)
    runs = [t.index for t in timeline.tasks if t.kind == "run"]
    steps = [[StepStats(started=s, events=[("run", runs[r], 1e-3, 2e-3)]) for s in starts]
             for r, starts in enumerate([(10.0, 10.020), (5.003, 5.021)])]
    trace = measured_trace("plan", timeline, steps, [0.0, 5.0])
    at = sorted((e["tid"], e["args"]["iteration"], e["ts"]) for e in trace["traceEvents"]
                if e["ph"] == "X")
    assert [(r, k, round(ts)) for r, k, ts in at] == [
        (0, 0, 1000), (0, 1, 21000), (1, 0, 4000), (1, 1, 22000)]


def test_clock_offsets_across_hosts_come_out_near_zero_on_one_host(tmp_path):
    """Ranks that say they are on other hosts estimate their clocks' offsets by ping-pong;
    here they share one clock, so each estimate must be 0 within its round trip."""
    from alpac.runtime.launcher import find_mpiexec
    script = tmp_path / "clocks.py"
    script.write_text(
        "import json, socket, sys\n"
        "from alpac.runtime.comm import Comm\n"
        "from alpac.runtime import worker\n"
        "comm = Comm(60)\n"
        "socket.gethostname = lambda: f'host{comm.rank}'\n"
        "hosts = [host for host, _ in worker.rank_placement(comm)]\n"
        "offsets = worker._clock_offsets(comm, hosts)\n"
        "if comm.rank == 0:\n"
        "    print(json.dumps(offsets))\n")
    r = subprocess.run([find_mpiexec(), "-n", "3", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    offsets = json.loads(r.stdout.strip().splitlines()[-1])
    assert offsets[0] == 0.0 and len(offsets) == 3
    assert all(abs(x) < 2e-3 for x in offsets), offsets


def test_predicted_trace(run):
    out = run["root"] / "predicted.json"
    r = alpac("explain", run["plan"], "--trace", out)
    assert r.returncode == 0, r.stderr
    assert f"predicted timeline written to {out}" in r.stdout.replace("\n", "")
    assert "shardings" not in r.stdout  # only the trace's line
    trace = json.loads(out.read_text())
    tracks = validate_trace(trace)
    assert thread_names(trace) == {0: "stage 0 (mesh 0: devices 0-3)",
                                   1: "stage 1 (mesh 1: devices 4-7)"}
    for events in tracks.values():
        assert sorted(e["name"] for e in events) == sorted(
            [f"F{m}" for m in range(B)] + [f"B{m}" for m in range(B)] + ["apply"])


def test_against_report(run):
    r = alpac("explain", run["plan"], "--against", run["report"])
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("predicted against measured: iteration estimated")
    for row in ("iteration (median)", "stage 0 busy (mesh 0)", "stage 1 busy (mesh 1)",
                "stage0.forward (x4)", "stage1.backward (x4)", "stage1.apply (x1)"):
        assert row in r.stdout, r.stdout
    # local-cpu.yaml has no measured tables: the line says what the estimates are worth
    assert "the plan's cluster has no calibration" in r.stdout.replace("\n", " ")
    assert "where each rank's iteration went" in r.stdout.replace("\n", " ")
    lines = [[c.strip() for c in ln.split("│")] for ln in r.stdout.splitlines()]
    for rank in ("0", "1"):  # rank, "mesh: stage", estimated parts; the measured ones below
        at = next(i for i, ln in enumerate(lines) if ln[0] == rank)
        assert lines[at][1:3] == [f"{rank}: {rank}", "estimated"], r.stdout
        assert lines[at + 1][:3] == ["", "", "measured"], r.stdout


def test_report_says_where_each_rank_s_step_went(run):
    """Per rank and iteration, modules + transfers + waiting + other is the rank's step (none
    negative: the recorded events do not overlap); a two-stage pipeline's ranks spend time in
    each of the first three; explain's estimates: the stage's busy time and receives, the
    rest of the estimated iteration as waiting."""
    from alpac.plan.against import breakdown
    report = json.loads(run["report"].read_text())
    plan = json.loads((run["plan"] / "plan.json").read_text())
    ranks = report["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["meshes"] for r in ranks] == [[0], [1]]
    parts = ("modules_s", "transfers_s", "waiting_s", "other_s")
    for r in ranks:
        assert all(len(r[p]) == report["iterations"] for p in parts)
        assert all(min(r[p]) >= 0 for p in parts), r
        assert all(r["modules_s"]) and all(r["transfers_s"])
    assert any(w > 0 for r in ranks for w in r["waiting_s"])
    # ranks holding the same meshes are one row, each part the median over them
    four = copy.deepcopy(report)
    four["per_rank"] = [{**ranks[r // 2], "rank": r,
                         "waiting_s": [w * (1 + r) for w in ranks[r // 2]["waiting_s"]]}
                        for r in range(4)]
    grouped = breakdown(plan, four)
    assert [(g.ranks, g.stages) for g in grouped] == [("0,1", "0: 0"), ("2,3", "1: 1")]
    waits = [statistics.median(r["waiting_s"][1:]) for r in four["per_rank"]]
    assert grouped[0].parts["waiting"][1] == pytest.approx((waits[0] + waits[1]) / 2)
    rows = breakdown(plan, report)
    estimate = plan["estimate"]["iteration_time_s"]
    for row, stage in zip(rows, plan["stages"]):
        (modules, _), (received, _), (waiting, _), (fed, _) = row.parts.values()
        assert modules > 0 and received > 0 and fed == 0  # local-cpu.yaml: no calibration
        assert math.isclose(modules + received + waiting, estimate, rel_tol=1e-9)


def test_report_says_how_busy_the_host_s_cores_were(run):
    """Each rank's process CPU time per iteration, and per host the ranks' sum and the cores
    they may run on (both ranks here share this machine's); explain --against prints the
    share of the iteration the host's cores needed, and says the cores bound the iteration
    only where they were busy nearly throughout."""
    import os

    from rich.console import Console

    from alpac.plan.against import HostRow, render_hosts
    report = json.loads(run["report"].read_text())
    ranks = report["per_rank"]
    assert all(len(r["cpu_s"]) == report["iterations"] and min(r["cpu_s"]) > 0 for r in ranks)
    for r in ranks:  # alpa-run's own threads (the host work): part of the process's CPU
        assert all(0 < own < cpu for own, cpu in zip(r["own_cpu_s"], r["cpu_s"])), r
    [host] = report["hosts"]
    assert host["ranks"] == [0, 1] and host["cores"] == len(os.sched_getaffinity(0))
    assert host["cpu_s"] == pytest.approx([a + b for a, b in zip(ranks[0]["cpu_s"],
                                                                  ranks[1]["cpu_s"])])
    r = alpac("explain", run["plan"], "--against", run["report"])
    assert f"host {host['host']}: 2 rank(s) on {host['cores']} core(s) used" in \
        r.stdout.replace("\n", " "), r.stdout

    def said(cpu: float) -> str:
        console = Console(width=400, record=True)
        render_hosts([HostRow("h", 4, 2, cpu)], 0.010, console)
        return console.export_text()
    assert "90% of the measured iteration; its cores were busy nearly throughout" in said(0.018)
    assert "50% of the measured iteration\n" in said(0.010)


def test_against_sets_each_rank_s_priced_cpu_beside_its_threads(run):
    """Where the plan prices each rank's CPU (a calibrated file of ranks sharing cores), explain
    --against sets it beside alpa-run's own threads' and the rest of the process's measured
    CPU (the medians, the first iteration excluded); without it, no such table."""
    from rich.console import Console

    from alpac.plan.against import CPU_PARTS, breakdown, render_breakdown
    report = json.loads(run["report"].read_text())
    plan = json.loads((run["plan"] / "plan.json").read_text())
    assert all(CPU_PARTS[0] not in row.parts for row in breakdown(plan, report))
    for i, stage in enumerate(plan["stages"]):
        stage["estimate"]["cpu_per_rank_s"] = {"host": 1e-3 * (i + 1), "compute": 5e-3}
    rows = breakdown(plan, report)
    for row, r in zip(rows, report["per_rank"]):
        own = statistics.median(r["own_cpu_s"][1:])
        rest = statistics.median([c - o for c, o in zip(r["cpu_s"], r["own_cpu_s"])][1:])
        assert row.parts["alpa-run CPU"] == pytest.approx((1e-3 * (r["rank"] + 1), own))
        assert row.parts["XLA CPU"] == pytest.approx((5e-3, rest))
    console = Console(width=200, record=True)
    render_breakdown(rows, console)
    text = console.export_text()
    assert "the CPU time each rank used per iteration" in text and "alpa-run CPU" in text


def test_against_report_of_a_calibrated_plan_says_nothing_of_calibration(run, tmp_path):
    plan_dir = tmp_path / "plan"
    shutil.copytree(run["plan"], plan_dir)
    plan = json.loads((plan_dir / "plan.json").read_text())
    plan["cluster"]["calibration"] = {"source": "a test", "launch_s": 1e-4}
    (plan_dir / "plan.json").write_text(json.dumps(plan))
    r = alpac("explain", plan_dir, "--against", run["report"])
    assert r.returncode == 0, r.stderr
    assert "predicted against measured" in r.stdout and "calibration" not in r.stdout


def test_against_refuses_another_plans_report(run, tmp_path):
    report = json.loads(run["report"].read_text())
    report["program_sha256"] = "0" * 64
    other = tmp_path / "other.json"
    other.write_text(json.dumps(report))
    r = alpac("explain", run["plan"], "--against", other)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "another plan" in lines[0] and "Traceback" not in r.stderr


def _equal_stages(plan: dict, S: int, num_micro_batches: int, kind: str) -> dict:
    """The plan with S stages of equal time per microbatch and different update times."""
    q = copy.deepcopy(plan)
    q["num_micro_batches"], q["program"]["schedule"] = num_micro_batches, kind
    q["stages"] = [{"index": i, "mesh": {"devices": [i]},
                    "estimate": {"time_per_microbatch_s": 3e-4, "apply_s": 1e-4 * (i + 1)}}
                   for i in range(S)]
    q["program"]["modules"] = [{"name": f"s{i}.{role}", "stage": i, "mesh": i, "role": role}
                               for i in range(S) for role in ("forward", "backward", "apply")]
    q["estimate"]["iteration_time_s"] = step_seconds(3e-4 * S, 3e-4, 1e-4 * S,
                                                     num_micro_batches)
    return q


def test_simulation_agrees_with_the_formula(run):
    """With forward and backward splitting a stage's time evenly, the simulated step takes
    what the 1F1B formula says where the formula is exact: the compiled plan (its slowest
    stage last; receiving from the other stage is in both) and stages of equal time (for
    GPipe too)."""
    plan = json.loads((run["plan"] / "plan.json").read_text())
    want = plan["estimate"]["iteration_time_s"]
    assert predict(plan, 0.5).iteration_s == pytest.approx(want, rel=1e-12)
    assert all(s["estimate"]["receive_s"]["per_microbatch"] > 0 for s in plan["stages"])
    for kind in ("1f1b", "gpipe"):
        for S in range(1, 5):
            for mb in (1, 2, 4, 7):
                q = _equal_stages(plan, S, mb, kind)
                got = predict(q, 0.5).iteration_s
                assert got == pytest.approx(q["estimate"]["iteration_time_s"], rel=1e-12)
