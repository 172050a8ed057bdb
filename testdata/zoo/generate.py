"""A zoo of training steps and forward passes written by real front ends, with reference data.

    make zoo-generate                                   # .zoo-venv from the `zoo` extra, then:
    .zoo-venv/bin/python testdata/zoo/generate.py       # (re)write every program (deterministic)
    .zoo-venv/bin/python testdata/zoo/generate.py hf_gpt2_train hf_t5_train   # only these
    .zoo-venv/bin/python testdata/zoo/generate.py --list

testdata/generate.py writes alpac's own models by hand in plain jax; the programs here are what
the libraries people train with actually emit: Hugging Face Flax models (transformers 4.x, the
last series with Flax models) trained with optax, a TensorFlow/Keras step lowered by
`tf.function(jit_compile=True)`, and a PyTorch/XLA step. Nothing is downloaded from a model hub:
every model is randomly initialized from a small config written below. The generator's
dependencies are pinned exactly in pyproject.toml's `zoo` extra; they live in their own venv
(not alpac's .venv). The JAX programs are lowered with jax/jaxlib 0.10.2, the same release
alpac's .venv runs, so the reference data is what the HLO computes in .venv, bit for bit up to
XLA's fusion choices (`testdata/zoo/check_refs.py` checks it with .venv's jaxlib).

Files (`testdata/zoo/programs/<name>.hlo` + `.npz`, and `testdata/zoo/manifest.json`):

- `<name>.hlo`: HLO text exactly as the front end prints it.
  JAX:        `jax.jit(step, keep_unused=True).lower(*args).as_text(dialect="hlo")` (no donation,
              so there is no input_output_alias: the manifest says which arguments are state).
  TensorFlow: `tf.function(step, jit_compile=True).experimental_get_compiler_ir(*args)` at
              stage="hlo_serialized" (the HloModuleProto; stage="hlo" elides constants of more
              than 10 elements as `{...}`), printed with HloPrintOptions.print_large_constants.
  PyTorch/XLA: `torch_xla._XLAC._get_xla_tensors_hlo_proto(outputs)` printed the same way (its
              text form, `_get_xla_tensors_hlo`, elides large constants too).
  The protos are printed by this venv's jaxlib (`proto_to_text`, in a child process).
- `<name>.npz`: the entry parameters as arg0..argN and the flattened outputs as out0..outM, from
  running the front end's own compiled function on CPU (same convention as testdata/models).
  Inputs are seeded; parameters are the library's random init rounded to 4 significant bits,
  batch inputs and optimizer moments lie on a coarse binary grid, so the files compress and
  every input is exact in any float format. The zip timestamps are fixed: byte-reproducible.
- `manifest.json`: per program its front end and library versions, description, kind (train /
  fwd), num_args, num_outputs, the argument layout (which ranges are params / state / opt_state
  / batch / rng), the batch inputs with their batch dimension, whether it has batch-norm
  statistics, dropout and remat, the optimizer and the model config.

Calling convention of the JAX training steps (flat, jax pytree order: dict keys sorted):

    step(params, state, opt_state, batch[, rng]) -> (new params, new state, new opt_state, loss)

`state` is the batch-norm `batch_stats` (ResNet) and empty otherwise; `opt_state` is optax's
state, a few steps in (every `count` is 3, Adam's nu >= mu^2); `rng` is a raw uint32[2] PRNG key
(dropout). Forward programs are `forward(params, batch) -> logits`. Batch inputs have the batch
on dim 0. Token ids / labels are s32 (PyTorch/XLA: s64), floats f32.

Versions (pinned in pyproject.toml's `zoo` extra): jax/jaxlib 0.10.2 (the same as alpac's
.venv) with flax 0.12.8, optax 0.2.8, transformers 4.57.6; tensorflow-cpu 2.21.0 with keras
3.15.1; torch 2.9.0 with torch_xla 2.9.0 (torch_xla must match torch exactly, and 2.9.0 is its
newest release; torch 2.9.0 from PyPI pulls the CUDA runtime wheels, unused on CPU). Every
front end uses its own XLA; all of them are run by one JAX version. transformers' Flax T5 still
calls jnp.clip(x, a_max=...), which jax 0.10 removed: a shim maps it to jnp.clip(x, max=...)
(noted in the manifest). The s64/f64 parameters of the TensorFlow and PyTorch/XLA programs need
jax_enable_x64 in whatever feeds them through jax (check_refs.py turns it on).

Programs are generated in groups, one subprocess per front end (JAX, TensorFlow and
PyTorch/XLA each bundle their own XLA and are never imported into one process). A program whose
front end cannot be imported is skipped with its error. Each program's files and manifest entry
are written as soon as it is done.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from testdata.npz import write_npz  # noqa: E402

HERE = Path(__file__).resolve().parent
PROGRAMS_DIR = HERE / "programs"
MANIFEST = HERE / "manifest.json"

# AdamW everywhere (optax.adamw's defaults except the learning rate).
LR, WEIGHT_DECAY = 1e-3, 0.01


# =============================================================================================
# Shared helpers: values on a grid, npz, manifest
# =============================================================================================

def _grid(x: np.ndarray, scale: float, levels: int = 8) -> np.ndarray:
    """x * scale (x about unit scale) on a grid of step 2^k ~ scale/levels, clipped to +-4
    scale (as testdata/generate.py): few mantissa bits, exact in any float format."""
    step = 2.0 ** round(math.log2(scale / levels))
    limit = round(4 * scale / step)
    return (np.clip(np.round(x * scale / step), -limit, limit) * step).astype(np.float32)


def _round_bits(x: np.ndarray, bits: int = 4) -> np.ndarray:
    """Floats rounded to `bits` significant bits (zeros, ones and powers of two stay)."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        return x
    m, e = np.frexp(x.astype(np.float64))
    return np.ldexp(np.round(m * 2.0 ** bits) / 2.0 ** bits, e).astype(x.dtype)


def count_instructions(text: str) -> int:
    return sum(1 for line in text.splitlines()
               if re.match(r"\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*\S", line)
               and not line.lstrip().startswith(("HloModule", "ENTRY")))


def update_manifest(name: str, entry: dict | None) -> None:
    """Set (or with None remove) one program's entry; keys sorted, so the file is stable."""
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    manifest.setdefault("generator", "testdata/zoo/generate.py")
    manifest.setdefault("programs", {})
    manifest["note"] = ("Each program: <name>.hlo (HLO text as the front end prints it) and "
                        "<name>.npz (arg0..argN inputs, out0..outM flattened outputs of the "
                        "front end's own compiled function on CPU). See generate.py's docstring.")
    if entry is None:
        manifest["programs"].pop(name, None)
    else:
        manifest["programs"][name] = entry
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


@dataclass
class Program:
    """One program, as a front end builder returns it."""
    frontend: str                      # jax-flax | tensorflow | pytorch-xla
    kind: str                          # train | fwd
    description: str
    config: dict
    hlo: str
    args: list[np.ndarray]
    outputs: list[np.ndarray]
    layout: dict                       # role -> [start, end) of the entry parameters
    batch_inputs: dict                 # name -> {arg, batch_dim, shape, dtype}
    versions: dict
    optimizer: str | None = None
    batch_norm: bool = False
    dropout: bool = False
    remat: bool = False
    outputs_layout: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def proto_to_text(data: bytes) -> str:
    """HLO text of a serialized HloModuleProto with every constant printed in full (XLA's
    HloPrintOptions.print_large_constants), printed by the jaxlib of this venv in a child process
    (the TensorFlow and PyTorch/XLA workers never import jax)."""
    return subprocess.run([sys.executable, __file__, "--print-proto"], input=data,
                          capture_output=True, check=True).stdout.decode()


