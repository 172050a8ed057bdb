"""Hand-made multi-stage plans for the runtime tests, until the compiler emits its own.

`pipeline_plan` writes a plan directory whose program pipelines the training step of an
S-layer tanh MLP (one layer per stage) over S meshes with B microbatches: per stage a forward
module, a backward module (recomputing its forward) and an apply module (SGD), gradients and
the loss accumulated over microbatches, the per-example loss and the example ids (from the
microbatch index) concatenated over microbatches, and source.hlo, the whole-batch step as one
module, for `alpa-run --check`. Each module is lowered by jax and given the sharding
annotations of its stage's layout, so that consecutive meshes lay the same value out
differently: every transfer reshards, and some destinations replicate (local all-gather) or
replicate a scalar (forwarded inside the destination mesh).

Run as a test file, it checks the programs with the compiler side's in-process interpreter
(`tests/program_interpreter.py`) against the whole-batch step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

D = 8  # features
BATCH = 16
LR = 0.125


def _rows(n: int) -> str:
    return "{replicated}" if n == 1 else f"{{devices=[{n},1]{','.join(map(str, range(n)))}}}"


def _cols(n: int) -> str:
    return "{replicated}" if n == 1 else f"{{devices=[1,{n}]{','.join(map(str, range(n)))}}}"


def layout(stage: int, n: int) -> dict[str, str]:
    """Shardings of one stage's values on a mesh of n devices: even stages split examples
    (rows), odd stages split features (columns); gradients arrive replicated."""
    if stage % 2 == 0:
        return {"w": "{replicated}", "h_in": _rows(n), "h_out": _rows(n), "dh_in": "{replicated}",
                "dh_out": _rows(n), "acc": "{replicated}"}
    return {"w": _cols(n), "h_in": _cols(n), "h_out": _cols(n), "dh_in": "{replicated}",
            "dh_out": _cols(n), "acc": _cols(n)}


def _lower(fn, shapes, donate=()):
    import jax
    specs = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return jax.jit(fn, keep_unused=True, donate_argnums=donate).lower(*specs).as_text(
        dialect="hlo")


def _annotate(text: str, params: list[str], outputs: list[str]) -> str:
    """Add sharding annotations to the entry's parameters and ROOT."""
    start = text.index("\nENTRY ")
    head, entry = text[:start], text[start:]

    def param(m):
        return f"{m.group(0)}, sharding={params[int(m.group(1))]}"

    entry = re.sub(r"(?m)^\s*\S+ = \S+ parameter\((\d+)\)", param, entry)
    is_tuple = re.search(r"(?m)^\s*ROOT \S+ = \(", entry) is not None
    root = "{" + ", ".join(outputs) + "}" if is_tuple else outputs[0]
    entry = re.sub(r"(?m)^(\s*ROOT .*)$", lambda m: f"{m.group(1)}, sharding={root}", entry,
                   count=1)
    return head + entry


def _fns(S: int):
    import jax
    import jax.numpy as jnp

    def layer(w, h):
        return jnp.tanh(h @ w)

    def loss_ex(out, y):
        return 0.5 * jnp.sum((out - y) ** 2, axis=1)

    def fwd(w, h):
        return layer(w, h)

    def fwd_last(w, h, y, mb, acc_loss):
        le = loss_ex(layer(w, h), y)
        ids = mb * le.shape[0] + jnp.arange(le.shape[0], dtype=jnp.int32)
        return le, ids, acc_loss + jnp.sum(le)

    def bwd(w, h, dh, acc):
        out, vjp = jax.vjp(layer, w, h)
        gw, gh = vjp(dh)
        return gh, acc + gw

    def bwd_last(w, h, y, acc):
        def loss(w, h):
            return jnp.sum(loss_ex(layer(w, h), y))
        gw, gh = jax.grad(loss, argnums=(0, 1))(w, h)
        return gh, acc + gw

    def apply(w, acc):
        return w - LR * acc

    def whole(*args):
        ws, x, y = list(args[:S]), args[S], args[S + 1]

        def total(ws):
            h = x
            for w in ws:
                h = layer(w, h)
            le = loss_ex(h, y)
            return jnp.sum(le), le
        (loss, le), grads = jax.value_and_grad(total, has_aux=True)(ws)
        new = [w - LR * g for w, g in zip(ws, grads)]
        return (*new, loss, le, jnp.arange(x.shape[0], dtype=jnp.int32))

    return fwd, fwd_last, bwd, bwd_last, apply, whole


