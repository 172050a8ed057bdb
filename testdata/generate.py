"""alpac's own test models: HLO of small training steps and forward passes, with reference data.

    python testdata/generate.py              # (re)write testdata/models/ (deterministic)
    python testdata/generate.py --gpt-suite 2.6B [--batch 1024] [--layers N] [--dtype float16] \
        -o FILE.hlo                          # one training step of the Alpa GPT suite

Everything here is plain jax + numpy (no flax/optax), so the modules are exactly what
`jax.jit(f, donate_argnums=..., keep_unused=True).lower(*args).as_text(dialect="hlo")` prints.

Models (`testdata/models/<model>_{train,fwd}.hlo` + `.npz`, and `manifest.json` describing them):

- mlp      4 dense layers (tanh, gelu, tanh, linear), mean-squared-error regression
- gpt      GPT-2-style decoder: 4 layers, hidden 64, 4 heads, seq 16, vocab 256, pre-LN, MLP 4x,
           causal attention, embedding tied with the output projection, next-token cross-entropy
- bert     BERT-style encoder: 4 layers, hidden 32, 8 heads, seq 16, vocab 128, post-LN,
           bidirectional attention with a padding mask input, MLM loss over weighted positions
- moe      decoder with 2 layers whose FFN is a GShard/Switch-style mixture of 8 experts
           (top-2 gating, capacity 8 per group, dispatch/combine one-hot einsums, expert weights
           [E, d, ff]) plus the auxiliary load-balancing loss
- wresnet  pre-activation WideResNet, NHWC 16x16x3 inputs, groups of width 16/32/48, batch
           normalization (batch statistics in training; running mean/var are model state that the
           training step returns updated; the forward pass uses them), 10 classes

Calling conventions (flat, deterministic: jax pytree order, i.e. dict keys sorted, lists in order):

- train:  step(params, state, opt_state, batch) -> (new params, new state, new opt_state, loss)
          `state` is the non-trainable model state (wresnet's BN running stats; empty elsewhere),
          `opt_state` = {count: s32[], mu: like params, nu: like params} (optax's Adam, by hand).
          params, state and opt_state are donated, so input_output_alias maps output i to
          parameter i for every one of them; `keep_unused=True` keeps every argument.
- fwd:    forward(params, state, inputs) -> model output (logits / predictions)
- Every batch input has the batch (16) on dim 0. Floats are f32, token ids and labels s32.

Reference data: `<module>.npz` holds the entry parameters as arg0..argN and the flattened outputs
as out0..outM, from running the jitted function on CPU (compare with rtol ~2e-4, atol ~2e-5).
Inputs are seeded random values on a coarse binary grid (few mantissa bits, exact in any float
format), so they compress well; Adam's state is a few steps in (count 3, v >= m^2). The npz
files are written with fixed zip timestamps, so they are byte-for-byte reproducible.

jax 0.10 notes: without keep_unused=True jax drops unused arguments from the entry computation;
nested jitted library functions (jnp.take, jax.nn.one_hot, jnp.where, jax.nn.relu, jnp.argmax)
stay `call` instructions; a batch mean is a reduce followed by a divide by a constant (and the
backward pass multiplies by the constant -1/N).

The GPT suite of the Alpa paper (350M ... 39B) is lowered on demand from shapes alone
(`jax.ShapeDtypeStruct`), without allocating parameters: `gpt_suite_hlo(name, ...)`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from testdata.npz import write_npz  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS_DIR = HERE / "models"
BATCH = 16
MODEL_NAMES = ("mlp", "gpt", "bert", "moe", "wresnet")

# Adam (optax.adam defaults except the learning rate).
LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-8


# =============================================================================================
# Parameter specs: nested dicts/lists of Leaf, turned into numpy arrays (seeded) or into
# jax.ShapeDtypeStruct (no memory) -- the same tree either way.
# =============================================================================================

@dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    init: str = "normal"     # normal | zeros | ones | positive
    scale: float = 0.02      # std of "normal"


def _grid(x: np.ndarray, scale: float, levels: int = 8) -> np.ndarray:
    """x * scale (x about unit scale) rounded to a grid of step 2^k ~ scale/levels and clipped
    to +-4 scale: few mantissa bits and few distinct values, so float32 files compress well
    and every value is exact in any float format."""
    step = 2.0 ** round(math.log2(scale / levels))
    limit = round(4 * scale / step)
    return (np.clip(np.round(x * scale / step), -limit, limit) * step).astype(np.float32)


def materialize(tree, rng: np.random.Generator):
    def make(leaf: Leaf):
        if leaf.init == "zeros":
            return np.zeros(leaf.shape, np.float32)
        if leaf.init == "ones":
            return np.ones(leaf.shape, np.float32)
        if leaf.init == "positive":  # e.g. BN running variance
            return (1.0 + np.abs(_grid(rng.standard_normal(leaf.shape), leaf.scale))).astype(
                np.float32)
        return _grid(rng.standard_normal(leaf.shape), leaf.scale)
    return jax.tree_util.tree_map(make, tree, is_leaf=lambda x: isinstance(x, Leaf))


def abstract(tree, dtype=jnp.float32):
    return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), tree,
                                  is_leaf=lambda x: isinstance(x, Leaf))


def count_params(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in
               jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Leaf)))


# =============================================================================================
# Building blocks
# =============================================================================================

def dense_spec(d_in: int, d_out: int, scale: float | None = None) -> dict:
    return {"w": Leaf((d_in, d_out), "normal", scale or 1.0 / math.sqrt(d_in)),
            "b": Leaf((d_out,), "zeros")}


def ln_spec(d: int) -> dict:
    return {"scale": Leaf((d,), "ones"), "bias": Leaf((d,), "zeros")}


def dense(x, p):
    return jnp.matmul(x, p["w"]) + p["b"]


def layer_norm(x, p, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def gelu(x):
    return jax.nn.gelu(x, approximate=True)


def softmax(x, axis=-1):
    e = jnp.exp(x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return e / jnp.sum(e, axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    shifted = x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))


def cross_entropy(logits, labels):
    """Per-example cross-entropy (one-hot labels x log-softmax), in the logits' dtype."""
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return -jnp.sum(onehot * log_softmax(logits), axis=-1)