def _print_proto() -> int:
    from jax._src.lib import hlo
    options = hlo.HloPrintOptions()
    options.print_large_constants = True
    module = hlo.HloModule.from_serialized_hlo_module_proto(sys.stdin.buffer.read())
    sys.stdout.write(module.to_string(options))
    return 0


def save(name: str, p: Program) -> dict:
    PROGRAMS_DIR.mkdir(parents=True, exist_ok=True)
    hlo_path, npz_path = PROGRAMS_DIR / f"{name}.hlo", PROGRAMS_DIR / f"{name}.npz"
    data = p.hlo.encode()
    if not hlo_path.exists() or hlo_path.read_bytes() != data:
        hlo_path.write_bytes(data)
    arrays = {f"arg{i}": a for i, a in enumerate(p.args)}
    arrays.update({f"out{i}": a for i, a in enumerate(p.outputs)})
    write_npz(npz_path, arrays)
    entry = {
        "frontend": p.frontend, "versions": p.versions, "kind": p.kind,
        "description": p.description, "config": p.config, "optimizer": p.optimizer,
        "hlo": hlo_path.name, "npz": npz_path.name,
        "num_args": len(p.args), "num_outputs": len(p.outputs),
        "instructions": count_instructions(p.hlo),
        "args": p.layout, "outputs": p.outputs_layout, "batch_inputs": p.batch_inputs,
        "batch_norm_stats": p.batch_norm, "dropout": p.dropout, "remat": p.remat,
        "hlo_bytes": len(data), "npz_bytes": npz_path.stat().st_size,
    }
    if p.notes:
        entry["notes"] = p.notes
    update_manifest(name, entry)
    return entry


# =============================================================================================
# JAX / Flax (Hugging Face transformers 4.x Flax models + optax)
# =============================================================================================

SEQ, BATCH, VOCAB = 32, 8, 256
# The small transformer shape shared by most Hugging Face programs (GPT-2's is its own).
SMALL = dict(hidden=64, layers=2, heads=4, ff=256)


@dataclass
class JaxSpec:
    description: str
    config: dict
    fn: Callable               # step(params, state, opt_state, batch[, rng]) or fwd(params, batch)
    args: tuple                # pytrees of numpy arrays, in the order fn takes them
    roles: tuple[str, ...]     # a role per positional argument
    optimizer: str | None = None
    batch_norm: bool = False
    dropout: bool = False
    remat: bool = False
    notes: list[str] = field(default_factory=list)


def _jax_versions() -> dict:
    import importlib.metadata as md
    return {k: md.version(k) for k in ("jax", "jaxlib", "flax", "optax", "transformers")}


def _warm_opt_state(opt_state, rng: np.random.Generator):
    """optax state a few steps in: every count 3, Adam's mu on a grid, nu >= mu^2 + 2^-20 (the
    update stays well conditioned where a gradient is zero up to rounding)."""
    import jax
    import optax

    def fix(x):
        if isinstance(x, optax.ScaleByAdamState):
            mu = jax.tree_util.tree_map(
                lambda p: _grid(rng.standard_normal(np.shape(p)), 1e-3, 2), x.mu)
            nu = jax.tree_util.tree_map(
                lambda m: m * m + (1 + np.abs(_grid(rng.standard_normal(m.shape), 2.0, 1)))
                * np.float32(2.0 ** -20), mu)
            return x._replace(count=np.asarray(3, np.int32), mu=mu, nu=nu)
        return x

    opt_state = jax.tree_util.tree_map(
        fix, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))

    def count(path, x):
        last = path[-1] if path else None
        if getattr(last, "name", None) == "count":
            return np.asarray(3, np.asarray(x).dtype)
        return np.asarray(x)
    return jax.tree_util.tree_map_with_path(count, opt_state)


def _quantized(tree):
    import jax
    return jax.tree_util.tree_map(lambda x: _round_bits(np.asarray(x)), tree)


def _plain(tree):
    """FrozenDicts -> dicts (same leaves, same order)."""
    from flax.core import unfreeze
    return unfreeze(tree)


def run_jax_spec(spec: JaxSpec) -> Program:
    import jax
    flat_args = []
    layout: dict[str, list[int]] = {}
    batch_inputs: dict[str, dict] = {}
    for role, tree in zip(spec.roles, spec.args):
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
        layout[role] = [len(flat_args), len(flat_args) + len(leaves)]
        if role == "batch":
            for i, (k, v) in enumerate(sorted(tree.items())):
                v = np.asarray(v)
                batch_inputs[k] = {"arg": len(flat_args) + i, "batch_dim": 0,
                                   "shape": list(v.shape), "dtype": str(v.dtype)}
        flat_args += leaves
    jitted = jax.jit(spec.fn, keep_unused=True)
    with jax.enable_x64(False):
        hlo = jitted.lower(*spec.args).as_text(dialect="hlo")
        out = jax.block_until_ready(jitted(*spec.args))
    out_leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
    outputs_layout = {}
    if isinstance(out, tuple) and len(out) == 4:
        start = 0
        for role, tree in zip(("params", "state", "opt_state", "loss"), out):
            n = len(jax.tree_util.tree_leaves(tree))
            outputs_layout[role] = [start, start + n]
            start += n
    return Program(
        frontend="jax-flax", kind="train" if "opt_state" in spec.roles else "fwd",
        description=spec.description, config=spec.config, hlo=hlo, args=flat_args,
        outputs=out_leaves, layout=layout, batch_inputs=batch_inputs,
        versions=_jax_versions(), optimizer=spec.optimizer, batch_norm=spec.batch_norm,
        dropout=spec.dropout, remat=spec.remat, outputs_layout=outputs_layout,
        notes=spec.notes)


def _adamw():
    import optax
    return optax.adamw(LR, weight_decay=WEIGHT_DECAY)


ADAMW = f"optax.adamw(learning_rate={LR}, weight_decay={WEIGHT_DECAY})"


def _hf_train(model, loss_fn, batch, *, description, config, tx=None, optimizer=ADAMW,
              seed=0, state=None, dropout=False, remat=False, notes=(), params=None) -> JaxSpec:
    """A training step: loss_fn(params, state, batch[, rng]) -> (loss, new_state) and an optax
    update; step(params, state, opt_state, batch[, rng]) -> (params, state, opt_state, loss)."""
    import jax
    import optax
    tx = tx or _adamw()
    rng = np.random.default_rng(1000 + seed)
    params = _quantized(_plain(model.params) if params is None else params)
    state = _quantized(state) if state is not None else {}
    opt_state = _warm_opt_state(tx.init(params), rng)

    if dropout:
        def step(params, state, opt_state, batch, key):
            (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, state, batch, key)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), state, opt_state, loss
        args = (params, state, opt_state, batch, np.array([0, 42], np.uint32))
        roles = ("params", "state", "opt_state", "batch", "rng")
    else:
        def step(params, state, opt_state, batch):
            (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, state, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), state, opt_state, loss
        args = (params, state, opt_state, batch)
        roles = ("params", "state", "opt_state", "batch")
    return JaxSpec(description, config, step, args, roles, optimizer=optimizer,
                   batch_norm=bool(state), dropout=dropout, remat=remat, notes=list(notes))


def _hf_fwd(model, apply_fn, batch, *, description, config) -> JaxSpec:
    params = _quantized(_plain(model.params))
    return JaxSpec(description, config, apply_fn, (params, batch), ("params", "batch"))


