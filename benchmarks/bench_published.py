"""Published production runs priced by alpac: Megatron-LM's SC21 Table 1 (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21) on
Selene, and Alpa's GPT-2.6B regression run.

Per row: a GPT training step of the row's shape (`testdata/generate.py`'s `gpt_train_hlo`:
pre-LN, tied embedding, bf16 compute, f32 Adam state, seq 2048, vocab 51200), Selene as
`testdata/clusters/selene.yaml` describes it (datasheet peaks times published efficiency
figures, nothing fitted to these rows) cut to the row's GPUs, and Megatron's plan as
`--strategy megatron:dp=D,tp=T,pp=P --micro-batches B/(D·mbs) --remat full --layers L` (L the
transformer blocks: P stages of L/P blocks each; micro-batch sizes from Megatron-LM's
`examples/sc21/run_table_1.sh`). Reported: accepted or the refusal, the
estimated peak per device, the estimated iteration, TF/s per GPU by Megatron's formula
F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) over (iteration × GPUs), the measured TF/s and the
ratio predicted / measured iteration time; with the compile's wall time and peak
RSS.

Then alpac's automatic plan of the same step and cluster (no strategy): its estimate beside
the published plan's (issue 47: at least as fast on every row), with its stages, meshes,
microbatches, recomputation, compile time and peak RSS (benchmarks/results/
published_automatic.md).

Each row goes to benchmarks/results/published/<row>.json as soon as it is done (`--skip-done`
resumes, per plan); the tables are made from all row files.

    python benchmarks/bench_published.py [--rows 1.7B,18.4B] [--plans published,automatic]
                                         [--skip-done]   (--plans '': only the tables)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import RESULTS, ROOT, write_results

from alpac.plan.cluster import load_cluster
from testdata.generate import GPTConfig, gpt_train_hlo

SEQ, VOCAB = 2048, 51200
SELENE = ROOT / "testdata" / "clusters" / "selene.yaml"
# name: heads, hidden, layers, tp, pp, GPUs, batch, micro-batch, measured TF/s per GPU
SC21 = {
    "1.7B": (24, 2304, 24, 1, 1, 32, 512, 16, 137),
    "3.6B": (32, 3072, 30, 2, 1, 64, 512, 16, 138),
    "7.5B": (32, 4096, 36, 4, 1, 128, 512, 16, 142),
    "18.4B": (48, 6144, 40, 8, 1, 256, 1024, 8, 135),
    "39.1B": (64, 8192, 48, 8, 2, 512, 1536, 4, 138),
    "76.1B": (80, 10240, 60, 8, 4, 1024, 1792, 2, 140),
    "145.6B": (96, 12288, 80, 8, 8, 1536, 2304, 2, 148),
    "310.1B": (128, 16384, 96, 8, 16, 1920, 2160, 1, 155),
    "529.6B": (128, 20480, 105, 8, 35, 2520, 2520, 1, 163),
    "1008B": (160, 25600, 128, 8, 64, 3072, 3072, 1, 163),
}


def model_flops(batch: int, layers: int, hidden: int) -> float:
    """Megatron's FLOPs per iteration with full recomputation (SC21, section 5.1)."""
    s, h, l = SEQ, hidden, layers
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def compile_cli(model: Path, cluster: Path, out: Path, args: list[str]) -> dict:
    """`alpac compile` in a process of its own: the plan (or the refusal), wall time, RSS."""
    cmd = ["/usr/bin/time", "-v", str(ROOT / ".venv" / "bin" / "alpac"), "compile", str(model),
           "--cluster", str(cluster), "-o", str(out), *args]
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    result = {"compile_s": round(seconds, 1),
              "peak_rss_gb": round(int(rss.group(1)) / 1e6, 2) if rss else None}
    if run.returncode != 0:
        lines = [x for x in run.stderr.splitlines() if x.startswith("alpac")]
        result["refused"] = lines[0] if lines else run.stderr[-400:]
        return result
    plan = json.loads((out / "plan.json").read_text())
    remat = sorted({mode for s in plan["stages"] for mode in s["remat"].values()})
    result.update(iteration_s=plan["estimate"]["iteration_time_s"],
                  peak_gib=plan["estimate"]["peak_memory_bytes"] / 2 ** 30,
                  stages=len(plan["stages"]), micro_batches=plan["num_micro_batches"],
                  meshes=[s["mesh"]["logical_shape"] for s in plan["stages"]],
                  remat=remat)
    return result


def run_row(name: str, tmp: Path, done: dict, plans: list[str]) -> dict:
    """The row's `plans` (published, automatic) compiled, added to `done` (its earlier
    figures)."""
    heads, hidden, layers, tp, pp, gpus, batch, mbs, measured = SC21[name]
    dp = gpus // (tp * pp)
    micro_batches = batch // (dp * mbs)
    model = tmp / f"gpt-{name}.hlo"
    model.write_text(gpt_train_hlo(GPTConfig(vocab=VOCAB, seq=SEQ, hidden=hidden, heads=heads,
                                             layers=layers, dtype="bfloat16"), batch))
    cluster = tmp / f"selene-{gpus}.yaml"
    cluster.write_text(yaml.safe_dump(load_cluster(SELENE).cut(gpus).to_dict()))
    flops = model_flops(batch, layers, hidden)
    measured_s = flops / (measured * 1e12 * gpus)
    strategy = f"megatron:dp={dp},tp={tp},pp={pp}"
    out = {**done, "row": name, "gpus": gpus, "strategy": strategy,
           "micro_batches": micro_batches, "measured_tflops": measured,
           "measured_s": measured_s}
    options = {"published": ["--strategy", strategy, "--micro-batches", str(micro_batches),
                             "--remat", "full", "--layers", str(layers)],
               "automatic": []}
    for which in plans:
        result = compile_cli(model, cluster, tmp / f"{name}-{which}", options[which])
        if "iteration_s" in result:
            result["tflops"] = flops / (result["iteration_s"] * gpus) / 1e12
            result["ratio"] = result["iteration_s"] / measured_s
        out[which] = result
        print(name, which, json.dumps(result), flush=True)
    return out