def embed(table, ids):
    """Row lookup: one gather (clamped indices, no out-of-bounds select)."""
    return jnp.take(table, ids, axis=0, mode="clip")


def attention_spec(d: int) -> dict:
    return {"q": dense_spec(d, d), "k": dense_spec(d, d), "v": dense_spec(d, d),
            "o": dense_spec(d, d)}


def attention(x, p, heads: int, bias):
    """Multi-head self-attention; `bias` is added to the scores ([B|1, 1, S|1, S])."""
    b, s, d = x.shape
    hd = d // heads
    q = dense(x, p["q"]).reshape(b, s, heads, hd)
    k = dense(x, p["k"]).reshape(b, s, heads, hd)
    v = dense(x, p["v"]).reshape(b, s, heads, hd)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(1.0 / math.sqrt(hd), x.dtype)
    probs = softmax(scores + bias)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return dense(out, p["o"])


def causal_bias(s: int, dtype):
    """[1, 1, S, S]: 0 where key <= query, a large negative number elsewhere (from iota, so no
    S x S constant lands in the HLO)."""
    q = lax.broadcasted_iota(jnp.int32, (s, s), 0)
    k = lax.broadcasted_iota(jnp.int32, (s, s), 1)
    neg = -1e4 if jnp.dtype(dtype) == jnp.float16 else -1e9
    return jnp.where(k <= q, jnp.asarray(0, dtype), jnp.asarray(neg, dtype))[None, None]


def cast_tree(tree, dtype):
    return jax.tree_util.tree_map(lambda p: p.astype(dtype), tree)


# =============================================================================================
# Models. Each returns a Model: parameter/state specs, batch, loss and forward functions.
# =============================================================================================

@dataclass
class Model:
    name: str
    params: dict                       # tree of Leaf
    state: dict                        # tree of Leaf (non-trainable model state), may be {}
    loss_fn: Callable                  # (params, state, batch) -> (loss, new_state)
    apply_fn: Callable                 # (params, state, inputs) -> output
    make_batch: Callable               # rng -> dict of numpy arrays (batch on dim 0)
    fwd_inputs: tuple[str, ...]        # batch keys the forward pass takes
    description: str = ""
    config: dict = field(default_factory=dict)


# ---- mlp ------------------------------------------------------------------------------------

def mlp_model() -> Model:
    d_in, hidden, d_out = 32, 128, 16
    params = {"layers": [dense_spec(d_in, hidden), dense_spec(hidden, hidden),
                         dense_spec(hidden, hidden), dense_spec(hidden, d_out)]}
    acts = (jnp.tanh, gelu, jnp.tanh, None)

    def apply_fn(params, state, inputs):
        x = inputs["x"]
        for p, act in zip(params["layers"], acts):
            x = dense(x, p)
            if act is not None:
                x = act(x)
        return x

    def loss_fn(params, state, batch):
        pred = apply_fn(params, state, batch)
        return jnp.mean(jnp.square(pred - batch["y"])), state

    def make_batch(rng):
        return {"x": _grid(rng.standard_normal((BATCH, d_in)), 1.0),
                "y": _grid(rng.standard_normal((BATCH, d_out)), 0.5)}

    return Model("mlp", params, {}, loss_fn, apply_fn, make_batch, ("x",),
                 "4 dense layers 32-128-128-128-16 (tanh, gelu, tanh, linear), MSE regression",
                 dict(d_in=d_in, hidden=hidden, d_out=d_out))


