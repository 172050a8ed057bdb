"""Plan quality on the Alpa GPT suite: the automatic plan against the best Megatron grid plan.

On the paper's p3.16xlarge cluster (V100-16GB, NVLink in a node, 25 Gbit/s between nodes)
with 8, 16, 32 and 64 devices, the automatic plan's estimated iteration time against every
Megatron-style grid plan that fits: dp x tp x pp with tp inside a node and pp dividing the
transformer blocks (one layer per block, equal blocks per stage), each with its best
microbatch count, priced by the same cost model (`--strategy megatron:dp=..,tp=..,pp=..`).
The ratio auto / best grid must be <= 1.

Full width; depth `--layers` blocks (default 8: every grid plan is one more whole compile, so
full depth takes hours on two cores; 0 = the model's own depth).

    python benchmarks/bench_plan.py [--cases 1.3B@8,2.6B@16] [--layers 8] [--batch 64]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import compile_plan, megatron_grid, p3_cluster, write_results

from alpac.errors import UserError
from testdata.generate import gpt_suite_config, gpt_suite_hlo

CASES = "1.3B@8,2.6B@16,6.7B@32,15B@64"


def describe(plan: dict) -> str:
    return (f"{len(plan['stages'])} stage(s) "
            + " ".join("x".join(map(str, s["mesh"]["logical_shape"])) for s in plan["stages"])
            + f", B={plan['num_micro_batches']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--layers", type=int, default=8, help="blocks (0: the full depth)")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            name, devices = case.split("@")
            devices = int(devices)
            cluster = p3_cluster(devices)
            blocks = args.layers or gpt_suite_config(name).layers
            model = Path(tmp) / f"gpt-{name}.hlo"
            model.write_text(gpt_suite_hlo(name, batch_size=args.batch, num_layers=blocks))
            auto, _, seconds = compile_plan(model, cluster, Path(tmp) / f"{case}-auto")
            t_auto = auto["estimate"]["iteration_time_s"]
            print(f"{case} auto: {describe(auto)} {t_auto * 1e3:.1f} ms ({seconds:.0f} s)",
                  flush=True)
            best, best_config, fit, tried = None, "-", 0, 0
            for dp, tp, pp in megatron_grid(devices, cluster.devices_per_node, blocks):
                strategy = f"megatron:dp={dp},tp={tp},pp={pp}"
                tried += 1
                try:
                    plan, _, _ = compile_plan(model, cluster, Path(tmp) / f"{case}-{dp}-{tp}-{pp}",
                                              {"stage-construction": {"strategy": strategy,
                                                                      "layers": blocks}})
                except UserError as e:  # does not fit
                    print(f"  {strategy}: {e}", flush=True)
                    continue
                fit += 1
                t = plan["estimate"]["iteration_time_s"]
                print(f"  {strategy} B={plan['num_micro_batches']}: {t * 1e3:.1f} ms", flush=True)
                if best is None or t < best:
                    best, best_config = t, f"dp={dp} tp={tp} pp={pp} B={plan['num_micro_batches']}"
            rows.append({
                "model": f"GPT-{name} ({blocks} blocks)", "devices": devices,
                "batch": args.batch, "auto plan": describe(auto),
                "auto ms": f"{t_auto * 1e3:.1f}", "best grid plan": best_config,
                "grid plans that fit": f"{fit} of {tried}",
                "grid ms": f"{best * 1e3:.1f}" if best else "-",
                "auto / grid": f"{t_auto / best:.3f}" if best else "-",
                "auto <= grid": ("yes" if t_auto <= best * (1 + 1e-9) else "NO") if best else "-",
            })
            print(rows[-1], flush=True)
    write_results("plan_quality_batch64",
                  "Automatic plan vs the best Megatron grid plan, batch 64, reduced depth", rows,
                  f"Estimates by alpac's cost model on the p3.16xlarge cluster spec; batch "
                  f"{args.batch} sequences of 1024 tokens, f16 compute, Adam with f32 state; "
                  f"full width, reduced depth.")


if __name__ == "__main__":
    main()
