"""Small programs that complete the opcode coverage of the suite (tests/test_opcode_coverage.py).

    .venv/bin/python testdata/zoo/opcode_programs.py          # (re)write every program
    .venv/bin/python testdata/zoo/opcode_programs.py NAME ...  # only these
    .venv/bin/python testdata/zoo/opcode_programs.py --list

Every opcode that alpac's tables handle (the sharding strategies, the batch-dimension dataflow,
the cost rules) is executed end to end by some program of the suite: testdata/models, the
front-end programs of the zoo, and these. These are what the others miss: FFTs, linear algebra,
conditionals, sorts and top-k, windows and their gradients, random bits, the rarer elementwise
ops, custom-calls, batch norm, map, fusion and the ops XLA inserts itself.

Mostly training steps with a batch (loss, gradient, SGD update, parameters donated) so the
microbatching and pipelining paths see the ops too. Written with this repository's .venv only
(jax 0.10.2 + numpy), deterministic, into testdata/zoo/opcodes/ in the zoo's format:

- `<name>.hlo`: `jax.jit(f, keep_unused=True, donate_argnums=...).lower(*args)
  .as_text(dialect="hlo")`. `opc_linalg_train` is lowered for TPU (`lowering_platforms=
  ("tpu",)`), where jax emits the `cholesky` and `triangular-solve` ops themselves (on CPU it
  calls LAPACK through custom-calls, which `opc_lapack_fwd` covers). Two programs are HLO text
  written here by hand (front end "hlo-text"): jax cannot emit batch-norm, map, fusion,
  logistic, after-all, add-dependency, domain, replica-id, get-dimension-size,
  rng-get-and-update-state or stochastic-convert; their reference is computed with numpy
  from the ops' definitions.
- `<name>.npz`: arg0..argN inputs and out0..outM flattened outputs of the jitted function run
  on CPU (float64 numpy for the hand-written ones), zip timestamps fixed. Batch inputs lie on a
  coarse binary grid and parameters are rounded to 8 significant bits: exact in any format.
- `manifest.json`: the zoo manifest's schema (frontend, kind, description, num_args,
  num_outputs, args / outputs layout, batch_inputs, ...) plus `opcodes`, the opcodes each
  program is here for.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from testdata.npz import write_npz  # noqa: E402

OUT = Path(__file__).resolve().parent / "opcodes"
MANIFEST = OUT / "manifest.json"
BATCH = 8
LR = 0.125


# ---- helpers ---------------------------------------------------------------------------------

def grid(rng: np.random.Generator, shape, step: float = 0.125, limit: float = 4.0):
    """Batch data: normal values on a grid of `step`, clipped to +-limit (exact)."""
    x = np.clip(np.round(rng.normal(size=shape) / step) * step, -limit, limit)
    return x.astype(np.float32)


def param(rng: np.random.Generator, shape, scale: float, bits: int = 8):
    """Parameters: normal * scale rounded to `bits` significant bits (exact, rarely tied)."""
    m, e = np.frexp(rng.normal(size=shape) * scale)
    return np.ldexp(np.round(m * 2.0 ** bits) / 2.0 ** bits, e).astype(np.float32)


def opcodes_of(text: str) -> list[str]:
    return sorted(set(re.findall(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^=]*?\)|\S+)\s+"
                                 r"([a-z][a-z0-9\-]*)\(", text, re.M)))


@dataclass
class Program:
    kind: str                      # train | fwd
    description: str
    opcodes: list[str]             # what the program is here for
    args: list[np.ndarray]
    names: list[str]               # one per argument
    roles: dict[str, list[int]]    # role -> [start, end) of the arguments
    batch: dict[str, int]          # batch input name -> batch dim
    fn: Callable | None = None     # jax: f(*args) -> flat tuple of outputs
    donate: tuple[int, ...] = ()
    platforms: tuple[str, ...] | None = None
    hlo: str | None = None         # hand-written HLO text
    reference: Callable | None = None  # hand-written: numpy f(*args) -> list of outputs
    outputs: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def lower(p: Program) -> tuple[str, list[np.ndarray], str]:
    """(HLO text, reference outputs, front end)."""
    if p.hlo is not None:
        return p.hlo, [np.asarray(o) for o in p.reference(*p.args)], "hlo-text"
    import jax
    jitted = jax.jit(p.fn, keep_unused=True, donate_argnums=p.donate)
    traced = jitted.trace(*p.args)
    lowered = traced.lower(lowering_platforms=p.platforms) if p.platforms else traced.lower()
    text = lowered.as_text(dialect="hlo")
    outs = jax.jit(p.fn, keep_unused=True)(*[np.copy(a) for a in p.args])
    return text, [np.asarray(o) for o in jax.tree_util.tree_leaves(outs)], "jax"


def save(name: str, p: Program) -> dict:
    OUT.mkdir(parents=True, exist_ok=True)
    text, outs, frontend = lower(p)
    missing = sorted(set(p.opcodes) - set(opcodes_of(text)))
    if missing:
        raise SystemExit(f"{name}: the lowered module lacks {', '.join(missing)}")
    hlo_path, npz_path = OUT / f"{name}.hlo", OUT / f"{name}.npz"
    hlo_path.write_text(text)
    arrays = {f"arg{i}": a for i, a in enumerate(p.args)}
    arrays.update({f"out{i}": o for i, o in enumerate(outs)})
    write_npz(npz_path, arrays)
    import jax
    entry = {
        "frontend": frontend, "kind": p.kind, "description": p.description,
        "versions": {"jax": jax.__version__, "numpy": np.__version__},
        "hlo": hlo_path.name, "npz": npz_path.name,
        "num_args": len(p.args), "num_outputs": len(outs),
        "args": p.roles, "outputs": p.outputs,
        "arg_names": p.names,
        "batch_inputs": {n: {"arg": p.names.index(n), "batch_dim": d,
                             "dtype": str(p.args[p.names.index(n)].dtype),
                             "shape": list(p.args[p.names.index(n)].shape)}
                         for n, d in sorted(p.batch.items())},
        "opcodes": sorted(p.opcodes), "optimizer": "sgd" if p.kind == "train" else None,
        "instructions": len(re.findall(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=", text, re.M)),
        "hlo_bytes": hlo_path.stat().st_size, "npz_bytes": npz_path.stat().st_size,
    }
    if p.platforms:
        entry["lowering_platforms"] = list(p.platforms)
    if p.notes:
        entry["notes"] = p.notes
    return entry


def sgd(params, grads):
    return tuple(w - LR * g for w, g in zip(params, grads))


# ---- jax programs ----------------------------------------------------------------------------

def opc_pool_sort_train() -> Program:
    """A conv net step through max-pool (its gradient is select-and-scatter), average pool,
    cumsum, sort, top-k, clamp, reduce-precision, a dynamic slice and a cond/switch on the
    step counter; it microbatches and pipelines."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    rng = np.random.default_rng(101)
    w_conv = param(rng, (4, 1, 3, 3), 0.5)
    w_out = param(rng, (48, 10), 0.25)
    step = np.array(3, np.int32)
    x = grid(rng, (BATCH, 1, 8, 8))
    labels = rng.integers(0, 10, (BATCH,)).astype(np.int32)

    def loss_fn(w_conv, w_out, step, x, labels):
        xq = lax.reduce_precision(x, exponent_bits=5, mantissa_bits=2)
        h = lax.conv_general_dilated(xq, w_conv, (1, 1), "SAME",
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
        h = lax.clamp(-2.0, h, 3.0)
        mx = lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        avg = lax.reduce_window(h, 0.0, lax.add, (1, 1, 3, 3), (1, 1, 1, 1), "SAME") / 9
        f = mx.reshape(BATCH, 64)
        # no gradient through sort and top-k: theirs scatters into the batch by index, which
        # the batch analysis cannot split, and the rest of the step should microbatch
        srt = lax.stop_gradient(jnp.sort(f, axis=1))
        top = lax.stop_gradient(lax.top_k(f, 8)[0])
        csum = lax.cumsum(avg.reshape(BATCH, 4, 64), axis=2)[:, :, -2:].reshape(BATCH, 8)
        start = (step % 4) * 8
        window = lax.dynamic_slice_in_dim(f, start, 16, axis=1)
        # the conditionals make a temperature from the step counter (batch data or gradients
        # through a conditional keep the step from microbatching: the rewrite does not
        # shrink called computations)
        t = step.astype(jnp.float32)
        temp = lax.cond(step % 2 == 0, lambda v: v * 0.25, lambda v: jnp.cos(v) + 2.0, t)
        temp = lax.switch(step % 3, [lambda v: v, lambda v: v * v, jnp.tanh], temp)
        feats = jnp.concatenate([window, top, csum / 16, srt[:, -16:]], axis=1)
        logits = feats @ w_out * temp
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(labels, 10), axis=1))

    def step_fn(w_conv, w_out, step, x, labels):
        loss, grads = jax.value_and_grad(loss_fn, argnums=(0, 1))(w_conv, w_out, step, x,
                                                                  labels)
        return (*sgd((w_conv, w_out), grads), step + 1, loss)

    return Program(
        "train", "conv 3x3 (4 channels) -> clamp -> 2x2 max-pool and 3x3 average pool, sort and "
        "top-k (no gradient), cumsum, a dynamic slice at the step counter, dense to 10 classes "
        "at a temperature that lax.cond and lax.switch make from the step counter, "
        "cross-entropy, SGD",
        ["reduce-precision", "clamp", "reduce-window", "select-and-scatter", "sort", "topk",
         "dynamic-slice", "dynamic-update-slice", "conditional", "convolution"],
        [w_conv, w_out, step, x, labels], ["w_conv", "w_out", "step", "x", "labels"],
        {"params": [0, 2], "state": [2, 3], "batch": [3, 5]}, {"x": 0, "labels": 0},
        fn=step_fn, donate=(0, 1, 2), outputs={"params": [0, 2], "state": [2, 3],
                                               "loss": [3, 4]})