# ---- gpt ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 16
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    mlp_ratio: int = 4
    dtype: str = "float32"   # compute dtype; parameters are always float32


def gpt_params(cfg: GPTConfig) -> dict:
    d = cfg.hidden
    layer = {"ln1": ln_spec(d), "attn": attention_spec(d), "ln2": ln_spec(d),
             "mlp": {"fc": dense_spec(d, cfg.mlp_ratio * d),
                     "proj": dense_spec(cfg.mlp_ratio * d, d)}}
    return {"wte": Leaf((cfg.vocab, d), "normal", 0.02),
            "wpe": Leaf((cfg.seq, d), "normal", 0.01),
            "layers": [layer for _ in range(cfg.layers)],
            "ln_f": ln_spec(d)}


def gpt_logits(cfg: GPTConfig, params, tokens):
    """Pre-LN decoder; the output projection is the (tied) token embedding."""
    p = cast_tree(params, jnp.dtype(cfg.dtype))
    x = embed(p["wte"], tokens) + p["wpe"][None]
    bias = causal_bias(tokens.shape[1], x.dtype)
    for layer in p["layers"]:                       # unrolled: every layer is visible in HLO
        x = x + attention(layer_norm(x, layer["ln1"]), layer["attn"], cfg.heads, bias)
        h = gelu(dense(layer_norm(x, layer["ln2"]), layer["mlp"]["fc"]))
        x = x + dense(h, layer["mlp"]["proj"])
    x = layer_norm(x, p["ln_f"])
    return jnp.einsum("bsd,vd->bsv", x, p["wte"])


def gpt_loss(cfg: GPTConfig, params, state, batch):
    logits = gpt_logits(cfg, params, batch["tokens"])
    ce = cross_entropy(logits, batch["labels"])
    return jnp.mean(ce.astype(jnp.float32)), state


def gpt_model() -> Model:
    cfg = GPTConfig()

    def make_batch(rng):
        seq = rng.integers(0, cfg.vocab, (BATCH, cfg.seq + 1), dtype=np.int64)
        return {"tokens": seq[:, :-1].astype(np.int32), "labels": seq[:, 1:].astype(np.int32)}

    return Model("gpt", gpt_params(cfg), {}, partial(gpt_loss, cfg),
                 lambda params, state, inputs: gpt_logits(cfg, params, inputs["tokens"]),
                 make_batch, ("tokens",),
                 "GPT-2-style decoder, 4 layers, hidden 64, 4 heads, seq 16, vocab 256, pre-LN, "
                 "MLP 4x, tied embedding, next-token cross-entropy",
                 dict(vars(cfg), tied_embedding=True))


# ---- bert -----------------------------------------------------------------------------------