def _ids(rng, batch=BATCH, seq=SEQ, vocab=VOCAB):
    return rng.integers(0, vocab, (batch, seq)).astype(np.int32)


def _padding_mask(rng, batch=BATCH, seq=SEQ):
    """1 for tokens, 0 for padding at the end of some rows."""
    lengths = rng.integers(seq // 2, seq + 1, batch)
    return (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)


def _ce(logits, labels, weights=None):
    import jax.numpy as jnp
    import optax
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    if weights is None:
        return jnp.mean(losses)
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _causal_lm(name: str, model_cls, config_obj, config: dict, description: str, *,
               batch=BATCH, seq=SEQ, vocab=VOCAB, seed=0, mask=False, **kw) -> JaxSpec:
    """Next-token cross-entropy on a decoder-only LM."""
    model = model_cls(config_obj, seed=seed, input_shape=(1, seq))
    rng = np.random.default_rng(seed)
    b = {"input_ids": _ids(rng, batch, seq, vocab)}
    if mask:
        b["attention_mask"] = _padding_mask(rng, batch, seq)

    import inspect
    # Most models take train=..., OPT takes deterministic=... (both default to no dropout).
    mode = {"train": False} if "train" in inspect.signature(model.__call__).parameters \
        else {"deterministic": True}

    def loss_fn(params, state, b):
        logits = model(b["input_ids"], attention_mask=b.get("attention_mask"),
                       params=params, **mode).logits
        w = None if "attention_mask" not in b else b["attention_mask"][:, 1:]
        return _ce(logits[:, :-1], b["input_ids"][:, 1:], w), state
    cfg = dict(config, batch=batch, seq=seq, model=model_cls.__name__)
    return _hf_train(model, loss_fn, b, description=description, config=cfg, seed=seed, **kw)


def _mlm_batch(rng, batch=BATCH, seq=SEQ, vocab=VOCAB):
    ids = _ids(rng, batch, seq, vocab)
    weights = (rng.random((batch, seq)) < 0.15).astype(np.float32)
    weights[:, 0] = 1.0
    return {"input_ids": ids, "attention_mask": _padding_mask(rng, batch, seq),
            "labels": _ids(rng, batch, seq, vocab), "label_weights": weights}


def _mlm_train(model, config: dict, description: str, *, seed=0, **kw) -> JaxSpec:
    rng = np.random.default_rng(seed)
    b = _mlm_batch(rng)

    def loss_fn(params, state, b, key=None):
        out = model(b["input_ids"], attention_mask=b["attention_mask"], params=params,
                    dropout_rng=key, train=key is not None)
        return _ce(out.logits, b["labels"], b["label_weights"]), state
    cfg = dict(config, batch=BATCH, seq=SEQ, model=type(model).__name__)
    return _hf_train(model, loss_fn, b, description=description, config=cfg, seed=seed, **kw)


def _bert_config(**kw):
    from transformers import BertConfig
    return BertConfig(vocab_size=VOCAB, hidden_size=SMALL["hidden"],
                      num_hidden_layers=SMALL["layers"], num_attention_heads=SMALL["heads"],
                      intermediate_size=SMALL["ff"], max_position_embeddings=SEQ, **kw)


def _small_cfg(**extra) -> dict:
    return dict(vocab=VOCAB, **SMALL, **extra)


# ---- the programs ---------------------------------------------------------------------------

GPT2_CFG = dict(n_layer=4, n_embd=256, n_head=8, vocab_size=1024, n_positions=128)


def hf_gpt2_train() -> JaxSpec:
    from transformers import FlaxGPT2LMHeadModel, GPT2Config
    return _causal_lm(
        "hf_gpt2_train", FlaxGPT2LMHeadModel, GPT2Config(**GPT2_CFG), dict(GPT2_CFG),
        "Hugging Face FlaxGPT2LMHeadModel (4 layers, n_embd 256, 8 heads, vocab 1024, seq 128, "
        "batch 16), next-token cross-entropy, optax AdamW; dropout off (train=False)",
        batch=16, seq=128, vocab=1024)


def hf_gpt2_dropout_clip_sched_train() -> JaxSpec:
    import optax
    from transformers import FlaxGPT2LMHeadModel, GPT2Config
    cfg = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
               resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = FlaxGPT2LMHeadModel(GPT2Config(**cfg), seed=0, input_shape=(1, SEQ))
    rng = np.random.default_rng(4)
    b = {"input_ids": _ids(rng)}
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, warmup_steps=10, decay_steps=100)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, weight_decay=WEIGHT_DECAY))

    def loss_fn(params, state, b, key):
        logits = model(b["input_ids"], params=params, dropout_rng=key, train=True).logits
        return _ce(logits[:, :-1], b["input_ids"][:, 1:]), state
    return _hf_train(
        model, loss_fn, b, tx=tx, dropout=True, seed=4,
        optimizer=("optax.chain(clip_by_global_norm(1.0), adamw(warmup_cosine_decay_schedule("
                   f"0, {LR}, warmup 10, decay 100), weight_decay={WEIGHT_DECAY}))"),
        config=dict(cfg, batch=BATCH, seq=SEQ, model="FlaxGPT2LMHeadModel"),
        description="FlaxGPT2LMHeadModel with dropout 0.1 (train=True, the PRNG key is the "
                    "last argument), global-norm clipping and a warmup-cosine learning-rate "
                    "schedule (opt_state counts at 3)")


def hf_bert_mlm_train() -> JaxSpec:
    from transformers import FlaxBertForMaskedLM
    model = FlaxBertForMaskedLM(_bert_config(), seed=1, input_shape=(1, SEQ))
    return _mlm_train(model, _small_cfg(), "FlaxBertForMaskedLM, masked-LM cross-entropy over "
                      "weighted positions, padding attention mask, AdamW", seed=1)


def hf_bert_remat_train() -> JaxSpec:
    from transformers import FlaxBertForMaskedLM
    model = FlaxBertForMaskedLM(_bert_config(), seed=1, input_shape=(1, SEQ),
                                gradient_checkpointing=True)
    return _mlm_train(model, _small_cfg(gradient_checkpointing=True),
                      "hf_bert_mlm_train's model built with gradient_checkpointing=True "
                      "(flax nn.remat per layer: opt-barrier in the HLO)", seed=1, remat=True)


def hf_bert_fwd() -> JaxSpec:
    from transformers import FlaxBertForMaskedLM
    model = FlaxBertForMaskedLM(_bert_config(), seed=1, input_shape=(1, SEQ))
    rng = np.random.default_rng(1)
    b = _mlm_batch(rng)
    b = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}

    def fwd(params, b):
        return model(b["input_ids"], attention_mask=b["attention_mask"], params=params,
                     train=False).logits
    return _hf_fwd(model, fwd, b, config=dict(_small_cfg(), batch=BATCH, seq=SEQ,
                                              model="FlaxBertForMaskedLM"),
                   description="forward pass (MLM logits) of hf_bert_mlm_train's model")


def hf_roberta_mlm_train() -> JaxSpec:
    from transformers import FlaxRobertaForMaskedLM, RobertaConfig
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=SMALL["hidden"],
                        num_hidden_layers=SMALL["layers"], num_attention_heads=SMALL["heads"],
                        intermediate_size=SMALL["ff"], max_position_embeddings=SEQ + 2,
                        pad_token_id=1)
    model = FlaxRobertaForMaskedLM(cfg, seed=5, input_shape=(1, SEQ))
    return _mlm_train(model, _small_cfg(), "FlaxRobertaForMaskedLM (position ids from the "
                      "padding mask), masked-LM cross-entropy, AdamW", seed=5)