def pipeline_plan(out: Path, meshes: list[list[int]], num_micro_batches: int = 4,
                  schedule: str = "1f1b", mb_index_mesh: int | None = 0) -> Path:
    """Write a plan directory for the S-stage pipelined MLP step (S = len(meshes), one mesh
    per stage, given by its plan device ids). The microbatch index is fed on mesh
    `mb_index_mesh` (default 0, so that it moves to the last stage: a replicated scalar)."""
    import jax.numpy as jnp
    S, B = len(meshes), num_micro_batches
    mb = BATCH // B
    f32, s32 = jnp.float32, jnp.int32
    fwd, fwd_last, bwd, bwd_last, apply, whole = _fns(S)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    L = [layout(s, len(meshes[s])) for s in range(S)]
    values: dict[str, dict] = {}
    modules: list[dict] = []
    files: dict[str, str] = {}

    def value(name, shape, dtype, mesh, sharding, scope):
        nbytes = int(np.prod(shape)) * (4 if dtype in ("f32", "s32") else 0)
        values.setdefault(name, {"shape": list(shape), "dtype": dtype, "mesh": mesh,
                                 "sharding": sharding, "scope": scope, "bytes": nbytes})

    def module(name, s, role, fn, params, outs, donate=()):
        """params/outs: (value, shape, dtype, sharding) per parameter / output."""
        text = _lower(fn, [(p[1], f32 if p[2] == "f32" else s32) for p in params], donate)
        text = _annotate(text, [p[3] for p in params], [o[3] for o in outs])
        file = f"{name}.hlo"
        files[file] = text
        modules.append({"name": name, "file": file, "mesh": s, "role": role, "stage": s,
                        "parameters": [{"value": p[0], "sharding": p[3]} for p in params],
                        "outputs": [{"value": o[0], "sharding": o[3]} for o in outs],
                        "donated": list(donate)})

    last = S - 1
    mbm = last if mb_index_mesh is None else mb_index_mesh
    value("x", [mb, D], "f32", 0, L[0]["h_in"], "microbatch")
    value("y", [mb, D], "f32", last, L[last]["h_in"], "microbatch")
    value("mb", [], "s32", mbm, "{replicated}", "microbatch")
    value("acc_loss", [], "f32", last, "{replicated}", "step")
    for s in range(S):
        value(f"w{s}", [D, D], "f32", s, L[s]["w"], "step")
        value(f"acc_w{s}", [D, D], "f32", s, L[s]["acc"], "step")
        value(f"w{s}_new", [D, D], "f32", s, L[s]["w"], "step")
        if s > 0:
            value(f"h{s}", [mb, D], "f32", s - 1, L[s - 1]["h_out"], "microbatch")
            value(f"dh{s}", [mb, D], "f32", s, L[s]["dh_out"], "microbatch")
    value("loss_ex", [mb], "f32", last, "{replicated}", "microbatch")
    value("ids", [mb], "s32", last, "{replicated}", "microbatch")

    def h_in(s):
        return "x" if s == 0 else f"h{s}"

    W = [D, D]
    H = [mb, D]
    for s in range(S):
        lay = L[s]
        w = (f"w{s}", W, "f32", lay["w"])
        hin = (h_in(s), H, "f32", lay["h_in"])
        acc = (f"acc_w{s}", W, "f32", lay["acc"])
        if s < last:
            module(f"stage{s}.forward", s, "forward", fwd, [w, hin],
                   [(f"h{s + 1}", H, "f32", lay["h_out"])])
            fn = bwd if s > 0 else (lambda w, h, dh, acc: (bwd(w, h, dh, acc)[1],))
            module(f"stage{s}.backward", s, "backward", fn,
                   [w, hin, (f"dh{s + 1}", H, "f32", lay["dh_in"]), acc],
                   ([(f"dh{s}", H, "f32", lay["dh_out"])] if s > 0 else []) + [acc], donate=(3,))
        else:
            y = ("y", H, "f32", lay["h_in"])
            module(f"stage{s}.forward", s, "forward", fwd_last,
                   [w, hin, y, ("mb", [], "s32", "{replicated}"),
                    ("acc_loss", [], "f32", "{replicated}")],
                   [("loss_ex", [mb], "f32", "{replicated}"), ("ids", [mb], "s32", "{replicated}"),
                    ("acc_loss", [], "f32", "{replicated}")], donate=(4,))
            outs = ([(f"dh{s}", H, "f32", lay["dh_out"])] if s > 0 else []) + [acc]
            if s > 0:
                module(f"stage{s}.backward", s, "backward", bwd_last, [w, hin, y, acc], outs,
                       donate=(3,))
            else:
                module(f"stage{s}.backward", s, "backward",
                       lambda w, h, y, acc: (bwd_last(w, h, y, acc)[1],), [w, hin, y, acc],
                       outs, donate=(3,))
        module(f"stage{s}.apply", s, "apply", apply, [w, acc],
               [(f"w{s}_new", W, "f32", lay["w"])])

    # transfers: a value taken on another mesh than where it is produced (or fed)
    transfers, seen = [], set()
    for mod in modules:
        for p in mod["parameters"]:
            v = values[p["value"]]
            if v["mesh"] != mod["mesh"] and (p["value"], mod["mesh"]) not in seen:
                seen.add((p["value"], mod["mesh"]))
                transfers.append({"value": p["value"], "src_mesh": v["mesh"],
                                  "dst_mesh": mod["mesh"], "src_sharding": v["sharding"],
                                  "dst_sharding": p["sharding"], "bytes": v["bytes"],
                                  "scope": v["scope"]})
    program = {
        "meshes": [{"devices": list(m), "shape": [len(m)]} for m in meshes],
        "values": values,
        "inputs": [{"parameter": s, "value": f"w{s}", "batch_dim": None} for s in range(S)]
        + [{"parameter": S, "value": "x", "batch_dim": 0},
           {"parameter": S + 1, "value": "y", "batch_dim": 0}],
        "outputs": [{"index": [s], "value": f"w{s}_new", "concat_dim": None} for s in range(S)]
        + [{"index": [S], "value": "acc_loss", "concat_dim": None},
           {"index": [S + 1], "value": "loss_ex", "concat_dim": 0},
           {"index": [S + 2], "value": "ids", "concat_dim": 0}],
        "modules": modules,
        "accumulators": ["acc_loss"] + [f"acc_w{s}" for s in range(S)],
        "transfers": transfers,
        "aliases": [[[s], s] for s in range(S)],
        "num_micro_batches": B,
        "schedule": schedule,
        "microbatch_index": "mb",
    }
    files["source.hlo"] = _lower(whole, [(W, f32)] * S + [([BATCH, D], f32)] * 2,
                                 donate=tuple(range(S)))
    for name, text in files.items():
        (out / name).write_text(text)
    (out / "plan.json").write_text(json.dumps(
        {"schema": "alpac.plan/1", "program": program, "num_micro_batches": B,
         "source": {"file": "handmade"}}, indent=1, sort_keys=True) + "\n")
    return out