def bert_model() -> Model:
    vocab, seq, d, heads, n_layers, ff = 128, 16, 32, 8, 4, 128
    layer = {"attn": attention_spec(d), "ln1": ln_spec(d),
             "mlp": {"fc": dense_spec(d, ff), "proj": dense_spec(ff, d)}, "ln2": ln_spec(d)}
    params = {"wte": Leaf((vocab, d), "normal", 0.02), "wpe": Leaf((seq, d), "normal", 0.01),
              "ln_emb": ln_spec(d), "layers": [layer for _ in range(n_layers)],
              "mlm": {"transform": dense_spec(d, d), "ln": ln_spec(d),
                      "bias": Leaf((vocab,), "zeros")}}

    def apply_fn(params, state, inputs):
        """MLM logits [B, S, vocab]; post-LN encoder, padding mask on the keys."""
        x = layer_norm(embed(params["wte"], inputs["tokens"]) + params["wpe"][None],
                       params["ln_emb"])
        bias = ((1.0 - inputs["attention_mask"]) * -1e9)[:, None, None, :]
        for p in params["layers"]:
            x = layer_norm(x + attention(x, p["attn"], heads, bias), p["ln1"])
            x = layer_norm(x + dense(gelu(dense(x, p["mlp"]["fc"])), p["mlp"]["proj"]),
                           p["ln2"])
        h = layer_norm(gelu(dense(x, params["mlm"]["transform"])), params["mlm"]["ln"])
        return jnp.einsum("bsd,vd->bsv", h, params["wte"]) + params["mlm"]["bias"]

    def loss_fn(params, state, batch):
        logits = apply_fn(params, state, batch)
        ce = cross_entropy(logits, batch["mlm_labels"])
        w = batch["mlm_weights"]
        return jnp.sum(ce * w) / (jnp.sum(w) + 1e-6), state

    def make_batch(rng):
        tokens = rng.integers(1, vocab, (BATCH, seq)).astype(np.int32)
        lengths = rng.integers(seq // 2, seq + 1, BATCH)
        mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
        tokens = np.where(mask > 0, tokens, 0).astype(np.int32)           # 0 = [PAD]
        weights = ((rng.random((BATCH, seq)) < 0.15) & (mask > 0)).astype(np.float32)
        weights[np.arange(BATCH), rng.integers(0, lengths)] = 1.0         # >= 1 per row
        labels = tokens.copy()
        tokens = np.where(weights > 0, vocab - 1, tokens).astype(np.int32)  # vocab-1 = [MASK]
        return {"tokens": tokens, "attention_mask": mask,
                "mlm_labels": labels.astype(np.int32), "mlm_weights": weights}

    return Model("bert", params, {}, loss_fn, apply_fn, make_batch,
                 ("attention_mask", "tokens"),
                 "BERT-style encoder, 4 layers, hidden 32, 8 heads, seq 16, vocab 128, post-LN, "
                 "MLP 4x, padding attention mask, MLM loss (weighted mean over masked positions), "
                 "decoder tied to the token embedding",
                 dict(vocab=vocab, seq=seq, hidden=d, heads=heads, layers=n_layers, ff=ff))


# ---- moe ------------------------------------------------------------------------------------

def moe_ffn(x, p, experts: int, capacity: int):
    """GShard top-2 MoE over groups = sequences: x [G, S, d] -> ([G, S, d], aux loss)."""
    g, s, _ = x.shape
    gates = softmax(jnp.einsum("gsd,de->gse", x, p["gate"]))               # [G,S,E]
    mask1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), experts, dtype=x.dtype)
    mask2 = jax.nn.one_hot(jnp.argmax(gates * (1.0 - mask1), axis=-1), experts,
                           dtype=x.dtype)
    # load balancing per group, averaged over groups (GShard): E * sum_e (fraction of the
    # group routed to e) * (mean gate of e in the group). Per-group statistics keep the loss a
    # sum over examples, so microbatching it is exact.
    aux = experts * jnp.mean(jnp.sum(jnp.mean(mask1, axis=1) * jnp.mean(gates, axis=1), axis=-1))
    # position of each token in its expert's buffer: cumulative sum along the sequence,
    # as a matmul with an upper-triangular matrix (tri[s, t] = s <= t)
    tri = (lax.broadcasted_iota(jnp.int32, (s, s), 0)
           <= lax.broadcasted_iota(jnp.int32, (s, s), 1)).astype(x.dtype)
    pos1 = jnp.einsum("gse,st->gte", mask1, tri) - 1.0
    mask1 = mask1 * (pos1 < capacity)
    pos2 = (jnp.einsum("gse,st->gte", mask2, tri) - 1.0
            + jnp.sum(mask1, axis=1, keepdims=True))
    mask2 = mask2 * (pos2 < capacity)
    gate1 = jnp.sum(gates * mask1, axis=-1)
    gate2 = jnp.sum(gates * mask2, axis=-1)
    denom = gate1 + gate2 + 1e-9
    slot1 = jax.nn.one_hot(jnp.sum(pos1 * mask1, -1).astype(jnp.int32), capacity,
                           dtype=x.dtype)                                  # [G,S,C]
    slot2 = jax.nn.one_hot(jnp.sum(pos2 * mask2, -1).astype(jnp.int32), capacity,
                           dtype=x.dtype)
    dispatch1 = mask1[..., None] * slot1[:, :, None, :]                     # [G,S,E,C]
    dispatch2 = mask2[..., None] * slot2[:, :, None, :]
    combine = ((gate1 / denom)[..., None, None] * dispatch1
               + (gate2 / denom)[..., None, None] * dispatch2)
    dispatch = lax.stop_gradient(dispatch1 + dispatch2)
    xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)                          # [E,G,C,d]
    h = gelu(jnp.einsum("egcd,edf->egcf", xe, p["wi"]) + p["bi"][:, None, None, :])
    ye = jnp.einsum("egcf,efd->egcd", h, p["wo"]) + p["bo"][:, None, None, :]
    return jnp.einsum("gsec,egcd->gsd", combine, ye), aux