def hf_electra_train() -> JaxSpec:
    from transformers import ElectraConfig, FlaxElectraForPreTraining
    cfg = ElectraConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=SMALL["hidden"],
                        num_hidden_layers=SMALL["layers"], num_attention_heads=SMALL["heads"],
                        intermediate_size=SMALL["ff"], max_position_embeddings=SEQ)
    model = FlaxElectraForPreTraining(cfg, seed=6, input_shape=(1, SEQ))
    rng = np.random.default_rng(6)
    b = {"input_ids": _ids(rng), "attention_mask": _padding_mask(rng),
         "labels": (rng.random((BATCH, SEQ)) < 0.15).astype(np.float32)}

    def loss_fn(params, state, b):
        import jax.numpy as jnp
        import optax
        logits = model(b["input_ids"], attention_mask=b["attention_mask"], params=params,
                       train=False).logits
        w = b["attention_mask"].astype(jnp.float32)
        loss = optax.sigmoid_binary_cross_entropy(logits, b["labels"])
        return jnp.sum(loss * w) / jnp.sum(w), state
    return _hf_train(model, loss_fn, b, seed=6,
                     config=dict(_small_cfg(embedding_size=32), batch=BATCH, seq=SEQ,
                                 model="FlaxElectraForPreTraining"),
                     description="FlaxElectraForPreTraining (the discriminator: embedding 32 "
                                 "projected to hidden 64), replaced-token-detection sigmoid "
                                 "cross-entropy over non-padding tokens, AdamW")


def hf_gpt_neo_train() -> JaxSpec:
    from transformers import FlaxGPTNeoForCausalLM, GPTNeoConfig
    cfg = dict(vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=SMALL["hidden"],
               num_layers=2, num_heads=SMALL["heads"], intermediate_size=SMALL["ff"],
               attention_types=[[["global", "local"], 1]], window_size=8)
    return _causal_lm("hf_gpt_neo_train", FlaxGPTNeoForCausalLM, GPTNeoConfig(**cfg), cfg,
                      "FlaxGPTNeoForCausalLM: a global and a local (window 8) attention layer, "
                      "next-token cross-entropy, AdamW", seed=7)


def hf_gptj_train() -> JaxSpec:
    from transformers import FlaxGPTJForCausalLM, GPTJConfig
    cfg = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=SMALL["hidden"], n_layer=2,
               n_head=SMALL["heads"], rotary_dim=8, n_inner=SMALL["ff"])
    return _causal_lm("hf_gptj_train", FlaxGPTJForCausalLM, GPTJConfig(**cfg), cfg,
                      "FlaxGPTJForCausalLM: parallel attention + MLP, rotary embeddings on 8 "
                      "of 16 head dims, next-token cross-entropy, AdamW", seed=8)


def hf_opt_train() -> JaxSpec:
    from transformers import FlaxOPTForCausalLM, OPTConfig
    cfg = dict(vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=SMALL["hidden"],
               num_hidden_layers=2, num_attention_heads=SMALL["heads"], ffn_dim=SMALL["ff"],
               word_embed_proj_dim=SMALL["hidden"])
    return _causal_lm("hf_opt_train", FlaxOPTForCausalLM, OPTConfig(**cfg), cfg,
                      "FlaxOPTForCausalLM with a padding attention mask (learned positions "
                      "from the mask's cumsum), next-token cross-entropy over tokens, AdamW",
                      seed=9, mask=True)


def hf_llama_train() -> JaxSpec:
    from transformers import FlaxLlamaForCausalLM, LlamaConfig
    cfg = dict(vocab_size=VOCAB, hidden_size=SMALL["hidden"], intermediate_size=172,
               num_hidden_layers=2, num_attention_heads=SMALL["heads"], num_key_value_heads=2,
               max_position_embeddings=SEQ)
    return _causal_lm("hf_llama_train", FlaxLlamaForCausalLM, LlamaConfig(**cfg), cfg,
                      "FlaxLlamaForCausalLM: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-"
                      "query attention (4 heads, 2 KV heads), next-token cross-entropy, AdamW",
                      seed=10)


def hf_mistral_train() -> JaxSpec:
    from transformers import FlaxMistralForCausalLM, MistralConfig
    cfg = dict(vocab_size=VOCAB, hidden_size=SMALL["hidden"], intermediate_size=172,
               num_hidden_layers=2, num_attention_heads=SMALL["heads"], num_key_value_heads=2,
               max_position_embeddings=SEQ, sliding_window=16)
    return _causal_lm("hf_mistral_train", FlaxMistralForCausalLM, MistralConfig(**cfg), cfg,
                      "FlaxMistralForCausalLM: like Llama with sliding-window (16) causal "
                      "attention, GQA 4/2, next-token cross-entropy, AdamW", seed=11)


def hf_gemma_train() -> JaxSpec:
    from transformers import FlaxGemmaForCausalLM, GemmaConfig
    cfg = dict(vocab_size=VOCAB, hidden_size=SMALL["hidden"], intermediate_size=SMALL["ff"],
               num_hidden_layers=2, num_attention_heads=SMALL["heads"], num_key_value_heads=1,
               head_dim=16, max_position_embeddings=SEQ)
    return _causal_lm("hf_gemma_train", FlaxGemmaForCausalLM, GemmaConfig(**cfg), cfg,
                      "FlaxGemmaForCausalLM: RMSNorm (1 + w), GeGLU MLP, multi-query "
                      "attention, embedding scaled by sqrt(hidden) and tied to the output, "
                      "next-token cross-entropy, AdamW", seed=12)