def opc_spectral_train() -> Program:
    """FFTs (rfft, irfft, complex fft) with a learned complex filter, the complex parts, and
    the rarer elementwise ops: smooth ones on computed values, discontinuous ones (floor,
    ceil, rounding, sign, remainder) and bit ops on the exact batch inputs."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    rng = np.random.default_rng(102)
    w_re = param(rng, (9,), 0.5)
    w_im = param(rng, (9,), 0.5)
    dense = param(rng, (17 * 16, 16), 0.0625)
    head = param(rng, (16, 4), 0.25)
    s = grid(rng, (BATCH, 16))
    t = grid(rng, (BATCH, 16), step=0.25)
    bits = rng.integers(-2 ** 20, 2 ** 20, (BATCH, 16)).astype(np.int32)
    target = grid(rng, (BATCH, 4))

    def loss_fn(w_re, w_im, dense, head, s, t, bits, target):
        spec = jnp.fft.rfft(s, axis=1)
        y = jnp.fft.irfft(spec * lax.complex(w_re, w_im), n=16, axis=1)
        z = jnp.fft.fft(lax.complex(s, y), axis=1) / 4
        smooth = [y, lax.real(z), lax.imag(z), jnp.arctan2(lax.imag(z), lax.real(z) + 8.0),
                  jnp.cbrt(y * y + 1.0), lax.erf(y), jnp.expm1(y / 4), jnp.sinc(y / 4),
                  jnp.sin(y), jnp.tan(y / 8)]
        rough = [jnp.floor(t), jnp.ceil(t), lax.round(t, lax.RoundingMethod.AWAY_FROM_ZERO),
                 lax.round(t, lax.RoundingMethod.TO_NEAREST_EVEN), jnp.sign(t),
                 jnp.remainder(t, 0.75)]
        ints = [lax.population_count(bits), lax.clz(bits), lax.shift_right_arithmetic(bits, 17),
                lax.rem(bits, 7), ~bits >> 18]  # not, then shift-right-arithmetic
        ints = [v.astype(jnp.float32) / 32 for v in ints]
        feats = jnp.concatenate(smooth + rough[:3] + [sum(rough[3:])] + ints[:2]
                                + [sum(ints[2:])], axis=1)
        pred = jnp.tanh(feats @ dense) @ head
        return jnp.mean((pred - target) ** 2)

    def step_fn(w_re, w_im, dense, head, s, t, bits, target):
        loss, grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2, 3))(
            w_re, w_im, dense, head, s, t, bits, target)
        return (*sgd((w_re, w_im, dense, head), grads), loss)

    return Program(
        "train", "rfft -> learned complex filter -> irfft, a complex fft of (signal + i "
        "filtered), real/imag/atan2, smooth elementwise features (cbrt, erf, expm1, sinc, "
        "sin, tan), floor/ceil/round/sign/remainder of a grid input, popcnt/clz/shifts/not/"
        "remainder of an int input, two dense layers (tanh), MSE, SGD",
        ["fft", "complex", "real", "imag", "atan2", "cbrt", "erf", "exponential-minus-one",
         "sine", "tan", "floor", "ceil", "round-nearest-afz",
         "round-nearest-even", "sign", "remainder", "popcnt", "count-leading-zeros",
         "shift-right-arithmetic", "not"],
        [w_re, w_im, dense, head, s, t, bits, target],
        ["w_re", "w_im", "dense", "head", "s", "t", "bits", "target"],
        {"params": [0, 4], "batch": [4, 8]}, {"s": 0, "t": 0, "bits": 0, "target": 0},
        fn=step_fn, donate=(0, 1, 2, 3), outputs={"params": [0, 4], "loss": [4, 5]})


def opc_random_train() -> Program:
    """Dropout with jax's "rbg" PRNG (rng-bit-generator, the key is state) and XLA's `rng`
    op (lax.rng_uniform over the one-value range [0, 1), so its result is exact)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    rng = np.random.default_rng(103)
    key = np.array([0, 42, 0, 7], np.uint32)
    w = param(rng, (16, 4), 0.25)
    v = param(rng, (4, 4), 0.5)
    x = grid(rng, (BATCH, 16))
    target = grid(rng, (BATCH, 4))

    def step_fn(key, w, v, x, target):
        k = jax.random.wrap_key_data(key, impl="rbg")
        k_drop, k_next = jax.random.split(k)
        keep = jax.random.bernoulli(k_drop, 0.75, (BATCH, 16))
        zero = lax.rng_uniform(jnp.int32(0), jnp.int32(1), (16, 4)).astype(jnp.float32)

        def loss_fn(w, v):
            h = jnp.where(keep, x / 0.75, 0.0) @ (w + zero)
            return jnp.mean((jnp.tanh(h) @ v - target) ** 2)

        loss, g = jax.value_and_grad(loss_fn, argnums=(0, 1))(w, v)
        return (jax.random.key_data(k_next), *sgd((w, v), g), loss)

    return Program(
        "train", "dropout (keep 0.75) drawn with the rbg PRNG from a key carried as state, "
        "a dense tanh layer whose weight adds lax.rng_uniform(0, 1) (always 0), a second "
        "dense layer, MSE, SGD",
        ["rng-bit-generator", "rng"],
        [key, w, v, x, target], ["key", "w", "v", "x", "target"],
        {"state": [0, 1], "params": [1, 3], "batch": [3, 5]}, {"x": 0, "target": 0},
        fn=step_fn, donate=(0, 1, 2),
        outputs={"state": [0, 1], "params": [1, 3], "loss": [3, 4]})