def plan_inputs(S: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    ws = [rng.normal(0, 0.5, (D, D)).astype(np.float32) for _ in range(S)]
    return ws + [rng.normal(0, 1, (BATCH, D)).astype(np.float32) for _ in range(2)]


# ---- checks of the hand-made programs themselves ---------------------------------------------

def _interpret(plan: Path, args, iterations: int):
    from program_interpreter import run_program

    from alpac.plan.program import Program
    data = json.loads((plan / "plan.json").read_text())
    program = Program.from_dict(data["program"])
    texts = {p.name: p.read_text() for p in plan.glob("*.hlo")}
    return run_program(program, texts, args, iterations)


def _whole(plan: Path, args, iterations: int):
    from alpac.runtime.data import reference
    from alpac.xla.bridge import cpu_devices
    S = len(args) - 2
    return reference((plan / "source.hlo").read_text(), args, [(s, s) for s in range(S)],
                     iterations, cpu_devices(1)[0])


def test_handmade_programs_match_the_whole_step(tmp_path):
    import pytest
    pytest.importorskip("program_interpreter")
    for meshes in ([[0, 1], [2, 3]], [[0], [1], [2], [3]], [[0, 1, 2, 3]]):
        plan = pipeline_plan(tmp_path / f"p{len(meshes)}", meshes)
        args = plan_inputs(len(meshes))
        got = _interpret(plan, args, 2)
        want = _whole(plan, args, 2)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
