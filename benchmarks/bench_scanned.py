"""Scanned layers (issue 18): plans that do not depend on how the model was written, MaxText,
and compile time against the trip count.

- `scanned_twins`: the zoo's Flax nn.scan language models (with and without nn.remat) and
  their unrolled twins, automatic plans on testdata/clusters/aws-p3.16xlarge-x8.yaml: the
  estimates should be within 2% of each other.
- `scanned_maxtext`: the MaxText corpus step on dgx-a100-x4 with two stages forced
  (megatron:dp=4,tp=4,pp=2) and automatically: compile time (5 minutes asked for) and the
  iterations each stage holds.
- `scan_depth`: a GPT training step written the way production JAX code writes it (the
  blocks' weights stacked on a leading layer axis and applied by `lax.scan`, Adam in the
  step) at 6 and 48 iterations, compiled for the p3.16xlarge cluster cut to 8 GPUs
  (automatic, and two stages forced): every pass but emit, 48 within 1.2x of 6 asked for.

    cd benchmarks && PYTHONPATH=.. python bench_scanned.py [--parts twins,maxtext,depth]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import ROOT, compile_plan, p3_cluster, write_results

from alpac.plan.cluster import load_cluster

TARGET = 1.2  # the 48-iteration compile within 1.2x of the 6-iteration one


def scanned_gpt_hlo(layers: int, hidden: int, batch: int = 32, seq: int = 128,
                    vocab: int = 1024, heads: int = 8) -> str:
    """HLO text of one Adam training step of a pre-LN GPT whose blocks are a lax.scan."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def norm(x):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)

    def block(x, w):
        b, s, h = x.shape
        q, k, v = jnp.split(norm(x) @ w["qkv"], 3, axis=-1)
        split = lambda t: t.reshape(b, s, heads, h // heads).transpose(0, 2, 1, 3)  # noqa: E731
        scores = split(q) @ split(k).transpose(0, 1, 3, 2) / np.sqrt(h // heads)
        mask = jnp.tril(jnp.ones((s, s), bool))
        att = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1) @ split(v)
        x = x + att.transpose(0, 2, 1, 3).reshape(b, s, h) @ w["proj"]
        return x + jax.nn.gelu(norm(x) @ w["fc"]) @ w["out"], None

    def loss(params, ids):
        x = params["embed"][ids]
        x, _ = jax.lax.scan(block, x, params["blocks"])
        logits = norm(x) @ params["embed"].T
        labels = jax.nn.one_hot(ids[:, 1:], vocab)
        return -(jax.nn.log_softmax(logits[:, :-1]) * labels).sum(-1).mean()

    def step(params, m, v, ids):
        value, grads = jax.value_and_grad(loss)(params, ids)
        m = jax.tree.map(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
        v = jax.tree.map(lambda a, g: 0.999 * a + 0.001 * g * g, v, grads)
        params = jax.tree.map(lambda p, a, b: p - 1e-3 * a / (jnp.sqrt(b) + 1e-8), params, m, v)
        return params, m, v, value

    f32 = jnp.float32
    params = {"embed": jax.ShapeDtypeStruct((vocab, hidden), f32),
              "blocks": {"qkv": jax.ShapeDtypeStruct((layers, hidden, 3 * hidden), f32),
                         "proj": jax.ShapeDtypeStruct((layers, hidden, hidden), f32),
                         "fc": jax.ShapeDtypeStruct((layers, hidden, 4 * hidden), f32),
                         "out": jax.ShapeDtypeStruct((layers, 4 * hidden, hidden), f32)}}
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return jax.jit(step).lower(params, params, params, ids).as_text(dialect="hlo")


ZOO = ROOT / "testdata" / "zoo" / "programs"
CLUSTERS = ROOT / "testdata" / "clusters"
MAXTEXT = ROOT.parent / "shared" / "hlo-corpus" / \
    "nv_maxtext_1n1g_jit_train_step_before_optimization.hlo"
TWINS = (("flax_scan_lm_train", "flax_unrolled_lm_train"),
         ("flax_scan_remat_lm_train", "flax_unrolled_remat_lm_train"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="twins,maxtext,depth")
    parser.add_argument("--depths", default="6,48")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="depth: compiles per depth")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "twins" in parts:
        twins()
    if "maxtext" in parts:
        maxtext()
    if "depth" in parts:
        depth(args.depths, args.hidden, args.rounds)


def twins() -> None:
    cluster = load_cluster(CLUSTERS / "aws-p3.16xlarge-x8.yaml")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for scanned, unrolled in TWINS:
            estimate = {}
            for name in (unrolled, scanned):
                plan, _, seconds = compile_plan(ZOO / f"{name}.hlo", cluster, Path(tmp) / name)
                estimate[name] = plan["estimate"]["iteration_time_s"]
                rows.append({"program": name, "compile s": f"{seconds:.1f}",
                             "plan": f"{len(plan['stages'])} stage(s), "
                                     f"B={plan['num_micro_batches']}",
                             "estimate µs": f"{estimate[name] * 1e6:.3f}",
                             "÷ unrolled twin": f"{estimate[name] / estimate[unrolled]:.4f}"})
                print(rows[-1], flush=True)
    write_results("scanned_twins", "Scanned language models and their unrolled twins", rows,
                  "Automatic plans on aws-p3.16xlarge-x8 (64 V100s); the issue asks for "
                  "estimates within 2% of each other. `cd benchmarks && PYTHONPATH=.. python "
                  "bench_scanned.py --parts twins`.")


def maxtext() -> None:
    cluster = load_cluster(CLUSTERS / "dgx-a100-x4.yaml")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("megatron:dp=4,tp=4,pp=2", "automatic"):
            options = {} if strategy == "automatic" else {
                "stage-construction": {"strategy": strategy}}
            plan, _, seconds = compile_plan(MAXTEXT, cluster, Path(tmp) / "plan", options)
            held = "; ".join(f"{s['index']}: {_ranges(s['loop_iterations'])}"
                             for s in plan["stages"])
            rows.append({"strategy": strategy, "compile s": f"{seconds:.1f}",
                         "plan": f"{len(plan['stages'])} stage(s), "
                                 f"B={plan['num_micro_batches']}",
                         "estimate ms": f"{plan['estimate']['iteration_time_s'] * 1e3:.1f}",
                         "iterations held per stage": held})
            print(rows[-1], flush=True)
    write_results("scanned_maxtext", "MaxText's scanned decoder, pipelined", rows,
                  "nv_maxtext_1n1g_jit_train_step_before_optimization (8 scanned layers, "
                  "d_model 2560) on dgx-a100-x4 (32 A100s); the issue asks for both within 5 "
                  "minutes. `cd benchmarks && PYTHONPATH=.. python bench_scanned.py --parts "
                  "maxtext`.")


def _ranges(rows: list[int]) -> str:
    return f"{rows[0]}–{rows[-1]}" if len(rows) > 1 else str(rows[0])


def depth(depths: str, hidden: int, rounds: int) -> None:
    """Each strategy's depths compiled in turn, `rounds` times over (this machine's speed
    drifts by 2x over an hour: the ratio is taken between compiles minutes apart), and per
    depth the round of median time."""
    cluster = p3_cluster(8)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("automatic", "megatron:dp=2,tp=2,pp=2"):
            runs: dict[int, list] = {int(d): [] for d in depths.split(",")}
            for _ in range(rounds):
                for layers, done in runs.items():
                    done.append(_compile_depth(Path(tmp), layers, hidden, cluster, strategy))
            base = None
            for layers, done in runs.items():
                seconds, passes, plan = sorted(done, key=lambda r: r[0])[len(done) // 2]
                base = base or seconds
                rows.append({
                    "strategy": strategy, "iterations": layers,
                    "compile s (emit excluded)": f"{seconds:.1f}",
                    "rounds s": " ".join(f"{r[0]:.1f}" for r in done),
                    "÷ first depth": f"{seconds / base:.2f}",
                    "stage construction s": f"{passes['stage-construction']:.1f}",
                    "stage ILPs s": f"{passes['intra-op-sharding']:.1f}",
                    "emit s": f"{passes['emit']:.1f}",
                    "plan": f"{len(plan['stages'])} stage(s), B={plan['num_micro_batches']}",
                    "estimate ms": f"{plan['estimate']['iteration_time_s'] * 1e3:.2f}"})
                print(rows[-1], flush=True)
    write_results("scan_depth", "Compile time against the trip count of a scanned GPT", rows,
                  f"Scanned GPT (hidden {hidden}, batch 32, sequence 128, Adam) on "
                  f"aws-p3.16xlarge cut to 8 GPUs; the target is {TARGET}x from 6 to 48 "
                  f"iterations. Every pass but emit; the median of {rounds} rounds, each "
                  f"compiling every depth in turn. `cd benchmarks && PYTHONPATH=.. python "
                  f"bench_scanned.py --parts depth --rounds {rounds}`.")


def _compile_depth(tmp: Path, layers: int, hidden: int, cluster, strategy: str):
    """Seconds of every pass but emit, the pass times and the plan."""
    model = tmp / f"scanned-gpt-{layers}.hlo"
    if not model.exists():
        model.write_text(scanned_gpt_hlo(layers, hidden))
    options = {} if strategy == "automatic" else {"stage-construction": {"strategy": strategy}}
    plan, stats, _ = compile_plan(model, cluster, tmp / "plan", options)
    passes = stats["pass_seconds"]
    return sum(s for name, s in passes.items() if name != "emit"), passes, plan


if __name__ == "__main__":
    main()
