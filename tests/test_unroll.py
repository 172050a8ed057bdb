"""Scanned layers pipelined: layer loops unrolled, their stacked arrays cut per layer, and
plans of the scanned zoo language models (with and without nn.remat) run under alpa-run on
two nodes x two devices, equal to one device; the stages hold only their own layers' rows.
"""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from conftest import TESTDATA
from test_runtime import BIN, alpa_run, ok

from alpac.hlo import print_module
from alpac.hlo.transforms import flatten_entry_tuple_params, inline_calls
from alpac.hlo.verify import verify_module
from alpac.interop.unroll import unroll_layer_loops
from alpac.runtime.data import Layout, entry_parameters, random_input
from alpac.xla.bridge import run_hlo_single_device
from alpac.xla.loader import load_module

ZOO = TESTDATA / "zoo" / "programs"
TWO_BY_TWO = """name: two-by-two
nodes: 2
devices_per_node: 2
device: {name: cpu, memory: 3GiB, flops: {f32: 20e9}}
links:
  intra_node: {bandwidth: 10GB/s, latency: 2us}
  inter_node: {bandwidth: 5GB/s, latency: 5us}
"""
FORCED = ("--strategy", "megatron:dp=1,tp=2,pp=2", "--micro-batches", "4")


def unrolled(name: str):
    module = load_module(ZOO / f"{name}.hlo")
    inline_calls(module)
    flatten_entry_tuple_params(module)
    return unroll_layer_loops(module)


@pytest.mark.parametrize("name", ["flax_scan_lm_train", "flax_scan_remat_lm_train"])
def test_the_unrolled_step_computes_the_scanned_one_with_every_stacked_array_cut(name):
    work, done = unrolled(name)
    verify_module(work)
    assert not any(x.opcode == "while" for x in work.entry.instructions)
    # 16 stacked weights, their two Adam moments: 48 arrays of 6 layers, one parameter a layer
    assert sum(p.first is not None for p in done.parameters) == 48 * 6
    assert not done.whole
    source = entry_parameters(done.source_text)
    args = {p.number: random_input(3, p) for p in source}
    layout = Layout(**done.layout())
    outs = run_hlo_single_device(print_module(work),
                                 list(layout.cut(args, range(len(done.parameters))).values()))
    refs = run_hlo_single_device(done.source_text, [args[p.number] for p in source])
    for out, ref in zip(layout.join(outs), refs):
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_a_forward_pass_alone_keeps_its_loop():
    module = load_module(ZOO / "flax_scan_lm_fwd.hlo")
    inline_calls(module)
    assert unroll_layer_loops(module) is None  # nothing to pipeline: no backward


@cache
def plan(name: str, forced: bool, out_root: Path) -> Path:
    cluster = out_root / "two-by-two.yaml"
    out = out_root / f"{name}-{'forced' if forced else 'auto'}"
    subprocess.run([str(BIN / "alpac"), "compile", str(ZOO / f"{name}.hlo"), "--cluster",
                    str(cluster), "-o", str(out), *(FORCED if forced else ())],
                   check=True, capture_output=True, text=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Plans of this module, and the two-node x two-device cluster they are made for."""
    path = tmp_path_factory.mktemp("unrolled-plans")
    (path / "two-by-two.yaml").write_text(TWO_BY_TWO)
    return path


@pytest.mark.parametrize("name", ["flax_scan_lm_train", "flax_scan_remat_lm_train"])
def test_two_forced_stages_hold_their_own_layers_and_match_one_device(name, root):
    path = plan(name, True, root)
    entries = json.loads((path / "plan.json").read_text())
    first, second = (s["loop_iterations"] for s in entries["stages"])
    assert first[0] == 0 and second[-1] == 5 and sorted(set(first + second)) == list(range(6))
    assert max(first) <= min(second) + 1  # a cut inside one iteration at most
    program = entries["program"]
    pieces = program["layout"]["parameters"]
    piece_of = {i["value"]: i["parameter"] for i in program["inputs"]
                if pieces[i["parameter"]][1] is not None}
    stages_of: dict[str, set] = {}
    for m in program["modules"]:
        for p in m["parameters"]:
            if p["value"] in piece_of:
                stages_of.setdefault(p["value"], set()).add(m["stage"])
    assert len(stages_of) == 48 * 6  # every layer's row of every stacked array is an input
    shared = {pieces[piece_of[v]][1] for v, s in stages_of.items() if len(s) > 1}
    assert len(shared) <= 1  # of one stage only, but where the cut falls inside an iteration
    r = ok(alpa_run(path, "--check", "--rtol", "1e-5", "--inputs", ZOO / f"{name}.npz",
                    "--iters", "2", "--", "np", "4"))
    assert "passed" in r.stdout


def test_the_automatic_plan_of_a_scanned_step_matches_one_device(root):
    path = plan("flax_scan_lm_train", False, root)
    r = ok(alpa_run(path, "--check", "--rtol", "1e-5", "--inputs",
                    ZOO / "flax_scan_lm_train.npz", "--", "np", "4"))
    assert "passed" in r.stdout


def test_one_stage_on_a_given_mesh_keeps_the_loops(tmp_path):
    out = tmp_path / "plan"
    subprocess.run([str(BIN / "alpac"), "compile", str(ZOO / "flax_scan_lm_train.hlo"),
                    "--mesh", "2x4", "-o", str(out)], check=True, capture_output=True,
                   timeout=600)
    entries = json.loads((out / "plan.json").read_text())
    assert "layer_loops" not in entries and "layout" not in entries["program"]
    assert "while" in (out / entries["stages"][0]["module"]).read_text()


def test_without_unrolling_the_one_stage_plan_names_the_loops(root):
    out = root / "not-unrolled"
    subprocess.run([str(BIN / "alpac"), "compile", str(ZOO / "flax_scan_lm_train.hlo"),
                    "--cluster", str(root / "two-by-two.yaml"), "--skip-pass",
                    "unroll-layer-loops", "-o", str(out)], check=True, capture_output=True,
                   timeout=600)
    refused = json.loads((out / "plan.json").read_text())["pipelining"]["refused"]
    assert "while.57: forward over 6 layers" in refused and "not unrolled" in refused


def test_donated_stacked_state_carries_over_steps(root):
    """A scanned step that donates its stacked weights and momenta: the cut outputs alias
    the cut inputs piece by piece, and three steps run equal to three steps on one device."""
    import jax
    import jax.numpy as jnp

    def step(ws, ms, x, y):
        def loss(ws):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
            return jnp.mean((h - y) ** 2)
        value, g = jax.value_and_grad(loss)(ws)
        ms = 0.9 * ms + g
        return ws - 0.1 * ms, ms, value

    shapes = [np.zeros((4, 16, 16), np.float32)] * 2 + [np.zeros((8, 16), np.float32)] * 2
    text = jax.jit(step, donate_argnums=(0, 1)).lower(*shapes).as_text(dialect="hlo")
    assert "input_output_alias" in text
    model = root / "donating.hlo"
    model.write_text(text)
    out = root / "donating"
    subprocess.run([str(BIN / "alpac"), "compile", str(model), "--cluster",
                    str(root / "two-by-two.yaml"), "-o", str(out), *FORCED],
                   check=True, capture_output=True, timeout=600)
    program = json.loads((out / "plan.json").read_text())["program"]
    assert len(program["aliases"]) == 2 * 4 and program["layout"]["aliases"] == [[0, 0], [1, 1]]
    r = ok(alpa_run(out, "--check", "--rtol", "1e-5", "--iters", "3", "--", "np", "4"))
    assert "passed" in r.stdout
