"""Predicted against measured: plans of the testdata training steps under several strategies,
compiled for a calibrated cluster (`alpac calibrate`), run by `alpa-run`, and the estimate
compared with the measured median iteration time (the first iteration excluded), the median
of several launches of each plan interleaved with the other plans' (on a shared 2-core machine
one launch of a plan measured 1.7x another's of the same plan in the same run).

Per plan: the estimate (plan.json `estimate.iteration_time_s`), the measurement, their ratio;
per model: Kendall's tau between the estimated and the measured order of its plans; overall:
the median and the worst |ratio - 1|; per model, the automatic plan's measured time over the
data-parallel and the one-device plan's; per plan, the share of the iteration the host's cores
were busy (its ranks' CPU time over its cores: near 100%, the ranks competed for cores), and
its ranks' CPU over its price, alpa-run's threads and XLA's (`alpac explain --against`);
after the runs, a few tables measured again against the file (`machine_drift`: this machine's
speed moves within an hour, and a calibration is a snapshot of it). The
issue's targets: within 20% in the median, 50% at
worst, tau >= 0.6 per model; the automatic plan no slower than the other two. A plan on fewer
devices than the cluster (one device; an automatic plan that leaves devices idle because
they share the host's cores, per the calibration's concurrency table) runs on fewer ranks.

    python benchmarks/bench_fidelity.py [--cluster testdata/clusters/local-cpu-calibrated-np2.yaml]
        [--ranks 2] [--devices-per-rank 4] [--iters 8] [--rounds 3]
        [--models mlp_train,gpt_train,bert_train] [--output fidelity] [--calibrate]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import combinations
from pathlib import Path

from common import ROOT, write_results

BIN = Path(sys.executable).parent
MODELS = "mlp_train,gpt_train,bert_train"


def strategies(devices: int, per_rank: int) -> dict[str, list[str]]:
    """Strategy name -> `alpac compile` flags, for a cluster of `devices` devices, `per_rank`
    on each rank (Megatron's tensor parallelism inside a rank, data parallelism across)."""
    out = {"automatic": [], "data-parallel": ["--strategy", "data-parallel"],
           "one device": ["--mesh", "1"]}
    if devices >= 4 and per_rank >= 2:
        dp = devices // per_rank
        out[f"megatron dp{dp} tp{per_rank}"] = ["--strategy",
                                                f"megatron:dp={dp},tp={per_rank},pp=1"]
    if devices >= 2:
        out["two stages, B=4"] = ["--layers", "2", "--stages", "0-0,1-1",
                                  "--micro-batches", "4"]
    return out


def compile_plan(model: str, flags: list[str], cluster: Path, plan: Path
                 ) -> tuple[float, int, str]:
    """The plan's estimated seconds per iteration, the devices it uses and a digest of its
    modules (two strategies may come to the same plan)."""
    subprocess.run([str(BIN / "alpac"), "compile", str(ROOT / "testdata" / "models" /
                                                       f"{model}.hlo"), "--cluster",
                    str(cluster), "-o", str(plan), *flags], check=True, capture_output=True)
    planned = json.loads((plan / "plan.json").read_text())
    used = 1 + max(d for s in planned["stages"] for d in s["mesh"]["devices"])
    modules = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(plan.glob("stage*.hlo"))))
    return planned["estimate"]["iteration_time_s"], used, modules.hexdigest()


def calibrate(cluster: Path, ranks: int, k: int) -> float:
    """`alpac calibrate` into `cluster` on `ranks` ranks of `k` devices; its seconds. Done in
    the same run as the measurements: this machine's speed drifts by up to 1.5x within an
    hour, more than the error the benchmark looks for."""
    start = time.perf_counter()
    subprocess.run([str(BIN / "alpac"), "calibrate", "--devices-per-rank", str(k), "-o",
                    str(cluster), "--", "np", str(ranks)], check=True)
    return time.perf_counter() - start


DRIFTED = ("dot.f32", "elementwise", "reduce", "alone.dot", "alone.elementwise", "launch_s",
           "array_s", "free_s", "collectives.inter_node.all-reduce.8",
           "collectives.inter_node.all-gather.8", "send.inter_node")