def _spd_solve_loss(a, b, solve):
    import jax.numpy as jnp
    spd = a @ a.T + 4.0 * jnp.eye(4, dtype=a.dtype)
    chol = jnp.linalg.cholesky(spd)
    z = solve(chol, b.T)
    return jnp.mean(z ** 2), z


def opc_linalg_train() -> Program:
    """cholesky and triangular-solve as HLO ops (lowered for TPU; XLA:CPU expands them)."""
    import jax
    rng = np.random.default_rng(104)
    a = param(rng, (4, 4), 0.5)
    b = grid(rng, (BATCH, 4))

    def step_fn(a, b):
        def loss_fn(a):
            return _spd_solve_loss(
                a, b, lambda l, r: jax.scipy.linalg.solve_triangular(l, r, lower=True))[0]
        loss, g = jax.value_and_grad(loss_fn)(a)
        return a - LR * g, loss

    return Program(
        "train", "per-example right-hand sides solved against chol(a a^T + 4 I): cholesky, "
        "triangular-solve (and their gradients), mean square, SGD; lowered for TPU so the ops "
        "are XLA's own, the reference is the CPU (LAPACK) result",
        ["cholesky", "triangular-solve"], [a, b], ["a", "b"],
        {"params": [0, 1], "batch": [1, 2]}, {"b": 0}, fn=step_fn, donate=(0,),
        platforms=("tpu",), outputs={"params": [0, 1], "loss": [1, 2]})


