"""The reduce-scatter rewrite on the Alpa GPT suite: the same plan with and without it, on one
p3.16xlarge node (8 V100s) as a data-parallel mesh and as the ILP's own 2x4 plan. Estimated
iteration time must not rise and peak memory per device must fall.

Full width, reduced depth (`--layers`, default 2): the rewrite acts per layer, so the figures
per layer are those of the full model; full depth only makes the ILP bigger.

    python benchmarks/bench_zero.py [--models 350M,1.3B] [--layers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from common import ROOT, compile_plan, write_results

from alpac.plan.cluster import load_cluster
from testdata.generate import gpt_suite_hlo


def plan(model: Path, cluster, mesh: str, strategy: str, rewrite: bool, out: Path) -> dict:
    options = {"stage-construction": {"mesh": mesh}, "reduce-scatter": {"zero": "auto"}}
    if strategy:
        options["stage-construction"]["strategy"] = strategy
    return compile_plan(model, cluster, out, options, () if rewrite else ("reduce-scatter",))[0]


def _holds(report, t0, t1, m0, m1) -> str:
    if t1 > t0 * (1 + 1e-6):
        return "NO (slower)"
    if m1 < m0:
        return "yes"
    if report.get("already_split", 0) == len(report.get("rewritten", [])):
        return "yes (the ILP had split it already)"
    return "NO (no memory saved)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="350M,1.3B,2.6B")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    p3 = load_cluster(ROOT / "testdata" / "clusters" / "aws-p3.16xlarge-x8.yaml")
    node = dataclasses.replace(p3, name=p3.name + " (one node)", nodes=1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = Path(tmp) / f"gpt-{name}.hlo"
            model.write_text(gpt_suite_hlo(name, batch_size=16, num_layers=args.layers))
            for mesh, strategy in (("8", "data-parallel"), ("2x4", "")):
                out = {}
                for rewrite in (False, True):
                    out[rewrite] = plan(model, node, mesh, strategy, rewrite,
                                        Path(tmp) / f"{name}-{mesh}-{rewrite}")
                before, after = out[False]["estimate"], out[True]["estimate"]
                report = out[True]["reduce_scatter"][0]
                t0, t1 = before["iteration_time_s"], after["iteration_time_s"]
                m0, m1 = before["peak_memory_bytes"], after["peak_memory_bytes"]
                rows.append({
                    "model": f"GPT-{name} ({args.layers} layers)",
                    "plan": f"mesh {mesh}" + (f", {strategy}" if strategy else ", ILP"),
                    "iteration ms without": f"{t0 * 1e3:.2f}",
                    "with rewrite": f"{t1 * 1e3:.2f}",
                    "time ratio": f"{t1 / t0:.4f}",
                    "peak GB without": f"{m0 / 1e9:.3f}", "with rewrite ": f"{m1 / 1e9:.3f}",
                    "memory ratio": f"{m1 / m0:.3f}",
                    "optimizer state split (before -> after)":
                        f"{report.get('already_split', 0)} -> "
                        f"{len(report.get('rewritten', []))} of "
                        f"{report['optimizer_state_params']}",
                    "holds": _holds(report, t0, t1, m0, m1),
                })
                print(rows[-1], flush=True)
    write_results("zero", "Reduce-scatter rewrite on the GPT suite (one p3.16xlarge node)",
                  rows, "Estimates by alpac's cost model; batch 16 x 1024 tokens, f16 compute "
                  "with f32 master weights and Adam state. 'holds': time not higher, peak "
                  "memory lower (or nothing left to split).")


if __name__ == "__main__":
    main()
