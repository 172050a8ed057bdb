"""The project's own test models (testdata/models, written by testdata/generate.py): present,
parsed by alpac, donation recorded, reference data consistent with the modules, reproducible,
and the Alpa GPT suite generator works."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest
from conftest import TESTDATA

from alpac.hlo import parse_hlo

MODELS_DIR = TESTDATA / "models"
MODEL_NAMES = ("mlp", "gpt", "bert", "moe", "wresnet")
KINDS = ("train", "fwd")
STEMS = [f"{m}_{k}" for m in MODEL_NAMES for k in KINDS]
HLO_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": None, "s32": np.int32,
              "pred": np.bool_}
BATCH = 16


@cache
def module(stem: str):
    path = MODELS_DIR / f"{stem}.hlo"
    return parse_hlo(path.read_text(), str(path))


@cache
def manifest() -> dict:
    return json.loads((MODELS_DIR / "manifest.json").read_text())


def npz(stem: str) -> dict[str, np.ndarray]:
    with np.load(MODELS_DIR / f"{stem}.npz") as data:
        return {k: data[k] for k in data.files}


def layout(stem: str) -> dict:
    name, kind = stem.rsplit("_", 1)
    return manifest()["models"][name]["modules"][kind]


def _np_dtype(shape):
    return np.dtype(HLO_DTYPES[shape.dtype])


# ---- files ----------------------------------------------------------------------------------

def test_all_files_exist_and_are_small():
    for stem in STEMS:
        hlo, ref = MODELS_DIR / f"{stem}.hlo", MODELS_DIR / f"{stem}.npz"
        assert hlo.is_file() and ref.is_file(), stem
        assert hlo.stat().st_size < 300_000, hlo
        # gpt_train is the one exception: 217K parameters x (params, m, v) in and out as f32
        # do not compress below ~2.7 MB.
        limit = 3_000_000 if stem == "gpt_train" else 1_000_000
        assert ref.stat().st_size < limit, ref
    assert sorted(manifest()["models"]) == sorted(MODEL_NAMES)
    total = sum(p.stat().st_size for p in MODELS_DIR.iterdir())
    assert total < 8 * 2**20, f"testdata/models is {total} bytes"


@pytest.mark.parametrize("stem", STEMS)
def test_parses(stem):
    m = module(stem)
    assert m.entry is not None and m.entry.root is not None
    assert m.name == f"jit_{stem}"
    assert m.instruction_count() > 10


# ---- donation -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODEL_NAMES)
def test_train_aliases_every_parameter_and_optimizer_state(name):
    stem = f"{name}_train"
    m = module(stem)
    args = layout(stem)["args"]
    n_donated = args["batch"][0]
    assert args["params"][0] == 0 and args["opt_state"][1] == n_donated
    assert n_donated == len(m.entry.parameters) - len(args["batch_inputs"])
    by_param = {a.parameter_number: a for a in m.input_output_alias}
    assert sorted(by_param) == list(range(n_donated)), "every param/state/opt input donated"
    params = m.entry.parameters
    out_leaves = dict(m.entry.root.shape.leaves())
    for i in range(n_donated):
        alias = by_param[i]
        # outputs mirror the inputs: new params, new state, new opt state, then the loss
        assert alias.output_index == (i,) and alias.parameter_index == ()
        assert out_leaves[(i,)].without_layout() == params[i].shape.without_layout()
    # the last output is the scalar loss
    assert out_leaves[(len(out_leaves) - 1,)].dims == ()
    assert len(out_leaves) == n_donated + 1


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_has_no_donation(name):
    assert module(f"{name}_fwd").input_output_alias == []


# ---- reference data -------------------------------------------------------------------------

@pytest.mark.parametrize("stem", STEMS)
def test_npz_matches_entry_parameters_and_outputs(stem):
    m, data = module(stem), npz(stem)
    params = m.entry.parameters
    assert [p.parameter_number for p in params] == list(range(len(params)))
    args = sorted((k for k in data if k.startswith("arg")), key=lambda k: int(k[3:]))
    outs = sorted((k for k in data if k.startswith("out")), key=lambda k: int(k[3:]))
    assert set(data) == set(args) | set(outs)
    assert args == [f"arg{i}" for i in range(len(params))], "one arg per entry parameter"
    for p in params:
        a = data[f"arg{p.parameter_number}"]
        assert a.shape == p.shape.dims, (p.name, a.shape)
        assert a.dtype == _np_dtype(p.shape), (p.name, a.dtype)
    leaves = m.entry.root.shape.leaves()
    assert outs == [f"out{i}" for i in range(len(leaves))], "one out per root tuple leaf"
    for i, (_, shape) in enumerate(leaves):
        o = data[f"out{i}"]
        assert o.shape == shape.dims and o.dtype == _np_dtype(shape), (i, o.shape, o.dtype)
        assert np.all(np.isfinite(o)), i
    lay = layout(stem)
    assert lay["num_args"] == len(params) and lay["num_outputs"] == len(leaves)


@pytest.mark.parametrize("stem", STEMS)
def test_batch_inputs_have_the_batch_on_dim_0(stem):
    m = module(stem)
    params = m.entry.parameters
    batch = layout(stem)["args"]["batch_inputs"]
    assert batch, stem
    for key, info in batch.items():
        p = params[info["arg"]]
        assert key in p.name, (key, p.name)        # jax names parameters by pytree path
        assert p.shape.dims[0] == BATCH and info["batch_dim"] == 0
        assert list(p.shape.dims) == info["shape"]
        assert p.shape.dtype in ("f32", "s32")
    # model parameters, state and Adam moments are float32 (only Adam's count is s32[])
    for p in params[:layout(stem)["args"]["batch"][0]]:
        assert p.shape.dtype == "f32" or (p.shape.dtype == "s32" and p.shape.dims == ()), p


@pytest.mark.parametrize("stem", STEMS)
def test_committed_hlo_reproduces_the_reference_outputs(stem):
    """XLA compiles the committed text; run on the npz inputs it gives the npz outputs."""
    from alpac.xla.bridge import run_hlo_single_device
    data = npz(stem)
    n_args = len(module(stem).entry.parameters)
    n_outs = len(module(stem).entry.root.shape.leaves())
    got = run_hlo_single_device((MODELS_DIR / f"{stem}.hlo").read_text(),
                                [data[f"arg{i}"] for i in range(n_args)])
    assert len(got) == n_outs
    for i, g in enumerate(got):
        np.testing.assert_allclose(g, data[f"out{i}"], rtol=2e-4, atol=2e-5,
                                   err_msg=f"{stem} out{i}")


def test_training_step_changes_parameters_and_counts():
    data = npz("mlp_train")
    lay = layout("mlp_train")["args"]
    lo, hi = lay["params"]
    assert any(not np.array_equal(data[f"arg{i}"], data[f"out{i}"]) for i in range(lo, hi))
    count = lay["opt_state"][0]                    # {count, mu, nu}: count comes first
    assert data[f"arg{count}"].shape == () and data[f"arg{count}"].dtype == np.int32
    assert int(data[f"out{count}"]) == int(data[f"arg{count}"]) + 1


# ---- generator ------------------------------------------------------------------------------

@pytest.mark.parametrize("stem", STEMS)
def test_generator_is_deterministic(stem):
    """Re-running the model-building code gives the committed HLO text byte for byte."""
    from testdata.generate import model_hlo
    name, kind = stem.rsplit("_", 1)
    assert model_hlo(name, kind) == (MODELS_DIR / f"{stem}.hlo").read_text()


def test_npz_writer_is_reproducible(tmp_path):
    from testdata.npz import write_npz
    arrays = {"arg0": np.arange(6, dtype=np.float32).reshape(2, 3), "out0": np.int32(7)}
    write_npz(tmp_path / "a.npz", arrays)
    write_npz(tmp_path / "b.npz", arrays)
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    with np.load(tmp_path / "a.npz") as d:
        assert d["arg0"].tolist() == arrays["arg0"].tolist() and int(d["out0"]) == 7


def test_gpt_suite_module_parses():
    from testdata.generate import gpt_suite_hlo
    text = gpt_suite_hlo("350M", batch_size=8, num_layers=2)
    m = parse_hlo(text, "gpt-350M")
    params = m.entry.parameters
    per_layer = 16                                  # 2 LN x 2 + 4 dense x 2 + 2 MLP dense x 2
    n_params = 2 + 2 * per_layer + 2                # wte, wpe, layers, ln_f
    assert len(params) == 3 * n_params + 1 + 2      # params, count + mu + nu, labels + tokens
    assert sorted(a.parameter_number for a in m.input_output_alias) == \
        list(range(3 * n_params + 1))
    shapes = {p.shape.without_layout().__str__() for p in params}
    assert "f32[51200,1024]" in shapes and "f32[1024,1024]" in shapes
    assert [str(p.shape.without_layout()) for p in params[-2:]] == ["s32[8,1024]"] * 2
    # computes in float16 with float32 master parameters
    assert any(i.shape.dtype == "f16" and i.opcode == "dot" for i in m.instructions())
    assert str(m.entry.root.shape.leaves()[-1][1].without_layout()) == "f32[]"


def test_gpt_suite_rejects_unknown_names():
    from testdata.generate import GPT_SUITE, gpt_suite_hlo, gpt_suite_parameter_count
    with pytest.raises(ValueError):
        gpt_suite_hlo("7B")
    # the suite's sizes are the paper's nominal ones (within 3%): 350M ... 39B
    for name, want in [("350M", 0.35e9), ("760M", 0.76e9), ("1.3B", 1.3e9), ("2.6B", 2.6e9),
                       ("6.7B", 6.7e9), ("15B", 15e9), ("39B", 39e9)]:
        assert name in GPT_SUITE
        assert abs(gpt_suite_parameter_count(name) / want - 1) < 0.03, name
