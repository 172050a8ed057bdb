"""Plan quality at the real scale: the Alpa GPT suite at batch 1024, sequence 1024, full depth,
f16, Adam, on p3.16xlarge clusters (V100-16GB, `memory_bandwidth: 900GB/s`).

Per case (model @ devices), three plans priced by the same cost model:
  - alpac's automatic plan (`--remat auto`), which must fit 16 GiB by its own estimate;
  - Alpa's published plan (Alpa, OSDI'22, and its benchmark scripts: stages' layer ranges,
    submeshes and microbatch count) with full recomputation, as Alpa runs it; its logical
    meshes are left to alpac (the best for each submesh, so never worse than Alpa's own), and
    no memory limit (its peak is reported);
  - the best Megatron-style grid plan: every dp x tp x pp (tp inside a node, pp dividing the
    blocks, equal blocks per stage), each at its best microbatch count and with the stage
    DP's recomputation (`--remat auto`: at least as good as Megatron's none/selective/full),
    the optimizer state split across the data-parallel group by the reduce-scatter pass
    (Megatron's distributed optimizer) where that is no slower.

Each case's figures go to benchmarks/results/suite/<case>.json as soon as it is done (a long
run can be resumed with --skip-done); the table benchmarks/results/suite.md is made from all
case files.

    python benchmarks/bench_suite.py [--cases 2.6B@8,39B@64] [--no-grid] [--skip-done]
                                     [--grid-only]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import RESULTS, compile_plan, megatron_grid, p3_cluster, write_results

from alpac.errors import UserError
from testdata.generate import gpt_suite_config, gpt_suite_hlo

CASES = "350M@1,760M@2,1.3B@4,2.6B@8,6.7B@16,15B@32,39B@64"
BATCH = 1024
GIB = 2 ** 30

# Alpa's plans: per stage (first block, last block) and submesh (nodes x devices), and B.
ALPA_PLANS = {
    "350M@1": ([(0, 23)], ["1x1"], 512),
    "1.3B@4": ([(0, 11), (12, 23)], ["1x2", "1x2"], 128),
    "2.6B@8": ([(0, 7), (8, 15), (16, 31)], ["1x2", "1x2", "1x4"], 128),
    "6.7B@16": ([(0, 15), (16, 31)], ["1x8", "1x8"], 64),
    "15B@32": ([(12 * k, 12 * k + 11) for k in range(4)], ["1x8"] * 4, 128),
    "39B@64": ([(3 * k, 3 * k + 2) for k in range(16)], ["1x4"] * 16, 1024),
}


def describe(plan: dict) -> str:
    stages = plan["stages"]
    remat = {}
    for s in stages:
        for mode in (s.get("remat") or {}).values():
            remat[mode] = remat.get(mode, 0) + 1
    return (f"{len(stages)} stage(s) "
            + " ".join("x".join(map(str, s["mesh"]["logical_shape"])) for s in stages)
            + f", B={plan['num_micro_batches']}"
            + (", remat " + " ".join(f"{m}:{n}" for m, n in sorted(remat.items()))
               if remat else ""))


def figures(plan: dict, seconds: float) -> dict:
    return {"plan": describe(plan), "iteration_s": plan["estimate"]["iteration_time_s"],
            "peak_gib": plan["estimate"]["peak_memory_bytes"] / GIB, "compile_s": seconds}


def model_of(case: str, tmp: Path) -> tuple[Path, object, int]:
    """The case's step (written to tmp), cluster and number of blocks."""
    name, devices = case.split("@")
    model = tmp / f"gpt-{name}.hlo"
    model.write_text(gpt_suite_hlo(name, batch_size=BATCH))
    return model, p3_cluster(int(devices)), gpt_suite_config(name).layers


def run_case(case: str, tmp: Path, grid: bool) -> dict:
    model, cluster, blocks = model_of(case, tmp)
    out = {"case": case, "devices": cluster.num_devices, "blocks": blocks}
    plan, _, seconds = compile_plan(model, cluster, tmp / f"{case}-auto")
    out["auto"] = figures(plan, seconds)
    print(f"{case} auto: {out['auto']}", flush=True)
    if case in ALPA_PLANS:
        ranges, meshes, B = ALPA_PLANS[case]
        options = {"layers": blocks, "stages": ",".join(f"{a}-{b}" for a, b in ranges),
                   "stage_meshes": ",".join(meshes), "micro_batches": B, "remat": "full"}
        plan, _, seconds = compile_plan(model, cluster, tmp / f"{case}-alpa",
                                        {"stage-construction": options},
                                        memory_budget=1024 * GIB)
        out["alpa_full_remat"] = figures(plan, seconds)
        print(f"{case} Alpa's plan: {out['alpa_full_remat']}", flush=True)
    if grid:
        out["grid"] = best_grid(model, cluster, blocks, tmp / case)
    return out