def moe_model() -> Model:
    vocab, seq, d, heads, n_layers = 128, 16, 32, 8, 2
    experts, ff, top_k, capacity_factor = 8, 32, 2, 2.0
    capacity = int(math.ceil(top_k * seq * capacity_factor / experts))   # per group (= sequence)
    aux_weight = 0.01
    layer = {"ln1": ln_spec(d), "attn": attention_spec(d), "ln2": ln_spec(d),
             "moe": {"gate": Leaf((d, experts), "normal", 0.1),
                     "wi": Leaf((experts, d, ff), "normal", 1 / math.sqrt(d)),
                     "bi": Leaf((experts, ff), "zeros"),
                     "wo": Leaf((experts, ff, d), "normal", 1 / math.sqrt(ff)),
                     "bo": Leaf((experts, d), "zeros")}}
    params = {"wte": Leaf((vocab, d), "normal", 0.02), "wpe": Leaf((seq, d), "normal", 0.01),
              "layers": [layer for _ in range(n_layers)], "ln_f": ln_spec(d)}

    def forward(params, tokens):
        x = embed(params["wte"], tokens) + params["wpe"][None]
        bias = causal_bias(seq, x.dtype)
        aux_total = jnp.zeros((), jnp.float32)
        for p in params["layers"]:
            x = x + attention(layer_norm(x, p["ln1"]), p["attn"], heads, bias)
            y, aux = moe_ffn(layer_norm(x, p["ln2"]), p["moe"], experts, capacity)
            x = x + y
            aux_total = aux_total + aux
        x = layer_norm(x, params["ln_f"])
        return jnp.einsum("bsd,vd->bsv", x, params["wte"]), aux_total

    def loss_fn(params, state, batch):
        logits, aux = forward(params, batch["tokens"])
        ce = jnp.mean(cross_entropy(logits, batch["labels"]))
        return ce + aux_weight * aux, state

    def make_batch(rng):
        seqs = rng.integers(0, vocab, (BATCH, seq + 1))
        return {"tokens": seqs[:, :-1].astype(np.int32), "labels": seqs[:, 1:].astype(np.int32)}

    return Model("moe", params, {}, loss_fn,
                 lambda params, state, inputs: forward(params, inputs["tokens"])[0],
                 make_batch, ("tokens",),
                 f"decoder, 2 layers, hidden {d}, {heads} heads, seq {seq}, vocab {vocab}; FFN = "
                 f"mixture of {experts} experts (ff {ff}, weights [E, d, ff]), top-{top_k} gating, "
                 f"capacity {capacity} per sequence, GShard dispatch/combine einsums; loss = "
                 f"next-token cross-entropy + {aux_weight} x load-balancing loss; tied embedding",
                 dict(vocab=vocab, seq=seq, hidden=d, heads=heads, layers=n_layers,
                      experts=experts, expert_ff=ff, top_k=top_k, capacity=capacity,
                      capacity_factor=capacity_factor, aux_weight=aux_weight))


# ---- wresnet --------------------------------------------------------------------------------

def wresnet_model() -> Model:
    image, c_in, classes = 16, 3, 10
    widths, strides = (16, 32, 48), (1, 2, 2)
    momentum, eps = 0.9, 1e-5

    def conv_spec(k, cin, cout):
        return Leaf((k, k, cin, cout), "normal", math.sqrt(2.0 / (k * k * cin)))

    def bn_spec(c):
        return {"scale": Leaf((c,), "ones"), "bias": Leaf((c,), "zeros")}

    def bn_state(c):
        return {"mean": Leaf((c,), "normal", 0.1), "var": Leaf((c,), "positive", 0.1)}

    params = {"stem": conv_spec(3, c_in, widths[0]), "blocks": [], "bn_final": bn_spec(widths[-1]),
              "head": dense_spec(widths[-1], classes)}
    state = {"blocks": [], "bn_final": bn_state(widths[-1])}
    cin = widths[0]
    for w in widths:
        block = {"bn1": bn_spec(cin), "conv1": conv_spec(3, cin, w), "bn2": bn_spec(w),
                 "conv2": conv_spec(3, w, w)}
        if cin != w:
            block["shortcut"] = conv_spec(1, cin, w)
        params["blocks"].append(block)
        state["blocks"].append({"bn1": bn_state(cin), "bn2": bn_state(w)})
        cin = w

    def conv(x, w, stride):
        return lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def bn(x, p, s, train):
        if train:
            mean = jnp.mean(x, axis=(0, 1, 2))
            var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
            new_s = {"mean": momentum * s["mean"] + (1 - momentum) * lax.stop_gradient(mean),
                     "var": momentum * s["var"] + (1 - momentum) * lax.stop_gradient(var)}
        else:
            mean, var, new_s = s["mean"], s["var"], s
        return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"], new_s

    def forward(params, state, images, train):
        new_state = {"blocks": []}
        x = conv(images, params["stem"], 1)
        for p, s, stride in zip(params["blocks"], state["blocks"], strides):
            h, s1 = bn(x, p["bn1"], s["bn1"], train)
            h = jax.nn.relu(h)
            shortcut = conv(h, p["shortcut"], stride) if "shortcut" in p else x
            h = conv(h, p["conv1"], stride)
            h, s2 = bn(h, p["bn2"], s["bn2"], train)
            h = conv(jax.nn.relu(h), p["conv2"], 1)
            x = h + shortcut
            new_state["blocks"].append({"bn1": s1, "bn2": s2})
        x, new_state["bn_final"] = bn(x, params["bn_final"], state["bn_final"], train)
        x = jnp.mean(jax.nn.relu(x), axis=(1, 2))
        return dense(x, params["head"]), new_state

    def loss_fn(params, state, batch):
        logits, new_state = forward(params, state, batch["images"], True)
        return jnp.mean(cross_entropy(logits, batch["labels"])), new_state

    def make_batch(rng):
        return {"images": _grid(rng.standard_normal((BATCH, image, image, c_in)), 1.0),
                "labels": rng.integers(0, classes, BATCH).astype(np.int32)}

    return Model("wresnet", params, state, loss_fn,
                 lambda params, state, inputs: forward(params, state, inputs["images"], False)[0],
                 make_batch, ("images",),
                 "pre-activation WideResNet, NHWC 16x16x3, stem conv 3x3x16, one residual block "
                 "per group of width 16/32/48 (strides 1/2/2, 1x1 projection shortcuts), batch "
                 "norm (momentum 0.9) with running mean/var as state, global average pool, "
                 "10 classes, cross-entropy",
                 dict(image=image, channels_in=c_in, widths=list(widths), strides=list(strides),
                      classes=classes, bn_momentum=momentum))


