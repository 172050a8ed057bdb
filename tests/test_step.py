"""Training-step structure from HLO alone, and exact microbatching (issue 4).

Acceptance: the per-microbatch module run B times on batch slices, accumulated, then the
once-per-step module, equals the original step (npz reference data and the unsplit module
run on one device); forward programs split and concatenate; wresnet's batch norm is refused
by name; MaxText/DeepSeek are analysed; batch inputs are detected for every test model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED, TESTDATA

from alpac.analysis.step import BatchInfo, MicrobatchRefused, StepSplit, batch_info_from_args, \
    detect_batch, parse_batch_args
from alpac.analysis.step.lattice import PSUM, split
from alpac.errors import UserError
from alpac.hlo import parse_hlo
from alpac.hlo.transforms import inline_calls
from alpac.passes.manager import CompileContext, PassManager, available_passes

MODELS = TESTDATA / "models"
MANIFEST = json.loads((MODELS / "manifest.json").read_text())
STEMS = [f"{m}_{k}" for m in MANIFEST["models"] for k in ("train", "fwd")]
CORPUS = SHARED / "hlo-corpus"
MAXTEXT = CORPUS / "nv_maxtext_1n1g_jit_train_step_before_optimization.hlo"
DEEPSEEK = CORPUS / "nv_maxtext_deepseek_1n4g_jit_train_step_before_optimization.hlo"


def _expected_batch(stem: str) -> dict[int, int]:
    model, kind = stem.rsplit("_", 1)
    inputs = MANIFEST["models"][model]["modules"][kind]["args"]["batch_inputs"]
    return {v["arg"]: v["batch_dim"] for v in inputs.values()}


class _Models:
    """Parsed (and inlined) modules, reference data, splits and unsplit runs, made once."""

    def __init__(self):
        self._modules, self._data, self._splits, self._unsplit = {}, {}, {}, {}

    def module(self, stem: str):
        if stem not in self._modules:
            module = parse_hlo((MODELS / f"{stem}.hlo").read_text())
            inline_calls(module)
            self._modules[stem] = module
        return self._modules[stem]

    def data(self, stem: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if stem not in self._data:
            with np.load(MODELS / f"{stem}.npz") as z:
                n_args = sum(1 for k in z.files if k.startswith("arg"))
                n_outs = sum(1 for k in z.files if k.startswith("out"))
                self._data[stem] = ([z[f"arg{i}"] for i in range(n_args)],
                                    [z[f"out{i}"] for i in range(n_outs)])
        return self._data[stem]

    def split(self, stem: str) -> StepSplit:
        if stem not in self._splits:
            module = self.module(stem)
            self._splits[stem] = StepSplit(module, detect_batch(module))
        return self._splits[stem]

    def unsplit(self, stem: str) -> list[np.ndarray]:
        """The original module on one device (run_hlo_single_device, the reference)."""
        if stem not in self._unsplit:
            from alpac.xla.bridge import run_hlo_single_device
            text = (MODELS / f"{stem}.hlo").read_text()
            self._unsplit[stem] = run_hlo_single_device(text, self.data(stem)[0])
        return self._unsplit[stem]


@pytest.fixture(scope="session")
def models() -> _Models:
    return _Models()


def _assert_close(got: list[np.ndarray], want: list[np.ndarray], what: str) -> float:
    """rtol 1e-5, with an absolute floor of 2e-6 x the output's largest magnitude for elements
    that are float noise around zero (e.g. gradients of biases the loss ignores); returns the
    largest error relative to the output's scale."""
    assert len(got) == len(want), what
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: output {i}"
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6 * scale,
                                   err_msg=f"{what}: output {i}")
        if w.size and scale:
            worst = max(worst, float(np.max(np.abs(g.astype(np.float64) - w)) / scale))
    return worst


# ---- batch inputs ---------------------------------------------------------------------------

@pytest.mark.parametrize("stem", STEMS)
def test_batch_inputs_detected(models, stem):
    info = detect_batch(models.module(stem))
    assert info.dims == _expected_batch(stem), info.evidence
    assert info.size == MANIFEST["batch_size"]
    assert info.confidence == ("high" if stem.endswith("_train") else "medium"), info.evidence
    json.dumps(info.to_dict())