def machine_drift(cluster: Path, ranks: int, k: int) -> str:
    """How far the machine moved from the cluster file while the plans ran: a few tables
    measured again right after (`alpac calibrate --check --quick`), measured / recorded. On
    this machine two files calibrated 30 minutes apart read dots 1.3x apart."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "drift.json"
        done = subprocess.run([str(BIN / "alpac"), "calibrate", "--check", str(cluster),
                               "--quick", "--report", str(report), "--devices-per-rank",
                               str(k), "--", "np", str(ranks)],
                              capture_output=True, text=True)  # exit 1: a table drifted
        if not report.exists():
            return f"The check after the runs failed ({done.stderr.strip()[-200:]}). "
        found = json.loads(report.read_text())["tables"]
    return ("Measured again after the runs (`alpac calibrate --check --quick`), measured / "
            "recorded: " + ", ".join(f"{t} {found[t]['drift']:.2f}" for t in DRIFTED
                                     if t in found) + ". ")


def run_plan(plan: Path, used: int, ranks: int, k: int, iters: int
             ) -> tuple[float, float, tuple[float, float] | None]:
    """One `alpa-run` of the plan: the median iteration time, the first excluded, the share
    of it the host's cores were busy (its ranks' CPU time over its cores, medians), and the
    ranks' CPU over its price (`cpu_ratios`). A plan on fewer devices than the cluster runs
    on fewer ranks (or one, smaller)."""
    if used < ranks * k:
        k = min(k, used)
        ranks = -(-used // k)
    report = plan.parent / (plan.name + ".report.json")
    subprocess.run([str(BIN / "alpa-run"), str(plan), "--devices-per-rank", str(k), "--iters",
                    str(iters), "--report", str(report), "--quiet", "--", "np", str(ranks)],
                   check=True, cwd=plan.parent, capture_output=True)
    measured = json.loads(report.read_text())
    iteration = statistics.median(measured["iteration_time_s"][1:])
    busy = max(statistics.median(h["cpu_s"][1:]) / h["cores"] for h in measured["hosts"])
    return iteration, busy / iteration, cpu_ratios(plan, measured)


def cpu_ratios(plan: Path, report: dict) -> tuple[float, float] | None:
    """The ranks' CPU per iteration over its price, summed over the groups of ranks `alpac
    explain --against` shows: alpa-run's own threads (the host work), and XLA's (compute;
    collectives' CPU is in it, unpriced). None where the plan prices no CPU."""
    from alpac.plan.against import CPU_PARTS, breakdown
    rows = [r for r in breakdown(json.loads((plan / "plan.json").read_text()), report)
            if CPU_PARTS[0] in r.parts]
    if not rows:
        return None
    sums = [[sum(r.parts[p][i] for r in rows) for i in (0, 1)] for p in CPU_PARTS]
    return tuple(measured / priced if priced > 0 else math.inf for priced, measured in sums)


def _failure(e: subprocess.CalledProcessError) -> str:
    said = (e.stderr or b"").decode(errors="replace").strip().splitlines()
    return f"failed: {said[-1] if said else e.returncode}"


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    pairs = list(combinations(range(len(xs)), 2))
    if not pairs:
        return 1.0
    agree = sum((xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 for i, j in pairs)
    disagree = sum((xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 for i, j in pairs)
    return (agree - disagree) / len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", type=Path,
                        default=ROOT / "testdata" / "clusters" / "local-cpu-calibrated-np2.yaml")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--devices-per-rank", type=int, default=4)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--output", default="fidelity", help="results/<output>.md and .json")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alpa-run launches per plan, every plan once per round")
    parser.add_argument("--calibrate", action="store_true",
                        help="calibrate the cluster file first, with the same ranks")
    args = parser.parse_args()
    calibrated = calibrate(args.cluster, args.ranks, args.devices_per_rank) \
        if args.calibrate else None
    devices = args.ranks * args.devices_per_rank
    plans = [(model, name, flags) for model in args.models.split(",")
             for name, flags in strategies(devices, args.devices_per_rank).items()]
    with tempfile.TemporaryDirectory() as tmp:
        compiled, runs, failed = {}, {}, {}
        for i, (model, name, flags) in enumerate(plans):
            try:
                compiled[i] = compile_plan(model, flags, args.cluster, Path(tmp) / f"plan{i}")
            except subprocess.CalledProcessError as e:
                failed[i] = _failure(e)
        for _ in range(args.rounds):  # interleaved: a slow spell of the machine hits all
            for i, (_, used, _) in compiled.items():
                if i not in failed:
                    try:
                        runs.setdefault(i, []).append(run_plan(
                            Path(tmp) / f"plan{i}", used, args.ranks, args.devices_per_rank,
                            args.iters))
                    except subprocess.CalledProcessError as e:
                        failed[i] = _failure(e)
    drift = machine_drift(args.cluster, args.ranks, args.devices_per_rank)
    rows, taus, automatic = [], {}, []
    for model in args.models.split(","):
        estimates, measured, digests = [], {}, {}
        for i, (m, name, _) in enumerate(plans):
            if m != model:
                continue
            if i in failed:
                rows.append({"model": model, "strategy": name, "devices": "-",
                             "estimate ms": "-", "measured ms": "-", "launches ms": "-",
                             "measured / estimate": failed[i], "cores busy": "-",
                             "CPU / priced: alpa-run, XLA": "-"})
                continue
            est, used, digests[name] = compiled[i]
            got = statistics.median(t for t, _, _ in runs[i])
            cpu = [c for _, _, c in runs[i] if c is not None]
            estimates.append(est)
            measured[name] = got
            rows.append({"model": model, "strategy": name, "devices": str(used),
                         "estimate ms": f"{est * 1e3:.2f}", "measured ms": f"{got * 1e3:.2f}",
                         "launches ms": " ".join(f"{t * 1e3:.2f}" for t, _, _ in runs[i]),
                         "measured / estimate": f"{got / est:.2f}",
                         "cores busy": f"{statistics.median(b for _, b, _ in runs[i]):.0%}",
                         "CPU / priced: alpa-run, XLA": " / ".join(
                             f"{statistics.median(c[j] for c in cpu):.2f}" for j in (0, 1))
                         if cpu else "-"})
            print(rows[-1], flush=True)
        taus[model] = kendall_tau(estimates, list(measured.values()))
        automatic.append(f"{model} " + " / ".join(
            f"{measured['automatic'] / measured[other]:.2f}"
            + (" (the same plan)" if digests[other] == digests["automatic"] else "")
            for other in ("data-parallel", "one device") if other in measured))
    errors = [abs(float(r["measured / estimate"]) - 1) for r in rows if r["estimate ms"] != "-"]
    summary = (f"Cluster file {args.cluster.name}"
               + (f" (calibrated by this run just before, in {calibrated:.0f} s)"
                  if calibrated is not None else "") + f", {args.ranks} ranks x "
               f"{args.devices_per_rank} devices; per plan {args.rounds} launches of alpa-run, "
               f"interleaved with the other plans', {args.iters} iterations each (the first "
               f"excluded): measured is the median of the launches' medians; cores busy: "
               f"the host's ranks' CPU time per iteration over its cores and the iteration; "
               f"CPU / priced: the ranks' CPU per iteration over its price (`alpac explain "
               f"--against`), alpa-run's own threads (host work) and XLA's (compute; "
               f"collectives' CPU unpriced, in it), medians of the launches. "
               f"|measured/estimate - 1|: median "
               f"{statistics.median(errors):.0%}, worst {max(errors):.0%}. Kendall tau per "
               "model: " + ", ".join(f"{m} {t:.2f}" for m, t in taus.items()) + ". "
               "The automatic plan's measured time over the data-parallel / the one-device "
               "plan's: " + ", ".join(automatic) + ". " + drift +
               f"`python benchmarks/bench_fidelity.py --cluster {args.cluster} --ranks "
               f"{args.ranks} --devices-per-rank {args.devices_per_rank} --models "
               f"{args.models} --iters {args.iters} --rounds {args.rounds} --output "
               f"{args.output}{' --calibrate' if calibrated is not None else ''}` (from "
               f"benchmarks/).")
    write_results(args.output, "Predicted against measured iteration time", rows, summary)


if __name__ == "__main__":
    main()