def opc_lapack_fwd() -> Program:
    """The same solve lowered for CPU: LAPACK custom-calls, and a Sharding custom-call."""
    import jax
    rng = np.random.default_rng(105)
    a = param(rng, (4, 4), 0.5)
    b = grid(rng, (BATCH, 4))
    one = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])

    def fwd(a, b):
        _, z = _spd_solve_loss(a, b, lambda l, r: jax.scipy.linalg.solve_triangular(
            l, r, lower=True))
        return (jax.lax.with_sharding_constraint(z.T, one),)

    return Program(
        "fwd", "chol(a a^T + 4 I) and a triangular solve of per-example right-hand sides on "
        "CPU: lapack_spotrf_ffi / lapack_strsm_ffi custom-calls and a Sharding annotation",
        ["custom-call"], [a, b], ["a", "b"], {"params": [0, 1], "batch": [1, 2]}, {"b": 0},
        fn=fwd)


# ---- hand-written HLO --------------------------------------------------------------------------

_BN_HLO = """\
HloModule opc_batchnorm_train, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias), {2}: (2, {}, may-alias) }

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY step {
  scale = f32[3] parameter(0)
  offset = f32[3] parameter(1)
  w = f32[3] parameter(2)
  x = f32[8,4,4,3] parameter(3)
  t = f32[8,4,4,3] parameter(4)
  bn = (f32[8,4,4,3], f32[3], f32[3]) batch-norm-training(x, scale, offset), epsilon=0.001, feature_index=3
  y = f32[8,4,4,3] get-tuple-element(bn), index=0
  mean = f32[3] get-tuple-element(bn), index=1
  var = f32[3] get-tuple-element(bn), index=2
  wb = f32[8,4,4,3] broadcast(w), dimensions={3}
  guess = f32[8,4,4,3] multiply(y, wb)
  err = f32[8,4,4,3] subtract(guess, t)
  sq = f32[8,4,4,3] multiply(err, err)
  zero = f32[] constant(0)
  total = f32[] reduce(sq, zero), dimensions={0,1,2,3}, to_apply=add
  inv_n = f32[] constant(0.0026041667)
  loss = f32[] multiply(total, inv_n)
  two_n = f32[] constant(0.0052083335)
  two_nb = f32[8,4,4,3] broadcast(two_n), dimensions={}
  dpred = f32[8,4,4,3] multiply(err, two_nb)
  dy = f32[8,4,4,3] multiply(dpred, wb)
  dpy = f32[8,4,4,3] multiply(dpred, y)
  dw = f32[3] reduce(dpy, zero), dimensions={0,1,2}, to_apply=add
  grad = (f32[8,4,4,3], f32[3], f32[3]) batch-norm-grad(x, scale, mean, var, dy), epsilon=0.001, feature_index=3
  dx = f32[8,4,4,3] get-tuple-element(grad), index=0
  dscale = f32[3] get-tuple-element(grad), index=1
  doffset = f32[3] get-tuple-element(grad), index=2
  lr = f32[] constant(0.125)
  lr3 = f32[3] broadcast(lr), dimensions={}
  us = f32[3] multiply(dscale, lr3)
  new_scale = f32[3] subtract(scale, us)
  uo = f32[3] multiply(doffset, lr3)
  new_offset = f32[3] subtract(offset, uo)
  uw = f32[3] multiply(dw, lr3)
  new_w = f32[3] subtract(w, uw)
  eval = f32[8,4,4,3] batch-norm-inference(x, new_scale, new_offset, mean, var), epsilon=0.001, feature_index=3
  eval_sum = f32[8,3] reduce(eval, zero), dimensions={1,2}, to_apply=add
  dx_sum = f32[8,3] reduce(dx, zero), dimensions={1,2}, to_apply=add
  ROOT out = (f32[3], f32[3], f32[3], f32[], f32[8,3], f32[8,3]) tuple(new_scale, new_offset, new_w, loss, eval_sum, dx_sum)
}
"""


