"""Plan quality and compile time of the whole compile on the Alpa GPT suite.

Plan quality: on the paper's p3.16xlarge cluster (V100-16GB, NVLink in a node, 25 Gbit/s
between nodes) with 8, 16, 32 and 64 devices, the automatic plan's estimated iteration time
against the best Megatron-style grid plan: every dp x tp x pp with tp inside a node and pp
dividing the layers, each with the best microbatch count, priced by the same model
(`--strategy megatron:dp=..,tp=..,pp=..`). Grid plans that do not fit are skipped. The ratio
auto / best grid must be <= 1.

Compile time: the whole compile (every pass, every ILP) of each automatic plan, with the time
per pass and the number of layer ILPs.

    python benchmarks/bench_plan.py [--cases 1.3B@8,2.6B@16] [--layers N] [--batch 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from common import ROOT, write_results

from alpac.cluster import load_cluster
from alpac.compiler import build_pipeline, compile_model
from alpac.errors import UserError
from testdata.generate import gpt_suite_config, gpt_suite_hlo

CASES = "1.3B@8,2.6B@16,6.7B@32,15B@64"


def compile_once(model: Path, cluster, out: Path, **options) -> tuple[dict, dict, float]:
    pipeline = build_pipeline(None, (), {"stage-construction": {k: str(v) for k, v in
                                                                 options.items()}})
    start = time.perf_counter()
    compile_model(model, cluster, pipeline, out)
    seconds = time.perf_counter() - start
    return (json.loads((out / "plan.json").read_text()),
            json.loads((out / "compile-stats.json").read_text()), seconds)


def megatron_grid(devices: int, per_node: int, layers: int):
    for tp in (t for t in (1, 2, 4, 8) if t <= per_node and devices % t == 0):
        for pp in (p for p in range(1, devices // tp + 1) if (devices // tp) % p == 0):
            if layers % pp == 0:
                yield devices // tp // pp, tp, pp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--layers", type=int, default=None, help="reduced depth (default: full)")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    p3 = load_cluster(ROOT / "testdata" / "clusters" / "aws-p3.16xlarge-x8.yaml")
    quality, timing = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            name, devices = case.split("@")
            devices = int(devices)
            cluster = dataclasses.replace(p3, nodes=max(1, devices // p3.devices_per_node),
                                          devices_per_node=min(devices, p3.devices_per_node))
            model = Path(tmp) / f"gpt-{name}.hlo"
            model.write_text(gpt_suite_hlo(name, batch_size=args.batch,
                                           num_layers=args.layers))
            depth = args.layers or gpt_suite_config(name).layers
            label = f"GPT-{name}" + (f" ({depth} layers)" if args.layers else "")
            auto, stats, seconds = compile_once(model, cluster, Path(tmp) / f"{case}-auto")
            t_auto = auto["estimate"]["iteration_time_s"]
            timing.append({
                "model": label, "devices": devices, "compile s": f"{seconds:.1f}",
                "layer ILPs": stats.get("stage_dp", {}).get("layer_ilps", "-"),
                "layers": stats.get("stage_dp", {}).get("layers", "-"),
                **{f"{k} s": f"{v:.1f}" for k, v in stats["pass_seconds"].items() if v >= 0.5},
            })
            print(timing[-1], flush=True)
            best, best_config, tried = None, "-", 0
            grid_layers = stats.get("stage_dp", {}).get("layers", depth)
            for dp, tp, pp in megatron_grid(devices, cluster.devices_per_node, grid_layers):
                strategy = f"megatron:dp={dp},tp={tp},pp={pp}"
                try:
                    plan, _, _ = compile_once(model, cluster, Path(tmp) / f"{case}-{dp}-{tp}-{pp}",
                                              strategy=strategy, layers=grid_layers)
                except UserError as e:  # does not fit
                    print(f"  {strategy}: {e}", flush=True)
                    continue
                tried += 1
                t = plan["estimate"]["iteration_time_s"]
                print(f"  {strategy} B={plan['num_micro_batches']}: {t * 1e3:.1f} ms", flush=True)
                if best is None or t < best:
                    best, best_config = t, f"dp={dp} tp={tp} pp={pp} B={plan['num_micro_batches']}"
            stages = auto["stages"]
            quality.append({
                "model": label, "devices": devices, "batch": args.batch,
                "auto plan": f"{len(stages)} stage(s) "
                             + " ".join("x".join(map(str, s["mesh"]["logical_shape"]))
                                        for s in stages) + f", B={auto['num_micro_batches']}",
                "auto ms": f"{t_auto * 1e3:.1f}",
                "best grid plan": best_config, "grid plans that fit": tried,
                "grid ms": f"{best * 1e3:.1f}" if best else "-",
                "auto / grid": f"{t_auto / best:.3f}" if best else "-",
                "auto <= grid": ("yes" if t_auto <= best * (1 + 1e-9) else "NO") if best else "-",
            })
            print(quality[-1], flush=True)
    notes = (f"Estimates by alpac's cost model on the p3.16xlarge cluster spec; batch "
             f"{args.batch} sequences of 1024 tokens, f16 compute, Adam with f32 state.")
    write_results("plan_quality", "Automatic plan vs the best Megatron grid plan", quality, notes)
    write_results("compile_time", "Whole-compile time on the GPT suite", timing,
                  "2-core machine; every pass and every ILP; pass columns >= 0.5 s.")


if __name__ == "__main__":
    main()