def test_batch_args_override(models):
    module = models.module("gpt_train")
    info = batch_info_from_args(module, parse_batch_args("205:0,206"))
    assert info.dims == {205: 0, 206: 0} and info.size == 16 and info.given
    assert [a.name for a in info.args] == [module.entry.parameters[205].name,
                                           module.entry.parameters[206].name]
    for bad in ("x", "205:0:1", "", "999:0", "205:5", "0:0,205:0"):
        with pytest.raises(UserError):
            batch_info_from_args(module, parse_batch_args(bad))
    # an override the analysis disagrees with is still obeyed (and then refused or split)
    wrong = StepSplit(module, batch_info_from_args(module, {205: 1, 206: 1}))
    assert wrong.refusal is not None


def test_passes_registered_and_run():
    registry = available_passes()
    assert {"batch-analysis", "step-split"} <= set(registry)
    ctx = CompileContext(MODELS / "mlp_train.hlo", None)
    passes = [registry["load"](), registry["inline-calls"](),
              registry["batch-analysis"].with_options({"batch_args": "25:0,26:0"}),
              registry["step-split"]()]
    PassManager(passes).run(ctx)
    info = ctx.get(BatchInfo)
    assert isinstance(info, BatchInfo) and info.given and info.dims == {25: 0, 26: 0}
    step = ctx.get(StepSplit)
    assert isinstance(step, StepSplit) and step.refusal is None
    json.dumps(step.summary())


# ---- acceptance 1: training steps, B in {2, 4, 8} --------------------------------------------