def _seq2seq_batch(rng, vocab=VOCAB, tgt=SEQ // 2):
    labels = _ids(rng, BATCH, tgt, vocab)
    return {"input_ids": _ids(rng, vocab=vocab), "attention_mask": _padding_mask(rng),
            "decoder_input_ids": np.concatenate(
                [np.zeros((BATCH, 1), np.int32), labels[:, :-1]], axis=1),
            "labels": labels}


def _jnp_clip_shim():
    """transformers' Flax T5 calls jnp.clip(x, a_max=...); jax 0.10 removed the a_min/a_max
    spelling (the same function under min/max). Lowers to exactly what jnp.clip(x, max=...)
    does."""
    import jax.numpy as jnp
    if getattr(jnp.clip, "_zoo_shim", False):
        return
    clip = jnp.clip

    def shim(x, min=None, max=None, *, a_min=None, a_max=None):
        return clip(x, a_min if min is None else min, a_max if max is None else max)
    shim._zoo_shim = True
    jnp.clip = shim


T5_NOTE = ("jnp.clip(x, a_max=...) in transformers' Flax T5 is shimmed to jnp.clip(x, max=...) "
           "(jax 0.10 removed the a_min/a_max keywords); the lowering is the same")


def hf_t5_train() -> JaxSpec:
    _jnp_clip_shim()
    from transformers import FlaxT5ForConditionalGeneration, T5Config
    cfg = dict(vocab_size=VOCAB, d_model=SMALL["hidden"], d_kv=16, d_ff=SMALL["ff"],
               num_layers=2, num_decoder_layers=2, num_heads=SMALL["heads"],
               relative_attention_num_buckets=8, decoder_start_token_id=0)
    model = FlaxT5ForConditionalGeneration(T5Config(**cfg), seed=2, input_shape=(1, SEQ))
    b = _seq2seq_batch(np.random.default_rng(2))

    def loss_fn(params, state, b):
        logits = model(b["input_ids"], attention_mask=b["attention_mask"],
                       decoder_input_ids=b["decoder_input_ids"], params=params,
                       train=False).logits
        return _ce(logits, b["labels"]), state
    return _hf_train(model, loss_fn, b, seed=2,
                     config=dict(cfg, batch=BATCH, src_seq=SEQ, tgt_seq=SEQ // 2,
                                 model="FlaxT5ForConditionalGeneration"),
                     description="FlaxT5ForConditionalGeneration (2+2 layers, relative "
                                 "position buckets, tied embeddings), teacher-forced "
                                 "cross-entropy on 16 target tokens, AdamW",
                     notes=[T5_NOTE])


def hf_t5_fwd() -> JaxSpec:
    from transformers import FlaxT5ForConditionalGeneration, T5Config
    spec = hf_t5_train()
    model = FlaxT5ForConditionalGeneration(T5Config(**{k: v for k, v in spec.config.items()
                                                        if k not in ("batch", "src_seq",
                                                                     "tgt_seq", "model")}),
                                           seed=2, input_shape=(1, SEQ))
    b = {k: v for k, v in spec.args[3].items() if k != "labels"}

    def fwd(params, b):
        return model(b["input_ids"], attention_mask=b["attention_mask"],
                     decoder_input_ids=b["decoder_input_ids"], params=params,
                     train=False).logits
    spec = _hf_fwd(model, fwd, b, config=spec.config,
                   description="forward pass (decoder logits) of hf_t5_train's model")
    spec.notes.append(T5_NOTE)
    return spec


def hf_bart_train() -> JaxSpec:
    from transformers import BartConfig, FlaxBartForConditionalGeneration
    cfg = dict(vocab_size=VOCAB, d_model=SMALL["hidden"], encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=SMALL["heads"], decoder_attention_heads=SMALL["heads"],
               encoder_ffn_dim=SMALL["ff"], decoder_ffn_dim=SMALL["ff"],
               max_position_embeddings=SEQ)
    model = FlaxBartForConditionalGeneration(BartConfig(**cfg), seed=13, input_shape=(1, SEQ))
    b = _seq2seq_batch(np.random.default_rng(13))

    def loss_fn(params, state, b):
        logits = model(b["input_ids"], attention_mask=b["attention_mask"],
                       decoder_input_ids=b["decoder_input_ids"], params=params,
                       train=False).logits
        return _ce(logits, b["labels"]), state
    return _hf_train(model, loss_fn, b, seed=13,
                     config=dict(cfg, batch=BATCH, src_seq=SEQ, tgt_seq=SEQ // 2,
                                 model="FlaxBartForConditionalGeneration"),
                     description="FlaxBartForConditionalGeneration (2+2 layers, learned "
                                 "positions, final logits bias), teacher-forced cross-entropy, "
                                 "AdamW")


def _image_batch(rng, size=32, channels=3, classes=10):
    return {"pixel_values": _grid(rng.standard_normal((BATCH, channels, size, size)), 1.0),
            "labels": rng.integers(0, classes, BATCH).astype(np.int32)}


def _image_train(model, b, *, seed, config, description, state=None, bn=False, params=None):
    def loss_fn(params, state, b):
        if bn:
            out, new = model(b["pixel_values"], params={"params": params, **state}, train=True)
            return _ce(out.logits, b["labels"]), _plain(new)
        logits = model(b["pixel_values"], params=params, train=False).logits
        return _ce(logits, b["labels"]), state
    return _hf_train(model, loss_fn, b, seed=seed, state=state, config=config,
                     description=description, params=params)


def hf_vit_train() -> JaxSpec:
    from transformers import FlaxViTForImageClassification, ViTConfig
    cfg = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=SMALL["hidden"],
               num_hidden_layers=2, num_attention_heads=SMALL["heads"],
               intermediate_size=SMALL["ff"], num_labels=10)
    model = FlaxViTForImageClassification(ViTConfig(**cfg), seed=14)
    return _image_train(model, _image_batch(np.random.default_rng(14)), seed=14,
                        config=dict(cfg, batch=BATCH, model="FlaxViTForImageClassification"),
                        description="FlaxViTForImageClassification (32x32 images NCHW, 8x8 "
                                    "patches, CLS token), 10-class cross-entropy, AdamW")


def hf_vit_fwd() -> JaxSpec:
    from transformers import FlaxViTForImageClassification, ViTConfig
    spec = hf_vit_train()
    cfg = {k: v for k, v in spec.config.items() if k not in ("batch", "model")}
    model = FlaxViTForImageClassification(ViTConfig(**cfg), seed=14)
    b = {"pixel_values": spec.args[3]["pixel_values"]}

    def fwd(params, b):
        return model(b["pixel_values"], params=params, train=False).logits
    return _hf_fwd(model, fwd, b, config=spec.config,
                   description="forward pass (class logits) of hf_vit_train's model")


def hf_beit_train() -> JaxSpec:
    from transformers import BeitConfig, FlaxBeitForImageClassification
    cfg = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=SMALL["hidden"],
               num_hidden_layers=2, num_attention_heads=SMALL["heads"],
               intermediate_size=SMALL["ff"], num_labels=10,
               use_relative_position_bias=True, use_mean_pooling=True, layer_scale_init_value=0.1)
    model = FlaxBeitForImageClassification(BeitConfig(**cfg), seed=15)
    return _image_train(model, _image_batch(np.random.default_rng(15)), seed=15,
                        config=dict(cfg, batch=BATCH, model="FlaxBeitForImageClassification"),
                        description="FlaxBeitForImageClassification (relative position bias, "
                                    "layer scale, mean pooling), 10-class cross-entropy, AdamW")


def hf_resnet_train() -> JaxSpec:
    from transformers import FlaxResNetForImageClassification, ResNetConfig
    cfg = dict(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 128],
               depths=[1, 1, 1, 1], layer_type="basic", num_labels=10)
    model = FlaxResNetForImageClassification(ResNetConfig(**cfg), seed=16,
                                             input_shape=(1, 32, 32, 3))
    full = _plain(model.params)
    return _image_train(model, _image_batch(np.random.default_rng(16)), seed=16, bn=True,
                        params=full["params"], state={"batch_stats": full["batch_stats"]},
                        config=dict(cfg, batch=BATCH, model="FlaxResNetForImageClassification"),
                        description="FlaxResNetForImageClassification (basic blocks, depths "
                                    "1-1-1-1, widths 16-128, batch norm in training mode: the "
                                    "step returns the updated batch_stats as `state`), "
                                    "10-class cross-entropy, AdamW")


# ---- layers applied by a loop (Flax nn.scan), and the same model unrolled ------------------
#
# Production JAX code (MaxText, Praxis, Levanter) stacks its layers' weights on a leading axis
# and applies them with a scan: one `while` in the forward, one in the backward. The unrolled
# twin is the same model and the same weights (the stacked arrays cut along the layer axis),
# written as a Python loop: plans of the two should not differ.

SCAN_LM = dict(SMALL, layers=6, vocab=VOCAB, seq=SEQ, batch=BATCH)