def _bn_reference(scale, offset, w, x, t):
    eps = np.float32(0.001)
    x64 = x.astype(np.float64)
    n = x.size // 3
    mean = x64.mean(axis=(0, 1, 2))
    var = x64.var(axis=(0, 1, 2))
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x64 - mean) * rstd
    y = scale * xhat + offset
    err = y * w - t
    loss = np.float32(np.sum(err * err)) * np.float32(0.0026041667)
    dpred = err * np.float32(0.0052083335)
    dy = dpred * w
    dw = np.sum(dpred * y, axis=(0, 1, 2))
    dscale = np.sum(dy * xhat, axis=(0, 1, 2))
    doffset = np.sum(dy, axis=(0, 1, 2))
    dx = scale * rstd * (dy - doffset / n - xhat * dscale / n)
    new_scale, new_offset, new_w = scale - LR * dscale, offset - LR * doffset, w - LR * dw
    ev = new_scale * (x64 - mean) * rstd + new_offset
    f32 = np.float32
    return [new_scale.astype(f32), new_offset.astype(f32), new_w.astype(f32), f32(loss),
            ev.sum(axis=(1, 2)).astype(f32), dx.sum(axis=(1, 2)).astype(f32)]


def opc_batchnorm_train() -> Program:
    rng = np.random.default_rng(106)
    scale = param(rng, (3,), 0.25) + np.float32(1)
    offset = param(rng, (3,), 0.25)
    w = param(rng, (3,), 0.5)
    x = grid(rng, (BATCH, 4, 4, 3))
    t = grid(rng, (BATCH, 4, 4, 3))
    return Program(
        "train", "batch norm in training mode (NHWC, feature_index 3) and its gradient as XLA's "
        "own ops, a per-feature weight, MSE, SGD, then the updated layer in inference mode (its "
        "output and the input gradient summed over space per example); "
        "hand-written HLO (no front end emits batch-norm ops), numpy reference",
        ["batch-norm-training", "batch-norm-grad", "batch-norm-inference"],
        [scale, offset, w, x, t], ["scale", "offset", "w", "x", "t"],
        {"params": [0, 3], "batch": [3, 5]}, {"x": 0, "t": 0}, hlo=_BN_HLO,
        reference=_bn_reference,
        outputs={"params": [0, 3], "loss": [3, 4], "eval": [4, 5], "dx": [5, 6]})