@pytest.mark.parametrize("B", [2, 4, 8])
@pytest.mark.parametrize("model", ["mlp", "gpt", "bert", "moe"])
def test_train_step_microbatched_exactly(models, model, B):
    from alpac.analysis.step.execute import run_microbatched
    stem = f"{model}_train"
    sp = models.split(stem)
    assert sp.refusal is None, sp.refusal
    args, outs = models.data(stem)
    step = sp.microbatch(B)
    # the per-microbatch module really works on 16/B examples
    shapes = {s.index: p.shape.dims for s, p in zip(step.microbatch_inputs,
                                                     step.microbatch.entry.parameters)
              if s.kind == "batch_slice"}
    assert shapes and all(dims[0] == 16 // B for dims in shapes.values())
    assert any(s.kind == "accumulate" for s in step.microbatch_outputs)
    got = run_microbatched(step, args, B)
    _assert_close(got, outs, f"{stem} B={B} vs npz")
    _assert_close(got, models.unsplit(stem), f"{stem} B={B} vs unsplit")


def test_train_split_structure(models):
    for model, params in (("mlp", 25), ("gpt", 205), ("bert", 220), ("moe", 115)):
        sp = models.split(f"{model}_train")
        # the loss is a batch sum; one accumulated gradient per parameter (+ the loss's sum)
        assert [sp.cls(x) for x in sp.loss] == [PSUM]
        assert sp.forward and sp.backward
        assert len(sp.accumulated) == (params - 1) // 3 + 1
        assert sp.sizes["microbatch"]["flops"] > 5 * sp.sizes["epilogue"]["flops"]
        assert sp.sizes["epilogue"]["instructions"] > 0
        json.dumps(sp.summary())
    # BERT: the loss divides by sum(mlm_weights), a whole-batch statistic of the batch alone,
    # computed once in a prologue; its reciprocal scales every example's gradient
    bert = models.split("bert_train")
    assert bert.prologue_values and bert.sizes["prologue"]["instructions"] < 20
    step = bert.microbatch(2)
    assert step.prologue is not None
    assert any(s.kind == "prologue" for s in step.microbatch_inputs)
    assert all(s.kind == "param" and s.index == 222 for s in step.prologue_inputs)
    for model in ("mlp", "gpt", "moe"):
        assert not models.split(f"{model}_train").prologue_values


# ---- acceptance 2: forward programs ---------------------------------------------------------

@pytest.mark.parametrize("B", [2, 8])
@pytest.mark.parametrize("model", ["mlp", "gpt", "bert", "moe", "wresnet"])
def test_forward_microbatched_exactly(models, model, B):
    from alpac.analysis.step.execute import run_microbatched
    stem = f"{model}_fwd"
    sp = models.split(stem)
    assert sp.refusal is None, sp.refusal
    assert not sp.accumulated and len(sp.concatenated) == 1 and sp.concatenated[0][1] == 0
    assert not sp.backward
    step = sp.microbatch(B)
    assert [s.kind for s in step.microbatch_outputs] == ["concatenate"]
    args, outs = models.data(stem)
    got = run_microbatched(step, args, B)
    _assert_close(got, outs, f"{stem} B={B} vs npz")
    _assert_close(got, models.unsplit(stem), f"{stem} B={B} vs unsplit")


# ---- acceptance 3: batch norm ----------------------------------------------------------------

def test_wresnet_train_refused_naming_batch_norm(models):
    sp = models.split("wresnet_train")
    assert sp.batch.dims == {90: 0, 91: 0}
    at = sp.refused_at
    assert at is not None and at.opcode == "reduce"
    # the statistic: a sum over batch, height and width of a conv output (NHWC)
    assert set(at.dims("dimensions")) == {0, 1, 2} and at.operands[0].shape.rank == 4
    assert f"batch statistic %{at.name}" in sp.refusal
    assert "used per example" in sp.refusal and "would change the result" in sp.refusal
    with pytest.raises(MicrobatchRefused, match=f"%{at.name}"):
        sp.microbatch(2)
    # the forward program uses the running statistics: nothing to refuse there
    assert models.split("wresnet_fwd").refusal is None


def test_batch_norm_training_opcode_refused():
    module = parse_hlo("""
HloModule bn
ENTRY main {
  x = f32[8,4] parameter(0)
  s = f32[4] parameter(1)
  o = f32[4] parameter(2)
  bn = (f32[8,4], f32[4], f32[4]) batch-norm-training(x, s, o), epsilon=0.001, feature_index=1
  ROOT y = f32[8,4] get-tuple-element(bn), index=0
}
""")
    sp = StepSplit(module, batch_info_from_args(module, {0: 0}))
    assert sp.refused_at is not None and sp.refused_at.name == "bn"
    assert "batch-norm-training %bn" in sp.refusal


# ---- acceptance 4: MaxText / DeepSeek --------------------------------------------------------

@pytest.mark.skipif(not MAXTEXT.exists(), reason="hlo-corpus not available")
def test_maxtext_analysed():
    module = parse_hlo(MAXTEXT.read_text())
    inline_calls(module)
    info = detect_batch(module)
    assert info.dims == {33: 0, 34: 0, 35: 0, 36: 0, 37: 0} and info.size == 16
    assert info.confidence == "high"
    sp = StepSplit(module, info)
    # the loss is found through the scanned layers (while loops analysed to a fixed point)
    assert len(sp.loss) == 1 and sp.refusal is None, sp.refusal
    assert sp.sizes["microbatch"]["flops"] > 1000 * sp.sizes["epilogue"]["flops"]
    json.dumps(sp.summary())
    # the per-microbatch module (two scans over the layers, shrunk to 2 of 16 sequences) is
    # valid HLO for XLA: it compiles (too big to run here)
    from alpac.analysis.step.execute import compiled
    from alpac.hlo import print_module
    step = sp.microbatch(8)
    whiles = [x for x in step.microbatch.entry.instructions if x.opcode == "while"]
    assert len(whiles) == 2
    assert all("[2,2048,2560]" in str(w.shape) for w in whiles)
    assert "s32[2,2048]" in print_module(step.microbatch)  # the token slices
    compiled(step.microbatch)


@pytest.mark.skipif(not DEEPSEEK.exists(), reason="hlo-corpus not available")
def test_deepseek_analysed():
    module = parse_hlo(DEEPSEEK.read_text())
    inline_calls(module)
    info = detect_batch(module)
    assert info.dims == {228: 0, 229: 0, 230: 0, 231: 0} and info.size == 32
    sp = StepSplit(module, info)
    assert len(sp.loss) == 1
    # FP8 delayed scaling keeps the amax (a max over the batch) per layer in the loop state
    assert sp.refusal is not None and "maximum over the batch" in sp.refusal
    assert sp.flow.assumed  # fused kernels' batch dims read from their Shardy rules
    json.dumps(sp.summary())


# ---- while loops: a scan over layers ---------------------------------------------------------

def test_scan_over_layers_microbatched_exactly():
    """A jax training step whose layers run in lax.scan (while loops forward and backward, a
    batch-sized attention mask carried unchanged through the loop): the loops are rewritten
    with their carried activations shrunk, and the result is exact."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from alpac.analysis.step.execute import run_microbatched
    from alpac.xla.bridge import run_hlo_single_device
    L, D, N, S = 3, 8, 8, 4

    def loss(params, x, y):
        mask = jnp.where(lax.broadcasted_iota(jnp.int32, (N, S, S), 1)
                         >= lax.broadcasted_iota(jnp.int32, (N, S, S), 2), 0.0, -1e9)

        def layer(h, p):
            a = jnp.einsum("nsd,ntd->nst", h @ p["q"], h) + mask
            h = h + jnp.einsum("nst,ntd->nsd", jax.nn.softmax(a, -1), h)
            return jnp.tanh(h @ p["w"] + p["b"]), None

        h, _ = lax.scan(layer, x, params)
        return jnp.mean((h - y) ** 2)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value

    rng = np.random.default_rng(0)
    params = {"b": np.zeros((L, D), np.float32),
              "q": (rng.standard_normal((L, D, D)) * 0.3).astype(np.float32),
              "w": (rng.standard_normal((L, D, D)) * 0.3).astype(np.float32)}
    x = rng.standard_normal((N, S, D)).astype(np.float32)
    y = rng.standard_normal((N, S, D)).astype(np.float32)
    text = jax.jit(step, donate_argnums=(0,), keep_unused=True).lower(params, x, y).as_text(
        dialect="hlo")
    module = parse_hlo(text)
    inline_calls(module)
    assert sum(x.opcode == "while" for x in module.entry.instructions) == 2
    info = detect_batch(module)
    assert info.dims == {3: 0, 4: 0} and info.confidence == "high"
    sp = StepSplit(module, info)
    assert sp.refusal is None and len(sp.loss) == 1
    assert sum(x.opcode == "while" for x in sp.parts["microbatch"]) == 2
    args = [params["b"], params["q"], params["w"], x, y]
    want = run_hlo_single_device(text, args)
    for B in (2, 8):
        step_b = sp.microbatch(B)
        whiles = [w for w in step_b.microbatch.entry.instructions if w.opcode == "while"]
        assert all(f"[{N // B},{S},{D}]" in str(w.shape) for w in whiles)
        _assert_close(run_microbatched(step_b, args, B), want, f"scan B={B}")


# ---- forward/backward pairing ----------------------------------------------------------------

def _dot_depth_layers(sp: StepSplit, dots_per_layer: int, layers: int) -> dict:
    """A simple forward layering: the number of batch dots on the longest path, per layer."""
    depth = {}
    forward = set(sp.forward)
    for x in sp.module.entry.instructions:
        if x in forward:
            depth[x] = max((depth[o] + (o.opcode == "dot" and sp.cls(o).kind == "S")
                            for o in x.operands if o in depth), default=0)
    return {x: min(d // dots_per_layer, layers - 1) for x, d in depth.items()}


@pytest.mark.parametrize("model,per,layers", [("gpt", 6, 4), ("mlp", 1, 4)])
def test_backward_layers(models, model, per, layers):
    sp = models.split(f"{model}_train")
    forward_layer = _dot_depth_layers(sp, per, layers)
    back = sp.backward_layers(forward_layer)
    assert set(back) == set(sp.backward)
    assert set(back.values()) == set(range(layers))
    for b in sp.backward:  # the backward runs from the last layer to the first
        for u in b.operands:
            if u in back:
                assert back[b] <= back[u], (u.name, b.name)
    # every weight's gradient lands in the layer of the dot that uses the weight
    users = sp.module.entry.users()
    forward = set(sp.forward)
    acc = set(sp.accumulated)
    checked = 0
    for f in sp.forward:
        if f.opcode != "dot":
            continue
        for w in f.operands:
            if w.opcode != "parameter" or w.parameter_number in sp.batch.dims or \
                    [u for u in users[w] if u in forward] != [f]:
                continue
            grads = _accumulated_behind(sp.outputs[w.parameter_number], acc)
            assert grads, w.name
            for g in grads:
                assert back[g] == forward_layer[f], (w.name, g.name)
                checked += 1
    assert checked >= (24 if model == "gpt" else 4)
    table = sp.layer_table(forward_layer)
    assert [row["layer"] for row in table] == list(range(layers))
    assert all(row["backward_flops"] > 0 for row in table)


def _accumulated_behind(x, acc) -> list:
    seen, out, stack = set(), [], [x]
    while stack:
        y = stack.pop()
        if id(y) in seen:
            continue
        seen.add(id(y))
        if y in acc:
            out.append(y)
        elif y.opcode != "parameter":
            stack.extend(y.operands)
    return out


# ---- small modules: the rules one at a time -------------------------------------------------

_REGIONS = """
add_f32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

max_f32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] maximum(a, b)
}
"""


def test_classes_of_small_module():
    module = parse_hlo("HloModule t\n" + _REGIONS + """