BUILDERS = {"mlp": mlp_model, "gpt": gpt_model, "bert": bert_model, "moe": moe_model,
            "wresnet": wresnet_model}
SEEDS = {"mlp": 1001, "gpt": 1002, "bert": 1003, "moe": 1004, "wresnet": 1005}


# =============================================================================================
# Training step (Adam by hand, as optax.adam) and forward pass
# =============================================================================================

def make_train_step(loss_fn: Callable, name: str = "train_step") -> Callable:
    def train_step(params, state, opt_state, batch):
        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, state, batch)
        count = opt_state["count"] + 1
        mu = jax.tree_util.tree_map(lambda m, g: B1 * m + (1 - B1) * g, opt_state["mu"], grads)
        nu = jax.tree_util.tree_map(lambda v, g: B2 * v + (1 - B2) * jnp.square(g),
                                    opt_state["nu"], grads)
        t = count.astype(jnp.float32)
        bc1 = 1 - B1 ** t
        bc2 = 1 - B2 ** t
        new_params = jax.tree_util.tree_map(
            lambda p, m, v: p - LR * (m / bc1) / (jnp.sqrt(v / bc2) + EPS), params, mu, nu)
        return new_params, new_state, {"count": count, "mu": mu, "nu": nu}, loss
    train_step.__name__ = train_step.__qualname__ = name
    return train_step


def make_forward(apply_fn: Callable, name: str = "forward") -> Callable:
    def forward(params, state, inputs):
        return apply_fn(params, state, inputs)
    forward.__name__ = forward.__qualname__ = name
    return forward


def jit_train(step: Callable):
    # params, state and opt_state are donated -> input_output_alias in the HLO header;
    # keep_unused: every argument stays an entry parameter even if the step ignores it.
    return jax.jit(step, donate_argnums=(0, 1, 2), keep_unused=True)


def jit_forward(fwd: Callable):
    return jax.jit(fwd, keep_unused=True)


def hlo_text(lowered) -> str:
    return lowered.as_text(dialect="hlo")


def _canonical():
    """The jax settings the committed files were made with (whatever the caller set)."""
    return jax.enable_x64(False)


# =============================================================================================
# Concrete test models: arguments, lowering, reference data
# =============================================================================================

@dataclass
class Built:
    """Everything for one model: the two functions and their (numpy) arguments."""
    model: Model
    train_step: Callable
    forward: Callable
    train_args: tuple
    fwd_args: tuple