def table(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        p = r["published"]
        rows.append({
            "row": f"GPT-{r['row']} @ {r['gpus']}", "Megatron's plan": f"{r['strategy']}, "
            f"{r['micro_batches']} microbatches, full recomputation",
            "accepted": "yes" if "iteration_s" in p else f"NO: {p['refused']}",
            "peak GiB": f"{p['peak_gib']:.1f}" if "peak_gib" in p else "-",
            "estimate s": f"{p['iteration_s']:.2f}" if "iteration_s" in p else "-",
            "measured s": f"{r['measured_s']:.2f}",
            "TF/s/GPU est.": f"{p['tflops']:.0f}" if "tflops" in p else "-",
            "TF/s/GPU measured": f"{r['measured_tflops']}",
            "estimate / measured": f"{p['ratio']:.3f}" if "ratio" in p else "-",
            "compile s": f"{p['compile_s']:.0f}", "peak RSS GB": f"{p['peak_rss_gb']}"})
    return rows


def automatic_table(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        a, p = r.get("automatic"), r["published"]
        if a is None:
            continue
        planned = "iteration_s" in a
        rows.append({
            "row": f"GPT-{r['row']} @ {r['gpus']}",
            "automatic plan": (f"{a['stages']} stages, meshes "
                               f"{' '.join('x'.join(map(str, m)) for m in a['meshes'])}, "
                               f"{a['micro_batches']} microbatches, recomputation "
                               f"{'/'.join(a['remat'])}") if planned
            else f"NO: {a['refused']}",
            "peak GiB": f"{a['peak_gib']:.1f}" if planned else "-",
            "estimate s": f"{a['iteration_s']:.2f}" if planned else "-",
            "Megatron's plan, estimate s": f"{p['iteration_s']:.2f}" if "iteration_s" in p
            else "-",
            "speedup over Megatron's plan": f"{p['iteration_s'] / a['iteration_s']:.2f}"
            if planned and "iteration_s" in p else "-",
            "measured s (Megatron)": f"{r['measured_s']:.2f}",
            "compile s": f"{a['compile_s']:.0f}", "peak RSS GB": f"{a['peak_rss_gb']}"})
    return rows


def summary(results: list[dict]) -> str:
    errors = [abs(r["published"]["ratio"] - 1) for r in results if "ratio" in r["published"]]
    if not errors:
        return "no row priced"
    return (f"{len(errors)} of {len(results)} rows priced: median |estimate/measured - 1| "
            f"{statistics.median(errors):.1%}, worst {max(errors):.1%}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=",".join(SC21))
    parser.add_argument("--plans", default="published,automatic",
                        help="which plans to compile: published, automatic or both")
    parser.add_argument("--skip-done", action="store_true",
                        help="keep the plans of rows already written")
    args = parser.parse_args()
    done = RESULTS / "published"
    done.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.rows.split(","):
            path = done / f"{name}.json"
            before = json.loads(path.read_text()) if path.exists() else {}
            plans = [p for p in args.plans.split(",")
                     if p and not (args.skip_done and p in before)]
            if plans:
                path.write_text(json.dumps(run_row(name, Path(tmp), before, plans),
                                           indent=1) + "\n")
    order = list(SC21)
    results = sorted((json.loads(p.read_text()) for p in done.glob("*.json")),
                     key=lambda r: order.index(r["row"]))
    write_results("published", "Megatron-LM's published runs (SC21 Table 1) priced by alpac",
                  table(results),
                  f"Selene (`testdata/clusters/selene.yaml`) cut to each row's GPUs; GPT, seq "
                  f"2048, vocab 51200, bf16, Adam with f32 state; Megatron's plan as "
                  f"`--strategy megatron:dp=..,tp=..,pp=.. --micro-batches B/(dp·mbs) "
                  f"--remat full --layers <blocks>`. Measured: SC21 Table 1 (TF/s per GPU by "
                  f"Megatron's formula, turned into seconds per iteration). {summary(results)}. "
                  f"`python benchmarks/bench_published.py`.")
    automatic = automatic_table(results)
    if automatic:
        write_results("published_automatic", "alpac's automatic plans for the SC21 rows",
                      automatic,
                      f"The same steps and clusters as `published.md`, compiled with no "
                      f"strategy (stages, meshes, microbatches and recomputation chosen by "
                      f"alpac; 80 GiB per device). {speedups(results)}. Compile times as "
                      f"measured, with whatever shared the two cores then (published_changes.md "
                      f"says). `python benchmarks/bench_published.py --plans automatic`.")


def speedups(results: list[dict]) -> str:
    pairs = [(r["published"]["iteration_s"], r["automatic"]["iteration_s"]) for r in results
             if "iteration_s" in r.get("automatic", {}) and "iteration_s" in r["published"]]
    if not pairs:
        return "no row planned"
    ratios = [p / a for p, a in pairs]
    return (f"{len(pairs)} of {len(results)} rows planned: speedup over Megatron's plan "
            f"{min(ratios):.2f}-{max(ratios):.2f}, at least 1.10 on "
            f"{sum(x >= 1.10 for x in ratios)}")


if __name__ == "__main__":
    sys.exit(main())
