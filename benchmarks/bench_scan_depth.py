"""Compile time against the trip count of a scanned GPT (issue 18, acceptance 4).

A GPT training step written the way production JAX code writes it: the blocks' weights stacked
on a leading layer axis and applied by `lax.scan` (one `while` forward, one backward), Adam in
the step. The same model at 6 and at 48 iterations (blocks) is compiled for the paper's
p3.16xlarge cluster cut to 8 GPUs (automatic plan) and with two stages forced (Megatron
dp=2, tp=2, pp=2); the time of every pass except emit (writing the modules out) is compared.

    python benchmarks/bench_scan_depth.py [--depths 6,48] [--hidden 512]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import compile_plan, p3_cluster, write_results

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="6,48")
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    cluster = p3_cluster(8)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("automatic", "megatron:dp=2,tp=2,pp=2"):
            base = None
            for depth in (int(d) for d in args.depths.split(",")):
                model = Path(tmp) / f"scanned-gpt-{depth}.hlo"
                if not model.exists():
                    model.write_text(scanned_gpt_hlo(depth, args.hidden))
                options = {} if strategy == "automatic" else {
                    "stage-construction": {"strategy": strategy}}
                plan, stats, _ = compile_plan(model, cluster, Path(tmp) / "plan", options)
                passes = stats["pass_seconds"]
                seconds = sum(s for name, s in passes.items() if name != "emit")
                base = base or seconds
                rows.append({
                    "strategy": strategy, "iterations": depth,
                    "compile s (emit excluded)": f"{seconds:.1f}",
                    "÷ first depth": f"{seconds / base:.2f}",
                    "stage construction s": f"{passes['stage-construction']:.1f}",
                    "stage ILPs s": f"{passes['intra-op-sharding']:.1f}",
                    "emit s": f"{passes['emit']:.1f}",
                    "plan": f"{len(plan['stages'])} stage(s), B={plan['num_micro_batches']}",
                    "estimate ms": f"{plan['estimate']['iteration_time_s'] * 1e3:.2f}"})
                print(rows[-1], flush=True)
    write_results("scan_depth", "Compile time against the trip count of a scanned GPT", rows,
                  f"Scanned GPT (hidden {args.hidden}, batch 32, sequence 128, Adam) on "
                  f"aws-p3.16xlarge cut to 8 GPUs; the target is {TARGET}x from 6 to 48 "
                  f"iterations. `python benchmarks/bench_scan_depth.py` (from the repository "
                  f"root, PYTHONPATH=.).")


if __name__ == "__main__":
    main()