def best_grid(model: Path, cluster, blocks: int, tmp: Path) -> dict:
    best, tried, fit = None, 0, 0
    for dp, tp, pp in megatron_grid(cluster.num_devices, cluster.devices_per_node, blocks):
        strategy = f"megatron:dp={dp},tp={tp},pp={pp}" + (",distopt=1" if dp > 1 else "")
        tried += 1
        try:
            plan, _, seconds = compile_plan(model, cluster, tmp / f"{dp}-{tp}-{pp}", {
                "stage-construction": {"strategy": strategy, "layers": blocks}})
        except UserError as e:  # does not fit
            print(f"  {strategy}: {e}", flush=True)
            continue
        fit += 1
        f = {**figures(plan, seconds), "strategy": strategy}
        print(f"  {strategy}: {f}", flush=True)
        if best is None or f["iteration_s"] < best["iteration_s"]:
            best = f
    return {"best": best, "tried": tried, "fit": fit}


def grid_table(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        auto, grid = r["auto"], r.get("grid")
        best = (grid or {}).get("best")
        rows.append({
            "case": f"GPT-{r['case']}", "auto plan": auto["plan"],
            "auto s": f"{auto['iteration_s']:.2f}",
            "best grid plan": f"{best['strategy']}: {best['plan']}" if best else "-",
            "grid plans that fit": f"{grid['fit']} of {grid['tried']}" if grid else "not run",
            "grid s": f"{best['iteration_s']:.2f}" if best else "-",
            "auto / grid": f"{auto['iteration_s'] / best['iteration_s']:.3f}" if best else "-",
            "auto <= grid": ("yes" if auto["iteration_s"] <= best["iteration_s"] * (1 + 1e-9)
                             else "NO") if best else "-",
        })
    return rows


def table(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        auto, alpa = r["auto"], r.get("alpa_full_remat")
        grid = (r.get("grid") or {}).get("best")
        rows.append({
            "case": f"GPT-{r['case']}", "auto plan": auto["plan"],
            "auto s": f"{auto['iteration_s']:.2f}", "auto peak GiB": f"{auto['peak_gib']:.1f}",
            "fits 16 GiB": "yes" if auto["peak_gib"] <= 16 else "NO",
            "Alpa's plan + full remat s": f"{alpa['iteration_s']:.2f}" if alpa else "-",
            "auto / Alpa": f"{auto['iteration_s'] / alpa['iteration_s']:.3f}" if alpa else "-",
            "best grid": (f"{grid['strategy']}: {grid['plan']}" if grid else
                          "not run" if "grid" not in r else "none fits"),
            "grid s": f"{grid['iteration_s']:.2f}" if grid else "-",
            "auto / grid": f"{auto['iteration_s'] / grid['iteration_s']:.3f}" if grid else "-",
            "compile s (auto)": f"{auto['compile_s']:.0f}",
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--no-grid", action="store_true", help="skip the Megatron grid")
    parser.add_argument("--skip-done", action="store_true", help="keep cases already written")
    parser.add_argument("--grid-only", action="store_true",
                        help="keep the automatic and Alpa figures already written; add the grid")
    args = parser.parse_args()
    done = RESULTS / "suite"
    done.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            path = done / f"{case}.json"
            if args.skip_done and path.exists():
                continue
            if args.grid_only:
                result = json.loads(path.read_text())
                result["grid"] = best_grid(*model_of(case, Path(tmp)), Path(tmp) / case)
            else:
                result = run_case(case, Path(tmp), not args.no_grid)
            path.write_text(json.dumps(result, indent=1) + "\n")
    order = CASES.split(",")
    results = sorted((json.loads(p.read_text()) for p in done.glob("*.json")),
                     key=lambda r: order.index(r["case"]) if r["case"] in order else 99)
    write_results("plan_quality", "Automatic plan vs the best Megatron grid plan, GPT suite at "
                  "batch 1024", grid_table(results),
                  "Estimates by alpac's cost model on p3.16xlarge clusters; batch 1024 x 1024 "
                  "tokens, f16, Adam with f32 state, full depth. Grid plans: every dp x tp x pp "
                  "(tp inside a node, pp dividing the blocks), each with the distributed "
                  "optimizer where dp > 1 and the stage DP's per-layer recomputation, at its best "
                  "microbatch count. From `python benchmarks/bench_suite.py` (figures in "
                  "`suite/`); the batch-64 table is `plan_quality_batch64.md`.")
    write_results("suite", "The GPT suite at batch 1024: automatic plan vs Alpa's and the grid",
                  table(results),
                  "Estimates by alpac's cost model on p3.16xlarge clusters (V100-16GB, NVLink, "
                  "25 Gbit/s between nodes, 900 GB/s HBM); batch 1024 x 1024 tokens, f16, Adam "
                  "with f32 state, full depth. `python benchmarks/bench_suite.py`.")


if __name__ == "__main__":
    main()