def _scan_lm_module(scan: bool, remat: bool, dropout: float = 0.0):
    import flax.linen as nn
    import jax.numpy as jnp
    cfg = SCAN_LM

    class Block(nn.Module):
        """Pre-LN decoder block: causal self-attention and a GELU MLP, residuals around both;
        with `dropout`, on the attention probabilities and after each residual branch."""

        @nn.compact
        def __call__(self, x, _):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            h = nn.SelfAttention(num_heads=cfg["heads"], deterministic=not dropout,
                                 dropout_rate=dropout,
                                 name="attention")(nn.LayerNorm(name="ln1")(x), mask=mask)
            x = x + nn.Dropout(dropout, deterministic=not dropout)(h)
            h = nn.Dense(cfg["ff"], name="fc_in")(nn.LayerNorm(name="ln2")(x))
            h = nn.Dense(cfg["hidden"], name="fc_out")(nn.gelu(h))
            return x + nn.Dropout(dropout, deterministic=not dropout)(h), None

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            embed = nn.Embed(cfg["vocab"], cfg["hidden"], name="embed")
            pos = self.param("positions", nn.initializers.normal(0.02),
                             (cfg["seq"], cfg["hidden"]))
            x = embed(ids) + pos[None, : ids.shape[1]]
            block = nn.remat(Block) if remat else Block
            if scan:
                x, _ = nn.scan(block, variable_axes={"params": 0},
                               split_rngs={"params": True, "dropout": True},
                               length=cfg["layers"])(name="layers")(x, None)
            else:
                for k in range(cfg["layers"]):
                    x, _ = block(name=f"layer_{k}")(x, None)
            return embed.attend(nn.LayerNorm(name="ln_f")(x))  # tied output embedding
    return LM()


def _scan_lm_params():
    """The scanned model's weights (layers stacked on axis 0), rounded like every zoo input."""
    import jax
    ids = np.zeros((1, SCAN_LM["seq"]), np.int32)
    return _quantized(_plain(_scan_lm_module(True, False).init(jax.random.PRNGKey(7), ids)))


def _unstacked(params):
    """The scanned model's weights as the unrolled model names them: layer k is slice k."""
    import jax
    out = {k: v for k, v in params["params"].items() if k != "layers"}
    for k in range(SCAN_LM["layers"]):
        out[f"layer_{k}"] = jax.tree_util.tree_map(lambda a: np.asarray(a)[k],
                                                   params["params"]["layers"])
    return {"params": out}


def _scan_lm(scan: bool, remat: bool, train: bool) -> JaxSpec:
    model = _scan_lm_module(scan, remat)
    params = _scan_lm_params() if scan else _unstacked(_scan_lm_params())
    rng = np.random.default_rng(11)
    batch = {"input_ids": _ids(rng, SCAN_LM["batch"], SCAN_LM["seq"], SCAN_LM["vocab"])}
    how = ("Flax nn.scan over the blocks (weights stacked on a leading layer axis: a while "
           "loop in the forward and one in the backward)" if scan else
           "the blocks applied by a Python loop (the scanned programs' model and weights, "
           "unrolled)")
    description = (f"Pre-LN decoder LM ({SCAN_LM['layers']} blocks, hidden {SCAN_LM['hidden']}"
                   f", {SCAN_LM['heads']} heads, tied embedding), {how}"
                   + (", nn.remat around each block (opt-barrier in the loop body)"
                      if remat else ""))
    config = dict(SCAN_LM, scan=scan, remat=remat, model="flax.linen decoder LM")
    if not train:
        return JaxSpec(description, config, lambda p, b: model.apply(p, b["input_ids"]),
                       (params, batch), ("params", "batch"), remat=remat)

    def loss_fn(params, state, b):
        logits = model.apply(params, b["input_ids"])
        return _ce(logits[:, :-1], b["input_ids"][:, 1:]), state
    return _hf_train(None, loss_fn, batch, description=description + ", next-token "
                     "cross-entropy, optax AdamW", config=config, seed=11, remat=remat,
                     params=params)


def flax_scan_lm_train() -> JaxSpec:
    return _scan_lm(scan=True, remat=False, train=True)


def flax_scan_remat_lm_train() -> JaxSpec:
    return _scan_lm(scan=True, remat=True, train=True)


def flax_unrolled_lm_train() -> JaxSpec:
    return _scan_lm(scan=False, remat=False, train=True)


def flax_unrolled_remat_lm_train() -> JaxSpec:
    return _scan_lm(scan=False, remat=True, train=True)


def flax_scan_lm_fwd() -> JaxSpec:
    return _scan_lm(scan=True, remat=False, train=False)


def flax_scan_dropout_lm_train() -> JaxSpec:
    """The scanned LM trained with dropout: the raw uint32[2] key is split per layer inside
    the loop (split_rngs), a step input that is not a batch and not state."""
    model = _scan_lm_module(True, False, dropout=0.1)
    rng = np.random.default_rng(13)
    batch = {"input_ids": _ids(rng, SCAN_LM["batch"], SCAN_LM["seq"], SCAN_LM["vocab"])}

    def loss_fn(params, state, b, key):
        logits = model.apply(params, b["input_ids"], rngs={"dropout": key})
        return _ce(logits[:, :-1], b["input_ids"][:, 1:]), state
    description = (f"Pre-LN decoder LM ({SCAN_LM['layers']} blocks, hidden {SCAN_LM['hidden']}"
                   f", {SCAN_LM['heads']} heads, tied embedding), Flax nn.scan over the blocks "
                   "with dropout 0.1 (attention and residual branches, the key split per layer "
                   "in the loop), next-token cross-entropy, optax AdamW")
    config = dict(SCAN_LM, scan=True, remat=False, dropout=0.1, model="flax.linen decoder LM")
    return _hf_train(None, loss_fn, batch, description=description, config=config, seed=13,
                     dropout=True, params=_scan_lm_params())


JAX_PROGRAMS: dict[str, Callable[[], JaxSpec]] = {
    "hf_gpt2_train": hf_gpt2_train,
    "hf_bert_mlm_train": hf_bert_mlm_train,
    "hf_t5_train": hf_t5_train,
    "hf_gpt_neo_train": hf_gpt_neo_train,
    "hf_gptj_train": hf_gptj_train,
    "hf_opt_train": hf_opt_train,
    "hf_llama_train": hf_llama_train,
    "hf_mistral_train": hf_mistral_train,
    "hf_gemma_train": hf_gemma_train,
    "hf_bart_train": hf_bart_train,
    "hf_roberta_mlm_train": hf_roberta_mlm_train,
    "hf_electra_train": hf_electra_train,
    "hf_vit_train": hf_vit_train,
    "hf_beit_train": hf_beit_train,
    "hf_resnet_train": hf_resnet_train,
    "hf_gpt2_dropout_clip_sched_train": hf_gpt2_dropout_clip_sched_train,
    "hf_bert_remat_train": hf_bert_remat_train,
    "hf_bert_fwd": hf_bert_fwd,
    "hf_t5_fwd": hf_t5_fwd,
    "hf_vit_fwd": hf_vit_fwd,
    "flax_scan_lm_train": flax_scan_lm_train,
    "flax_scan_remat_lm_train": flax_scan_remat_lm_train,
    "flax_unrolled_lm_train": flax_unrolled_lm_train,
    "flax_unrolled_remat_lm_train": flax_unrolled_remat_lm_train,
    "flax_scan_lm_fwd": flax_scan_lm_fwd,
    "flax_scan_dropout_lm_train": flax_scan_dropout_lm_train,
}


def build_jax(name: str) -> Program:
    import logging
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import warnings
    warnings.filterwarnings("ignore")
    p = run_jax_spec(JAX_PROGRAMS[name]())
    if p.remat and "opt-barrier" not in p.hlo:
        raise RuntimeError(f"{name}: remat requested but the HLO has no opt-barrier")
    return p