def build(name: str) -> Built:
    model = BUILDERS[name]()
    rng = np.random.default_rng(SEEDS[name])
    params = materialize(model.params, rng)
    state = materialize(model.state, rng)
    # An optimizer state a few steps in, so that m and v matter in the reference data. v is at
    # least m^2 + 2^-20 (as real second moments are): the update stays well conditioned even for
    # parameters whose gradient is zero up to rounding (e.g. the attention key bias), so the
    # reference outputs do not depend on how XLA rounds.
    mu = jax.tree_util.tree_map(lambda p: _grid(rng.standard_normal(p.shape), 1e-3, 2), params)
    nu = jax.tree_util.tree_map(
        lambda m: m * m + (1 + np.abs(_grid(rng.standard_normal(m.shape), 2.0, 1))) * 2.0 ** -20,
        mu)
    opt_state = {"count": np.asarray(3, np.int32), "mu": mu, "nu": nu}
    batch = model.make_batch(rng)
    inputs = {k: batch[k] for k in model.fwd_inputs}
    return Built(model, make_train_step(model.loss_fn, f"{name}_train"),
                 make_forward(model.apply_fn, f"{name}_fwd"),
                 (params, state, opt_state, batch), (params, state, inputs))


def lower_model(built: Built, kind: str):
    with _canonical():
        if kind == "train":
            return jit_train(built.train_step).lower(*built.train_args)
        return jit_forward(built.forward).lower(*built.fwd_args)


def model_hlo(name: str, kind: str) -> str:
    """The HLO text of `<name>_<kind>.hlo` (kind: train | fwd), as the generator writes it."""
    return hlo_text(lower_model(build(name), kind))


def run_model(built: Built, kind: str, repeat: int = 1) -> tuple[list[np.ndarray], float]:
    """Outputs (flattened) of running the jitted function on CPU, and the best wall time in
    seconds of `repeat` runs after the compiling one."""
    if kind == "train":
        fn, args = jit_train(built.train_step), built.train_args
    else:
        fn, args = jit_forward(built.forward), built.fwd_args
    best = math.inf
    with _canonical():
        for i in range(repeat + 1):
            fresh = jax.tree_util.tree_map(np.array, args)   # copies: train inputs are donated
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*fresh))
            if i:
                best = min(best, time.perf_counter() - t0)
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(out)], best


def _write_if_changed(path: Path, data: bytes) -> None:
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


def _layout(kind: str, args: tuple) -> dict:
    """Where each group of arguments starts and ends in the entry parameter list (half-open
    ranges), and the batch inputs with their batch dimension."""
    roles = (("params", "state", "opt_state", "batch") if kind == "train"
             else ("params", "state", "batch"))
    out, start = {}, 0
    for role, tree in zip(roles, args):
        n = len(jax.tree_util.tree_leaves(tree))
        out[role] = [start, start + n]
        start += n
    batch = args[-1]
    out["batch_inputs"] = {k: {"arg": out["batch"][0] + i, "shape": list(np.shape(v)),
                               "dtype": str(np.asarray(v).dtype), "batch_dim": 0}
                           for i, (k, v) in enumerate(sorted(batch.items()))}
    return out