_XLA_OPS_HLO = """\
HloModule opc_xla_ops_fwd

mul {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT m = f32[] multiply(a, b)
}

fused_neg_sub {
  p0 = f32[8,4] parameter(0)
  p1 = f32[8,4] parameter(1)
  n = f32[8,4] negate(p0)
  ROOT s = f32[8,4] subtract(n, p1)
}

ENTRY fwd {
  x = f32[8,4] parameter(0)
  q = f32[8,4] parameter(1)
  fr = f32[8,4] parameter(2)
  bits = u32[8,4] parameter(3)
  m = f32[8,4] map(x, q), dimensions={0,1}, to_apply=mul
  f = f32[8,4] fusion(m, q), kind=kLoop, calls=fused_neg_sub
  tok = token[] after-all()
  dep = f32[8,4] add-dependency(f, tok)
  dom = f32[8,4] domain(dep), domain={kind="sharding", entry={replicated}, exit={replicated}}
  rid = u32[] replica-id()
  ridf = f32[] convert(rid)
  rows = s32[] get-dimension-size(x), dimensions={1}
  rowsf = f32[] convert(rows)
  shift = f32[] add(ridf, rowsf)
  shiftb = f32[8,4] broadcast(shift), dimensions={}
  y = f32[8,4] add(dom, shiftb)
  sc = s32[8,4] stochastic-convert(fr, bits)
  scf = f32[8,4] convert(sc)
  lg = f32[8,4] logistic(x)
  y2 = f32[8,4] add(y, lg)
  out = f32[8,4] add(y2, scf)
  state = u64[2] rng-get-and-update-state(), delta=16
  same = pred[2] compare(state, state), direction=EQ
  ROOT r = (f32[8,4], pred[2]) tuple(out, same)
}
"""


