"""Predicted against measured on a GPU: the plans `gpu_check.sh` ran on one NVIDIA H200 and on
one H100 (alpa-run reports in benchmarks/results/gpu_h200/ and gpu_h100/), priced here for the
calibrated file each run measured (testdata/clusters/h200-calibrated.yaml, h100-calibrated.yaml).
Compiling is deterministic and needs no GPU, so the estimates follow the cost model as it is
now while the measurements stay those of the run.

    python benchmarks/bench_gpu_fidelity.py --gpu h100   # the table, from the committed reports
    python benchmarks/bench_gpu_fidelity.py --run OUT    # on the GPU: compile, alpa-run each case
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, write_results

# the GPUs measured: name, calibrated file, the run's reports (with gpu_check.sh's rounding.json)
GPUS = {"h200": ("H200", ROOT / "testdata" / "clusters" / "h200-calibrated.yaml",
                 ROOT / "benchmarks" / "results" / "gpu_h200"),
        "h100": ("H100", ROOT / "testdata" / "clusters" / "h100-calibrated.yaml",
                 ROOT / "benchmarks" / "results" / "gpu_h100")}
# case -> (model, ranks sharing the GPU, `alpac compile` flags)
CASES = {
    "mlp_train": ("mlp_train", 1, []),
    "gpt_train": ("gpt_train", 1, []),
    "bert_train": ("bert_train", 1, []),
    "moe_train": ("moe_train", 1, []),
    "wresnet_train": ("wresnet_train", 1, []),
    "gpt_train_mb4": ("gpt_train", 1, ["--micro-batches", "4"]),
    "gpt_train_pp2": ("gpt_train", 2, ["--strategy", "megatron:dp=1,tp=1,pp=2",
                                       "--micro-batches", "4"]),
}


def cluster_for(cluster: Path, ranks: int, tmp: Path) -> Path:
    """The calibrated one-GPU file, or the same device on `ranks` nodes (MPI between two
    ranks of one host: the intra-node figures stand for the link)."""
    if ranks == 1:
        return cluster
    import yaml
    c = yaml.safe_load(cluster.read_text())
    c.update(name=f"{c['name']}-{ranks}-ranks", nodes=ranks)
    c["links"]["inter_node"] = c["links"]["intra_node"]
    path = tmp / f"ranks{ranks}.yaml"
    path.write_text(yaml.safe_dump(c, sort_keys=False))
    return path


def compile_case(alpac: list[str], case: str, cluster: Path, tmp: Path) -> Path:
    model, ranks, flags = CASES[case]
    plan = tmp / "plans" / case
    subprocess.run([*alpac, "compile", str(ROOT / "testdata" / "models" / f"{model}.hlo"),
                    "--cluster", str(cluster_for(cluster, ranks, tmp)), "-o", str(plan),
                    *flags], check=True, capture_output=True)
    return plan


def row(case: str, plan: Path, report: dict, floors: dict) -> dict:
    planned = json.loads((plan / "plan.json").read_text())
    estimate = planned["estimate"]["iteration_time_s"]
    measured = statistics.median(report["iteration_time_s"][1:])
    busy = max(statistics.median(m["busy_s"][1:]) for m in report["stages"])
    stage_estimate = max(s["estimate"]["time_s"] for s in planned["stages"])
    check = report.get("check") or {}
    return {"case": case, "estimate_s": estimate, "measured_s": measured,
            "ratio": measured / estimate, "busiest_stage_estimate_s": stage_estimate,
            "busiest_mesh_busy_s": busy, "busy_ratio": busy / stage_estimate,
            "max_rel_error": max((check.get("max_rel_error") or {0: 0.0}).values()),
            "check_passed": check.get("passed"),
            "rounding_floor": floors.get((CASES[case][0], len(report["iteration_time_s"])))}


def shown(r: dict) -> dict:
    """A row as the results table shows it (milliseconds, two decimals)."""
    return {"plan": r["case"], "estimate ms": round(r["estimate_s"] * 1e3, 2),
            "measured ms": round(r["measured_s"] * 1e3, 2),
            "measured / estimate": round(r["ratio"], 2),
            "busiest stage: estimate ms": round(r["busiest_stage_estimate_s"] * 1e3, 2),
            "its mesh busy ms": round(r["busiest_mesh_busy_s"] * 1e3, 2),
            "busy / estimate": round(r["busy_ratio"], 2),
            "check": f"{'passed' if r['check_passed'] else 'FAILED'} "
                     f"({r['max_rel_error']:.2g})",
            "rounding floor": "-" if r["rounding_floor"] is None
            else f"{r['rounding_floor']:.2g}"}


def run_cases(out: Path, cluster: Path, platform: str, mpiexec: str | None,
              iters: int) -> None:
    """Each case compiled, run by alpa-run --check --report --trace (two ranks share GPU 0),
    and its estimates set beside the run by alpac explain --against."""
    import os
    alpac = [sys.executable, "-m", "alpac.cli"]
    run = [sys.executable, "-m", "alpac.runtime.launcher"] + \
        (["--mpiexec", mpiexec] if mpiexec else [])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    out.mkdir(parents=True, exist_ok=True)
    for case, (model, ranks, flags) in CASES.items():
        print(f"-- {case}: {model}, {ranks} rank(s), {' '.join(flags)}", flush=True)
        plan = compile_case(alpac, case, cluster, out)
        report = out / f"{case}.report.json"
        done = subprocess.run([*run, str(plan), "--platform", platform, "--check", "--iters",
                               str(iters), "--report", str(report), "--trace",
                               str(out / f"{case}.trace.json"), "--", "np", str(ranks)],
                              env=env, capture_output=True, text=True)
        print("\n".join((done.stdout + done.stderr).splitlines()[-14:]))
        print(f"alpa-run exit {done.returncode}", flush=True)
        if report.exists():
            subprocess.run([*alpac, "explain", str(plan), "--against", str(report)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, metavar="OUT",
                    help="run every case on this machine's devices, reports into OUT")
    ap.add_argument("--cluster", type=Path, default=GPUS["h100"][1],
                    help="the calibrated file (with --run)")
    ap.add_argument("--platform", default="gpu", help="alpa-run --platform (with --run)")
    ap.add_argument("--mpiexec", help="alpa-run --mpiexec (with --run)")
    ap.add_argument("--iters", type=int, default=6, help="alpa-run --iters (with --run)")
    ap.add_argument("--gpu", choices=GPUS, default="h100", help="whose committed run to price")
    args = ap.parse_args()
    if args.run:
        run_cases(args.run, args.cluster, args.platform, args.mpiexec, args.iters)
        return
    price(args.gpu)


def price(gpu: str) -> None:
    """The committed run of one GPU against the estimates of today's cost model."""
    name, cluster, reports = GPUS[gpu]
    rounding = reports / "rounding.json"
    floors = {(r["module"], r["iterations"]): r["max_rel_error"]
              for r in (json.loads(rounding.read_text()) if rounding.exists() else [])}
    rows = []
    alpac = [sys.executable, "-m", "alpac.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            report = reports / f"{case}.report.json"
            if report.exists():
                plan = compile_case(alpac, case, cluster, Path(tmp))
                rows.append(row(case, plan, json.loads(report.read_text()), floors))
    errors = [abs(r["ratio"] - 1) for r in rows]
    busy = [abs(r["busy_ratio"] - 1) for r in rows]
    iters = len(json.loads(next(reports.glob("*.report.json")).read_text())["iteration_time_s"])
    notes = (f"{len(rows)} plans measured on one NVIDIA {name} (`benchmarks/gpu_check.sh`, "
             f"alpa-run, {iters} iterations, the first excluded), priced for "
             f"`{cluster.relative_to(ROOT)}` by the cost model as it is now. "
             f"|measured/estimate - 1| of the iteration: median {statistics.median(errors):.0%}, "
             f"worst {max(errors):.0%}; of the busiest stage's busy time: median "
             f"{statistics.median(busy):.0%}, worst {max(busy):.0%}. The check's error is "
             "against the original module on the GPU; the rounding floor is what that module "
             "on the GPU and on the CPU differ by after as many steps (`gpu_rounding.py`; "
             "alpa-run's --check now passes an error within it). "
             f"`cd benchmarks && PYTHONPATH=.. python bench_gpu_fidelity.py --gpu {gpu}`.")
    write_results(f"gpu_fidelity_{gpu}",
                  f"Predicted against measured on an {name}", [shown(r) for r in rows], notes)


if __name__ == "__main__":
    main()