# =============================================================================================
# TensorFlow / Keras 3: tf.function(jit_compile=True)
# =============================================================================================
#
# A Keras training step the usual way: model(x, training=True) under a GradientTape and
# optimizer.apply_gradients on the model's variables. The variables are captured resources:
# TF's XLA bridge makes them entry parameters after the function's own arguments (in the
# concrete function's captured_inputs order) and returns every variable the step writes after
# the function's outputs, with input_output_alias (may-alias) from output to parameter.

def _tf_versions() -> dict:
    import importlib.metadata as md
    return {k: md.version(k) for k in ("tensorflow-cpu", "keras")}


def _keras_program(build_model, batch: dict, *, seed: int, description: str, config: dict,
                   batch_norm: bool) -> Program:
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    model = build_model(keras)
    opt = keras.optimizers.AdamW(learning_rate=LR, weight_decay=WEIGHT_DECAY)
    opt.build(model.trainable_variables)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Inputs on a grid (see the module docstring); the optimizer a few steps in.
    for v in model.variables:
        value = np.asarray(v.numpy())
        if v.path.endswith("moving_variance"):
            value = 1.0 + np.abs(_grid(rng.standard_normal(value.shape), 0.25))
        elif v.path.endswith("moving_mean"):
            value = _grid(rng.standard_normal(value.shape), 0.25)
        v.assign(_round_bits(value))
    moments = {}
    for v in opt.variables:
        if v.path.endswith("iteration"):
            v.assign(3)
        elif v.path.endswith("_momentum"):
            moments[v.path[:-len("_momentum")]] = m = _grid(rng.standard_normal(v.shape), 1e-3, 2)
            v.assign(m)
    for v in opt.variables:
        if v.path.endswith("_velocity"):
            m = moments[v.path[:-len("_velocity")]]
            v.assign(m * m + (1 + np.abs(_grid(rng.standard_normal(v.shape), 2.0, 1)))
                     * np.float32(2.0 ** -20))

    names = sorted(batch)
    x, y = (tf.constant(batch[k]) for k in names)

    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            if len(logits.shape) == 3:          # LM: next-token targets
                loss = loss_obj(y[:, 1:], logits[:, :-1])
            else:
                loss = loss_obj(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    fn = tf.function(step, jit_compile=True)
    # stage="hlo" elides constants of more than 10 elements ({...}); the serialized
    # HloModuleProto has them all, printed in full by proto_to_text.
    hlo = proto_to_text(fn.experimental_get_compiler_ir(x, y)(stage="hlo_serialized"))
    captured = fn.get_concrete_function(x, y).captured_inputs
    by_handle = {id(v.value.handle): v for v in list(model.variables) + list(opt.variables)}
    # A captured input is a variable's resource handle or a captured constant tensor.
    variables = [by_handle.get(id(c), c) for c in captured]
    trainable = {id(v) for v in model.trainable_variables}

    def role(v):
        if id(v) in trainable:
            return "params"
        if not hasattr(v, "path"):
            return "constant"
        return "opt_state" if v.path.startswith(opt.name) else "state"
    def value(v):   # the tf.Variable's own value (Keras reports the s64 iteration as int32)
        v = getattr(v, "value", v)
        return np.asarray(v.numpy(), dtype=v.dtype.as_numpy_dtype)
    args = [batch[k] for k in names] + [value(v) for v in variables]
    arg_names = names + [getattr(v, "path", f"captured_constant_{i}")
                         for i, v in enumerate(variables)]
    arg_roles = ["batch"] * len(names) + [role(v) for v in variables]
    alias = {int(o): int(p) for o, p in re.findall(r"\{(\d+)\}: \((\d+), \{\}",
                                                   hlo.split("\n", 1)[0])}
    loss = np.asarray(fn(x, y).numpy())
    n_out = 1 + len(alias)
    if sorted(alias) != list(range(1, n_out)):
        raise RuntimeError(f"unexpected TF output layout: {alias}")
    outputs = [loss] + [value(variables[alias[k] - len(names)]) for k in range(1, n_out)]
    output_names = ["loss"] + [arg_names[alias[k]] for k in range(1, n_out)]
    return Program(
        frontend="tensorflow", kind="train", description=description, config=config, hlo=hlo,
        args=args, outputs=outputs,
        layout={"batch": [0, len(names)], "variables": [len(names), len(args)],
                "names": arg_names, "roles": arg_roles},
        outputs_layout={"names": output_names, "aliases": {str(k): v for k, v in alias.items()}},
        batch_inputs={k: {"arg": i, "batch_dim": 0, "shape": list(batch[k].shape),
                          "dtype": str(batch[k].dtype)} for i, k in enumerate(names)},
        versions=_tf_versions(), batch_norm=batch_norm,
        optimizer=f"keras.optimizers.AdamW(learning_rate={LR}, weight_decay={WEIGHT_DECAY})",
        notes=["variables are captured resources: entry parameters after the batch inputs "
               "(args.names / args.roles say which), the step's outputs are the loss and then "
               "every variable it writes (input_output_alias, may-alias); the learning rate is "
               "a variable the step reads but does not write"])


def tf_keras_cnn_train() -> Program:
    def build(keras):
        L = keras.layers
        return keras.Sequential([
            keras.Input((16, 16, 3)),
            L.Conv2D(16, 3, padding="same", use_bias=False), L.BatchNormalization(), L.ReLU(),
            L.MaxPooling2D(),
            L.Conv2D(32, 3, padding="same", use_bias=False), L.BatchNormalization(), L.ReLU(),
            L.GlobalAveragePooling2D(), L.Dense(10)], name="cnn")
    rng = np.random.default_rng(20)
    batch = {"images": _grid(rng.standard_normal((BATCH, 16, 16, 3)), 1.0),
             "labels": rng.integers(0, 10, BATCH).astype(np.int32)}
    return _keras_program(
        build, batch, seed=20, batch_norm=True,
        config={"image": [16, 16, 3], "conv": [16, 32], "classes": 10, "batch": BATCH},
        description="Keras 3 (TensorFlow backend) CNN: 2x (Conv2D 3x3, BatchNormalization in "
                    "training mode, ReLU), max-pool, global average pool, Dense(10); sparse "
                    "categorical cross-entropy; keras AdamW; BN moving stats are written")


def tf_keras_transformer_train() -> Program:
    # seq 16: TF constant-folds the causal mask to pred[batch, heads, seq, seq] literals.
    hidden, heads, layers, ff, seq = 64, 4, 2, 256, 16

    def build(keras):
        L = keras.layers
        tokens = keras.Input((seq,), dtype="int32")
        positions = keras.ops.arange(seq)
        h = L.Embedding(VOCAB, hidden)(tokens) + L.Embedding(seq, hidden)(positions)[None]
        for _ in range(layers):
            a = L.LayerNormalization(epsilon=1e-5)(h)
            a = L.MultiHeadAttention(heads, hidden // heads)(a, a, use_causal_mask=True)
            h = h + a
            m = L.LayerNormalization(epsilon=1e-5)(h)
            m = L.Dense(hidden)(L.Dense(ff, activation="gelu")(m))
            h = h + m
        logits = L.Dense(VOCAB)(L.LayerNormalization(epsilon=1e-5)(h))
        return keras.Model(tokens, logits, name="gpt")
    rng = np.random.default_rng(21)
    ids = _ids(rng, seq=seq)
    return _keras_program(
        build, {"tokens": ids, "targets": ids.copy()}, seed=21, batch_norm=False,
        config={"vocab": VOCAB, "hidden": hidden, "heads": heads, "layers": layers, "ff": ff,
                "seq": seq, "batch": BATCH},
        description="Keras 3 (TensorFlow backend) GPT-style decoder: token + position "
                    "Embedding, 2 pre-LN blocks of MultiHeadAttention (causal mask) and a GELU "
                    "MLP, Dense to the vocabulary; next-token cross-entropy; keras AdamW")


TF_PROGRAMS: dict[str, Callable[[], Program]] = {
    "tf_keras_cnn_train": tf_keras_cnn_train,
    "tf_keras_transformer_train": tf_keras_transformer_train,
}


def build_tf(name: str) -> Program:
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    return TF_PROGRAMS[name]()


# =============================================================================================
# PyTorch/XLA (lazy tensors on the CPU PJRT device)
# =============================================================================================
#
# The step is traced lazily; the pending graph of the outputs is taken as an HloModuleProto
# (torch_xla._XLAC._get_xla_tensors_hlo_proto: the text variant, _get_xla_tensors_hlo, elides
# constants of more than 10 elements as {...}) and printed in full by proto_to_text. The entry
# parameters are the graph's device data in order (_get_tensors_xla_device_data_node): the
# batch, parameters, optimizer moments, and the Python scalars (learning rate, betas, the bias
# corrections torch computes on the host from its CPU step counter) as f64/f32 scalars.

def _torch_versions() -> dict:
    import importlib.metadata as md
    return {k: md.version(k) for k in ("torch", "torch_xla")}


def torch_xla_gpt_train() -> Program:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch
    import torch.nn.functional as F
    import torch_xla
    import _XLAC  # torch_xla's extension module

    vocab, hidden, heads, layers, ff, seq = VOCAB, 64, 4, 2, 256, SEQ

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
            self.qkv = torch.nn.Linear(hidden, 3 * hidden)
            self.proj = torch.nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = torch.nn.Linear(hidden, ff), torch.nn.Linear(ff, hidden)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(hidden, dim=-1)
            q, k, v = (z.view(b, t, heads, hidden // heads).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, hidden))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(seq, hidden)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, vocab)

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))[None]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    torch.manual_seed(22)
    rng = np.random.default_rng(22)
    dev = torch_xla.device()
    model = GPT()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(_round_bits(p.numpy())))
    model = model.to(dev)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    for p in params:   # a few steps in, as everywhere in the zoo
        m = _grid(rng.standard_normal(tuple(p.shape)), 1e-3, 2)
        v = m * m + (1 + np.abs(_grid(rng.standard_normal(m.shape), 2.0, 1))) \
            * np.float32(2.0 ** -20)
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.from_numpy(m).to(dev),
                        "exp_avg_sq": torch.from_numpy(v).to(dev)}
    ids_np = rng.integers(0, vocab, (BATCH, seq)).astype(np.int64)
    ids = torch.from_numpy(ids_np).to(dev)
    torch_xla.sync()
    # Tensor ids of everything the step reads, for naming the entry parameters.
    known = {_XLAC._xla_get_tensor_id(t): n for n, t in zip(names, params)}
    for n, p in zip(names, params):
        for k in ("exp_avg", "exp_avg_sq"):
            known[_XLAC._xla_get_tensor_id(opt.state[p][k])] = f"{n}.{k}"
    known[_XLAC._xla_get_tensor_id(ids)] = "input_ids"

    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    outs = [loss] + params + [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    out_names = ["loss"] + names + [f"{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq")]
    hlo = proto_to_text(_XLAC._get_xla_tensors_hlo_proto(outs))
    tensor_ids, inputs = _XLAC._get_tensors_xla_device_data_node(outs)
    args = [t.cpu().numpy() for t in inputs]       # before the step runs: the inputs
    arg_names = [known.get(i, f"scalar {t.dtype}".replace("torch.", "") if t.dim() == 0
                           else "?") for i, t in zip(tensor_ids, inputs)]
    torch_xla.sync()
    outputs = [o.detach().cpu().numpy() for o in outs]
    batch_arg = [i for i, n in enumerate(arg_names) if n == "input_ids"]
    if len(batch_arg) != 1:
        raise RuntimeError(f"cannot find the token ids among the parameters: {arg_names}")
    return Program(
        frontend="pytorch-xla", kind="train",
        description="hand-written GPT in PyTorch (2 pre-LN blocks, hidden 64, 4 heads, "
                    "F.scaled_dot_product_attention causal, GELU MLP, untied head), "
                    "next-token cross-entropy, torch.optim.AdamW, traced by PyTorch/XLA",
        config={"vocab": vocab, "hidden": hidden, "heads": heads, "layers": layers, "ff": ff,
                "seq": seq, "batch": BATCH},
        hlo=hlo, args=args, outputs=outputs,
        layout={"names": arg_names},
        outputs_layout={"names": out_names},
        batch_inputs={"input_ids": {"arg": i, "batch_dim": 0, "shape": list(ids_np.shape),
                                    "dtype": "int64"} for i in batch_arg},
        versions=_torch_versions(),
        optimizer=f"torch.optim.AdamW(lr={LR}, weight_decay={WEIGHT_DECAY}), state at step 3",
        notes=["token ids are s64; the learning rate, betas, weight decay and Adam's bias "
               "corrections (computed on the host from torch's CPU step counter) are f32/f64 "
               "scalar parameters; the module has no input_output_alias",
               "HLO printed from torch_xla's HloModuleProto with every constant in full"])