def _xla_ops_reference(x, q, fr, bits):
    whole = np.floor(fr)
    frac = (fr - whole).astype(np.float64)
    up = bits.astype(np.float64) < frac * 2.0 ** 32
    sc = (whole + up).astype(np.float32)
    lg = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    out = (-(x * q) - q) + np.float32(0 + 4) + lg + sc
    return [out.astype(np.float32), np.array([True, True])]


def opc_xla_ops_fwd() -> Program:
    rng = np.random.default_rng(107)
    x = grid(rng, (BATCH, 4))
    q = grid(rng, (BATCH, 4))
    fr = np.abs(grid(rng, (BATCH, 4), step=0.25))
    bits = rng.integers(0, 2 ** 32, (BATCH, 4), dtype=np.uint64).astype(np.uint32)
    return Program(
        "fwd", "ops only XLA or hand-written HLO produce: map, a loop fusion, logistic, "
        "after-all + add-dependency, a sharding domain, replica-id, get-dimension-size, stochastic-convert "
        "(f32 -> s32 with given random bits) and rng-get-and-update-state (compared with "
        "itself); numpy reference",
        ["map", "fusion", "logistic", "after-all", "add-dependency", "domain", "replica-id",
         "get-dimension-size", "stochastic-convert", "rng-get-and-update-state"],
        [x, q, fr, bits], ["x", "q", "fr", "bits"], {"batch": [0, 4]},
        {"x": 0, "q": 0, "fr": 0, "bits": 0}, hlo=_XLA_OPS_HLO, reference=_xla_ops_reference)


PROGRAMS = {f.__name__: f for f in (opc_pool_sort_train, opc_spectral_train, opc_random_train,
                                    opc_linalg_train, opc_lapack_fwd, opc_batchnorm_train,
                                    opc_xla_ops_fwd)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        print("\n".join(PROGRAMS))
        return 0
    names = argv or list(PROGRAMS)
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        print(f"unknown program(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    import jax
    jax.config.update("jax_platforms", "cpu")
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    manifest["generator"] = "testdata/zoo/opcode_programs.py"
    manifest["note"] = ("Programs that complete the suite's opcode coverage "
                        "(tests/test_opcode_coverage.py); see the generator's docstring.")
    manifest.setdefault("programs", {})
    for name in names:
        entry = save(name, PROGRAMS[name]())
        manifest["programs"][name] = entry
        print(f"{name}: {entry['instructions']} instructions, {entry['hlo_bytes']} B hlo, "
              f"{entry['npz_bytes']} B npz")
    manifest["programs"] = dict(sorted(manifest["programs"].items()))
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