def generate_models(out_dir: Path = MODELS_DIR, names=MODEL_NAMES, verbose: bool = True) -> dict:
    """Write <model>_{train,fwd}.{hlo,npz} and manifest.json into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "manifest.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest = {"generator": "testdata/generate.py", "jax": jax.__version__,
                "adam": {"lr": LR, "b1": B1, "b2": B2, "eps": EPS}, "batch_size": BATCH,
                "models": {k: v for k, v in old.get("models", {}).items() if k in MODEL_NAMES}}
    for name in names:
        built = build(name)
        entry = {"description": built.model.description, "config": built.model.config,
                 "parameter_count": count_params(built.model.params),
                 "state_count": count_params(built.model.state), "modules": {}}
        for kind in ("train", "fwd"):
            stem = f"{name}_{kind}"
            text = hlo_text(lower_model(built, kind))
            args = built.train_args if kind == "train" else built.fwd_args
            flat_args = [np.asarray(a) for a in jax.tree_util.tree_leaves(args)]
            outs, seconds = run_model(built, kind, repeat=5)
            arrays = {f"arg{i}": a for i, a in enumerate(flat_args)}
            arrays.update({f"out{i}": a for i, a in enumerate(outs)})
            _write_if_changed(out_dir / f"{stem}.hlo", text.encode())
            npz_path = out_dir / f"{stem}.npz"
            write_npz(npz_path, arrays)
            entry["modules"][kind] = {
                "hlo": f"{stem}.hlo", "npz": f"{stem}.npz", "num_args": len(flat_args),
                "num_outputs": len(outs), "args": _layout(kind, args),
                "output": ("new params, new state, new opt_state (same order as the "
                           "arguments), loss" if kind == "train" else "model output")}
            if verbose:
                print(f"{stem:14s} hlo {len(text) / 1024:6.1f} KB  npz "
                      f"{npz_path.stat().st_size / 1024:7.1f} KB  args {len(flat_args):3d}  "
                      f"outs {len(outs):3d}  {seconds * 1e3:6.1f} ms/step on CPU")
        manifest["models"][name] = entry
        if verbose:
            print(f"{name}: {entry['parameter_count']} parameters"
                  + (f", {entry['state_count']} state values" if entry["state_count"] else ""))
    _write_if_changed(manifest_path,
                      (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return manifest


# =============================================================================================
# The GPT suite of the Alpa paper (lowered from shapes only)
# =============================================================================================

# name: (hidden, layers, heads); seq 1024, vocab 51200 for all (Alpa, OSDI'22, Table 4).
GPT_SUITE = {
    "350M": (1024, 24, 16),
    "760M": (1536, 24, 16),
    "1.3B": (2048, 24, 32),
    "2.6B": (2560, 32, 32),
    "6.7B": (4096, 32, 32),
    "15B": (5120, 48, 40),
    "39B": (8192, 48, 64),
}
SUITE_SEQ, SUITE_VOCAB = 1024, 51200


def gpt_suite_config(name: str, num_layers: int | None = None,
                     dtype: str = "float16") -> GPTConfig:
    if name not in GPT_SUITE:
        raise ValueError(f"unknown GPT suite model {name!r}; one of {', '.join(GPT_SUITE)}")
    hidden, layers, heads = GPT_SUITE[name]
    jnp.dtype(dtype)  # raises on an unknown dtype
    return GPTConfig(vocab=SUITE_VOCAB, seq=SUITE_SEQ, hidden=hidden, heads=heads,
                     layers=layers if num_layers is None else int(num_layers), dtype=str(dtype))


def gpt_suite_hlo(name: str, batch_size: int = 1024, num_layers: int | None = None,
                  dtype: str = "float16") -> str:
    """HLO text of one training step of the Alpa GPT suite model `name` (350M ... 39B).

    Same model and step as testdata/models/gpt_train.hlo (pre-LN, tied embedding, Adam with
    f32 master parameters and state, all of them donated), computing in `dtype`, with inputs
    tokens/labels s32[batch_size, 1024]. Lowered from jax.ShapeDtypeStruct: nothing is
    allocated, 39B lowers in seconds.
    """
    return gpt_train_hlo(gpt_suite_config(name, num_layers, dtype), batch_size,
                         f"gpt_{name.replace('.', '_')}_train")


def gpt_train_hlo(cfg: GPTConfig, batch_size: int, name: str = "gpt_train") -> str:
    """HLO text of a GPT training step of any configuration, lowered from abstract shapes."""
    spec = gpt_params(cfg)
    params = abstract(spec)
    opt_state = {"count": jax.ShapeDtypeStruct((), jnp.int32), "mu": abstract(spec),
                 "nu": abstract(spec)}
    tokens = jax.ShapeDtypeStruct((batch_size, cfg.seq), jnp.int32)
    batch = {"labels": tokens, "tokens": tokens}
    step = make_train_step(partial(gpt_loss, cfg), name)
    with _canonical():
        return hlo_text(jit_train(step).lower(params, {}, opt_state, batch))


def gpt_suite_parameter_count(name: str, num_layers: int | None = None) -> int:
    return count_params(gpt_params(gpt_suite_config(name, num_layers)))


# =============================================================================================

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpt-suite", metavar="NAME", choices=list(GPT_SUITE),
                    help="write one Alpa GPT suite training step: " + ", ".join(GPT_SUITE))
    ap.add_argument("--batch", type=int, default=1024, help="global batch size (GPT suite)")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (GPT suite)")
    ap.add_argument("--dtype", default="float16", help="compute dtype (GPT suite)")
    ap.add_argument("-o", "--output", type=Path, help="output .hlo file (GPT suite)")
    ap.add_argument("--out-dir", type=Path, default=MODELS_DIR,
                    help="directory for the test models (default: testdata/models)")
    ap.add_argument("--models", nargs="*", default=list(MODEL_NAMES), choices=MODEL_NAMES,
                    help="test models to write (default: all)")
    args = ap.parse_args(argv)
    if args.gpt_suite:
        if args.output is None:
            ap.error("--gpt-suite needs -o FILE.hlo")
        t0 = time.perf_counter()
        text = gpt_suite_hlo(args.gpt_suite, args.batch, args.layers, args.dtype)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        n = gpt_suite_parameter_count(args.gpt_suite, args.layers)
        print(f"{args.output}: GPT {args.gpt_suite} ({n / 1e9:.2f}B parameters), batch "
              f"{args.batch}, {args.dtype}, {len(text) / 1e6:.1f} MB of HLO in "
              f"{time.perf_counter() - t0:.1f} s")
        return 0
    generate_models(args.out_dir, tuple(args.models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