TORCH_PROGRAMS: dict[str, Callable[[], Program]] = {
    "torch_xla_gpt_train": torch_xla_gpt_train,
}


def build_torch(name: str) -> Program:
    return TORCH_PROGRAMS[name]()


# =============================================================================================
# Driver
# =============================================================================================

FRONTENDS: dict[str, tuple[dict, Callable[[str], Program]]] = {
    "jax-flax": (JAX_PROGRAMS, build_jax),
    "tensorflow": (TF_PROGRAMS, build_tf),
    "pytorch-xla": (TORCH_PROGRAMS, build_torch),
}


def all_programs() -> dict[str, str]:
    return {name: fe for fe, (progs, _) in FRONTENDS.items() for name in progs}


def worker(frontend: str, names: list[str]) -> int:
    _, build = FRONTENDS[frontend]
    failed = 0
    for name in names:
        t0 = time.time()
        try:
            entry = save(name, build(name))
        except Exception:
            failed += 1
            print(f"FAILED {name}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        print(f"{name}: {entry['instructions']} instructions, hlo {entry['hlo_bytes']:,} B, "
              f"npz {entry['npz_bytes']:,} B, {time.time() - t0:.1f} s", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="programs to (re)generate (default: all)")
    ap.add_argument("--list", action="store_true", help="list the programs and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--print-proto", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.print_proto:
        return _print_proto()
    progs = all_programs()
    if a.list:
        for name, fe in progs.items():
            print(f"{name:40s} {fe}")
        return 0
    if a.worker:
        return worker(a.worker, a.names)
    names = a.names or list(progs)
    unknown = [n for n in names if n not in progs]
    if unknown:
        ap.error(f"unknown programs: {', '.join(unknown)} (see --list)")
    rc = 0
    for fe in FRONTENDS:
        group = [n for n in names if progs[n] == fe]
        if group:
            # One process per front end: each bundles its own XLA.
            rc |= subprocess.call([sys.executable, __file__, "--worker", fe, *group])
    return rc


if __name__ == "__main__":
    sys.exit(main())