ENTRY main {
  x = f32[8,16,4] parameter(0)
  w = f32[4,4] parameter(1)
  zero = f32[] constant(0)
  n = f32[] constant(128)
  flat = f32[128,4] reshape(x)
  h = f32[128,4] dot(flat, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  back = f32[8,16,4] reshape(h)
  t = f32[16,8,4] transpose(back), dimensions={1,0,2}
  gw = f32[4,4] dot(flat, h), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  s = f32[] reduce(back, zero), dimensions={0,1,2}, to_apply=add_f32
  nb = f32[] broadcast(n), dimensions={}
  mean = f32[] divide(s, nb)
  off = f32[] add(mean, n)
  m = f32[] reduce(back, zero), dimensions={0,1,2}, to_apply=max_f32
  ROOT r = (f32[16,8,4], f32[4,4], f32[], f32[], f32[]) tuple(t, gw, mean, off, m)
}
""")
    sp = StepSplit(module, batch_info_from_args(module, {0: 0}))
    by_name = {x.name: x for x in module.entry.instructions}
    c = sp.cls
    assert c(by_name["flat"]) == split(0, 16)  # the batch merged with the sequence
    assert c(by_name["h"]) == split(0, 16)
    assert c(by_name["back"]) == split(0)
    assert c(by_name["t"]) == split(1)
    assert c(by_name["gw"]) == PSUM  # contracts the batch: a weight gradient
    assert c(by_name["mean"]) == PSUM  # a sum over examples divided by a constant
    assert c(by_name["off"]).kind == "F"  # affine: adding n per microbatch would count it B x
    assert c(by_name["m"]).kind == "F"  # a max over the batch
    assert sp.refusal is None
    assert [x.name for x in sp.loss] == ["mean"]
    # the max needs every example: the per-example values it reads are concatenated
    assert [(x.name, d) for x, d in sp.concatenated] == [("back", 0), ("t", 1)]


def test_iota_over_the_batch_and_full_outputs_run_exactly():
    """An iota along the batch dim is sliced at microbatch_index x 4; a max over the batch is
    computed once per step from the concatenated per-example values."""
    from alpac.analysis.step.execute import run_microbatched
    from alpac.xla.bridge import run_hlo_single_device
    text = "HloModule t\n" + _REGIONS + """
ENTRY main {
  x = f32[8,4] parameter(0)
  w = f32[4,4] parameter(1)
  io = s32[8,4] iota(), iota_dimension=0
  iof = f32[8,4] convert(io)
  y = f32[8,4] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  z = f32[8,4] add(y, iof)
  ninf = f32[] constant(-inf)
  m = f32[4] reduce(z, ninf), dimensions={0}, to_apply=max_f32
  zero = f32[] constant(0)
  s = f32[] reduce(z, zero), dimensions={0,1}, to_apply=add_f32
  ROOT r = (f32[8,4], f32[4], f32[]) tuple(z, m, s)
}
"""
    module = parse_hlo(text)
    sp = StepSplit(module, batch_info_from_args(module, {0: 0}))
    assert sp.refusal is None
    step = sp.microbatch(2)
    assert any(s.kind == "microbatch_index" for s in step.microbatch_inputs)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((8, 4)).astype(np.float32),
            rng.standard_normal((4, 4)).astype(np.float32)]
    want = run_hlo_single_device(text, args)
    _assert_close(run_microbatched(step, args, 2), want, "iota module")


def test_microbatch_count_must_divide_the_batch(models):
    with pytest.raises(MicrobatchRefused, match="does not divide"):
        models.split("mlp_train").microbatch(3)
    step = models.split("mlp_train").microbatch(16)  # one example per microbatch
    assert step.num_microbatches == 16
    json.dumps(step.to_dict())
    assert set(step.texts()) == {"microbatch", "epilogue"}


def test_module_texts_parse_back(models):
    """The emitted modules print as HLO that alpac's own parser reads back unchanged."""
    from alpac.hlo import print_module
    step = models.split("bert_train").microbatch(4)
    for name, text in step.texts().items():
        assert print_module(parse_hlo(text)) == text, name
    assert Path(MODELS / "bert_train.hlo").exists()
