"""Whole-compile time on the Alpa GPT suite: every pass, every ILP, on this machine.

Targets (issue 5): GPT-2.6B on 8x8 devices under 2 minutes, GPT-39B on 64 devices under 10.
Besides those, how the time scales with the depth (GPT-2.6B on 64 devices at 8, 16 and 32
blocks) and with the devices (GPT-2.6B, 32 blocks, on 8, 16, 32 and 64). Each row splits the
time by pass and the stage construction by phase (layer modules, layer ILPs, their
memory-lean variants, the same shardings at a second microbatch count, the stage DP).

    python benchmarks/bench_compile.py [--cases 2.6B@64,39B@64,2.6B@64:8] [--batch 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import compile_plan, p3_cluster, write_results

from alpac.plan.cluster import parse_size
from alpac.errors import UserError
from testdata.generate import gpt_suite_config, gpt_suite_hlo

CASES = "2.6B@64,39B@64,2.6B@64:8,2.6B@64:16,2.6B@8,2.6B@16,2.6B@32"
#: seconds asked for, by (model, devices, blocks, batch)
TARGETS = {("2.6B", 64, 32, 64): 120.0, ("39B", 64, 48, 64): 600.0,
           ("2.6B", 8, 32, 1024): 60.0, ("39B", 64, 48, 1024): 120.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=CASES, help="NAME@DEVICES[:BLOCKS],...")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--memory-budget", help="bytes per device (e.g. 32GiB; default: the "
                        "V100's 16 GiB) -- for a model that does not fit, to time its compile")
    args = parser.parse_args()
    budget = parse_size(args.memory_budget, "--memory-budget") if args.memory_budget else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            name, _, rest = case.partition("@")
            devices, _, blocks = rest.partition(":")
            devices = int(devices)
            blocks = int(blocks) if blocks else gpt_suite_config(name).layers
            model = Path(tmp) / f"gpt-{name}-{blocks}.hlo"
            if not model.exists():
                model.write_text(gpt_suite_hlo(name, batch_size=args.batch, num_layers=blocks))
            start = time.perf_counter()
            try:
                plan, stats, seconds = compile_plan(model, p3_cluster(devices),
                                                    Path(tmp) / f"{case}".replace(":", "-"),
                                                    memory_budget=budget)
            except UserError as e:  # does not fit: how long it took to find out
                rows.append({"model": f"GPT-{name}", "blocks": blocks, "devices": devices,
                             "compile s": f"{time.perf_counter() - start:.1f}",
                             "plan": f"refused: {e}"})
                print(rows[-1], flush=True)
                continue
            dp = stats.get("stage_dp", {})
            phases = dp.get("seconds", {})
            target = TARGETS.get((name, devices, blocks, args.batch))
            passes = stats["pass_seconds"]
            rows.append({
                "model": f"GPT-{name}", "blocks": blocks, "devices": devices,
                "compile s": f"{seconds:.1f}",
                "target s": f"{target:.0f} ({'met' if seconds <= target else 'NOT met'})"
                if target else "-",
                "layers (distinct)": f"{dp.get('layers', '-')} ({dp.get('distinct_layers', '-')})",
                "layer ILPs": dp.get("layer_ilps", "-"),
                "stage-construction s": f"{passes.get('stage-construction', 0):.1f}",
                "of it: layer modules / ILPs / lean / 2nd B / DP s": " / ".join(
                    f"{phases.get(k, 0):.1f}" for k in (
                        "layer modules", "layer ILPs", "memory-lean layer ILPs",
                        "second-point layer ILPs", "stage DP")),
                "intra-op-sharding s": f"{passes.get('intra-op-sharding', 0):.1f}",
                "other passes s": f"{seconds - passes.get('stage-construction', 0) - passes.get('intra-op-sharding', 0):.1f}",
                "plan": f"{len(plan['stages'])} stages, B={plan.get('num_micro_batches', 1)}"
                        + (f", budget {args.memory_budget}" if budget else ""),
            })
            print(rows[-1], flush=True)
    # batch 64 is the first table's; other batches get their own (batch 1024: `bench_suite`'s)
    write_results("compile_time" if args.batch == 64 else f"compile_time_batch{args.batch}",
                  f"Whole-compile time on the GPT suite, batch {args.batch}", rows,
                  f"Batch {args.batch} x 1024 tokens, p3.16xlarge cluster spec, full width; "
                  f"ILP solves on both cores (`--jobs` default).")


if __name__ == "__main__":
    main()
