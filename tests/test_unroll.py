"""Scanned layers pipelined: layer loops unrolled (their stacked arrays cut per layer) or, in a
forced pipeline, cut into one loop per stage (stacked arrays cut per stage), and plans of the
scanned zoo language models (with and without nn.remat) run under alpa-run on two nodes x two
devices, equal to one device; the stages hold only their own layers' rows.
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


def unrolled(name: str, stages: int = 0):
    module = load_module(ZOO / f"{name}.hlo")
    inline_calls(module)
    flatten_entry_tuple_params(module)
    return unroll_layer_loops(module, stages)


@pytest.mark.parametrize("name", ["flax_scan_lm_train", "flax_scan_remat_lm_train"])
@pytest.mark.parametrize("stages", [0, 2, 3])
def test_the_cut_step_computes_the_scanned_one_with_every_stacked_array_cut(name, stages):
    """Unrolled (stages 0): no loop left, one parameter per layer of each stacked array; one
    loop per stage (2 or 3 of the 6 layers' loops): that many loops per layer loop, each
    stacked array cut into as many pieces of 6 / stages rows."""
    work, done = unrolled(name, stages)
    verify_module(work)
    loops = [x for x in work.entry.instructions if x.opcode == "while"]
    assert len(loops) == 2 * stages and sorted(x.name for x in loops) == sorted(done.per_stage)
    # 16 stacked weights, their two Adam moments: 48 arrays of 6 layers
    pieces = [p for p in done.parameters if p.first is not None]
    assert len(pieces) == 48 * (stages or 6)
    assert {p.stop - p.first for p in pieces} == {6 // stages if stages else 1}
    assert len(done.layer_axes()) == (len(pieces) if stages else 0)
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
def test_two_forced_stages_each_loop_over_their_own_layers_and_match_one_device(name, root):
    """A forced pipeline keeps the loops, one per stage: stage 0 loops over layers 0-2 and
    stage 1 over 3-5, each reading only its own rows of every stacked array (a piece of 3
    rows); with nn.remat, the mask the body builds at batch size is built per microbatch."""
    path = plan(name, True, root)
    entries = json.loads((path / "plan.json").read_text())
    assert [s["loop_iterations"] for s in entries["stages"]] == [[0, 1, 2], [3, 4, 5]]
    assert len(entries["layer_loops"]["per_stage"]) == 4 and "why" not in entries["layer_loops"]
    # nn.remat's barriers stay in the loop bodies: the program recomputes, alpac adds nothing
    recompute = "program" if "remat" in name else "none"
    assert [list(s["remat"].values()) for s in entries["stages"]] == [[recompute]] * 2
    program = entries["program"]
    pieces = program["layout"]["parameters"]
    piece_of = {i["value"]: i["parameter"] for i in program["inputs"]
                if pieces[i["parameter"]][1] is not None}
    stages_of: dict[str, set] = {}
    for m in program["modules"]:
        for p in m["parameters"]:
            if p["value"] in piece_of:
                stages_of.setdefault(p["value"], set()).add(m["stage"])
    assert len(stages_of) == 48 * 2  # each stage's rows of every stacked array are an input
    for value, stages in stages_of.items():
        first, stop = pieces[piece_of[value]][1:3]
        assert stop - first == 3 and stages == {first // 3}
    for stage in (0, 1):
        for role in ("forward", "backward"):
            assert "while(" in (path / f"stage{stage}.{role}.hlo").read_text()
    r = ok(alpa_run(path, "--check", "--rtol", "1e-5", "--inputs", ZOO / f"{name}.npz",
                    "--iters", "2", "--", "np", "4"))
    assert "passed" in r.stdout


def test_a_given_number_of_layers_unrolls_the_loops(root):
    """--layers asks for layers the stage DP cuts between: with a loop per stage there would
    be one layer per stage, so the loops are unrolled, and the plan says why."""
    out = root / "four-layers"
    subprocess.run([str(BIN / "alpac"), "compile", str(ZOO / "flax_scan_lm_train.hlo"),
                    "--cluster", str(root / "two-by-two.yaml"), "-o", str(out), *FORCED,
                    "--layers", "4"], check=True, capture_output=True, timeout=600)
    entries = json.loads((out / "plan.json").read_text())
    assert entries["layer_loops"]["unrolled"] and "--layers 4" in entries["layer_loops"]["why"]
    assert entries["pipeline"]["layers"] == 4


def test_a_trip_count_that_does_not_divide_into_the_stages_is_unrolled(root):
    """Six layers into four forced stages: unrolled, and the plan says why."""
    cluster = root / "four.yaml"
    cluster.write_text(TWO_BY_TWO.replace("nodes: 2", "nodes: 4").replace(
        "devices_per_node: 2", "devices_per_node: 1"))
    out = root / "four-stages"
    subprocess.run([str(BIN / "alpac"), "compile", str(ZOO / "flax_scan_lm_train.hlo"),
                    "--cluster", str(cluster), "-o", str(out), "--strategy",
                    "megatron:dp=1,tp=1,pp=4"], check=True,
                   capture_output=True, timeout=600)
    loops = json.loads((out / "plan.json").read_text())["layer_loops"]
    assert loops["unrolled"] and "(6, 6) would not divide into 4 stages" in loops["why"]


@pytest.mark.parametrize("name", ["flax_scan_lm_train", "flax_scan_remat_lm_train"])
def test_the_automatic_plan_of_a_scanned_step_matches_one_device(name, root):
    path = plan(name, False, root)
    r = ok(alpa_run(path, "--check", "--rtol", "1e-5", "--inputs", ZOO / f"{name}.npz", "--",
                    "np", "4"))
    assert "passed" in r.stdout


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_loop_kept_for_a_stage_is_recomputed_as_asked(mode, root):
    """--remat on a stage whose layer is its loop: full recomputes the loop in the backward,
    selective its cheap work; the loop's results pass as values, never as its tuple."""
    out = root / f"remat-{mode}"
    subprocess.run([str(BIN / "alpac"), "compile", str(ZOO / "flax_scan_lm_train.hlo"),
                    "--cluster", str(root / "two-by-two.yaml"), "-o", str(out), *FORCED,
                    "--remat", mode], check=True, capture_output=True, timeout=600)
    entries = json.loads((out / "plan.json").read_text())
    assert len(entries["layer_loops"]["per_stage"]) == 4
    assert [list(s["remat"].values()) for s in entries["stages"]] == [[mode]] * 2
    r = ok(alpa_run(out, "--check", "--rtol", "1e-5", "--inputs",
                    ZOO / "flax_scan_lm_train.npz", "--iters", "2", "--", "np", "4"))
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
    the cut inputs piece by piece (two stages' pieces of two arrays), and three steps run
    equal to three steps on one device."""
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
    assert len(program["aliases"]) == 2 * 2 and program["layout"]["aliases"] == [[0, 0], [1, 1]]
    r = ok(alpa_run(out, "--check", "--rtol", "1e-5", "--iters", "3", "--", "np", "4"))
    assert "passed" in r.stdout
