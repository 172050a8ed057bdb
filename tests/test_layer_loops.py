"""Layer loops: a scan over stacked layers is recognised, with its backward; other loops are not.

Programs: the zoo's Flax nn.scan language models (with and without nn.remat), MaxText's
scanned decoder from the corpus, a scan and a fori_loop written here in plain JAX, and the
threefry RNG loops of a dropout step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHARED, TESTDATA

from alpac.analysis.layerloops import find_layer_loops
from alpac.analysis.tripcount import while_trip_count
from alpac.hlo import parse_hlo, print_module
from alpac.hlo.shapecheck import check_module
from alpac.hlo.transforms import inline_calls
from alpac.hlo.verify import verify_module
from alpac.interop.loopsplit import split_layer_loop
from alpac.intraop.autoshard import auto_shard
from alpac.plan.cluster import default_cluster
from alpac.plan.mesh import LogicalMesh
from alpac.xla.bridge import compile_hlo, cpu_devices, run_hlo_single_device
from alpac.xla.loader import load_module

ZOO = TESTDATA / "zoo" / "programs"


def loops_of(module):
    inline_calls(module)
    return find_layer_loops(module)


def loops_of_jax(fn, *args):
    return loops_of(parse_hlo(jax.jit(fn).lower(*args).as_text(dialect="hlo")))


@pytest.mark.parametrize("name,remat", [("flax_scan_lm_train", False),
                                        ("flax_scan_remat_lm_train", True)])
def test_a_scanned_training_step_has_a_forward_and_a_backward_layer_loop(name, remat):
    found = loops_of(load_module(ZOO / f"{name}.hlo"))
    forward, backward = found.loops
    assert (forward.trips, backward.trips) == (6, 6)
    assert (forward.reverse, backward.reverse) == (False, True)
    assert (forward.reads_saved_by, backward.reads_saved_by) == (None, forward.name)
    assert len(forward.stacked_inputs) == 16  # the block's weights, stacked
    assert len(backward.stacked_outputs) == 16  # their gradients
    assert len(forward.carried) == len(backward.carried) == 1  # activations / their gradient
    assert backward.recomputes == remat and not forward.recomputes
    assert not found.others


def test_a_scanned_forward_pass_has_one_layer_loop_that_saves_nothing():
    (loop,) = loops_of(load_module(ZOO / "flax_scan_lm_fwd.hlo")).loops
    assert (loop.trips, loop.reverse, loop.stacked_outputs) == (6, False, ())


def test_maxtexts_scanned_decoder_is_two_layer_loops_over_eight_layers():
    found = loops_of(load_module(
        SHARED / "hlo-corpus" / "nv_maxtext_1n1g_jit_train_step_before_optimization.hlo"))
    forward, backward = found.loops
    assert (forward.trips, backward.trips, backward.reverse) == (8, 8, True)
    assert backward.reads_saved_by == forward.name


def test_the_unrolled_twin_has_no_loops():
    found = loops_of(load_module(ZOO / "flax_unrolled_lm_train.hlo"))
    assert not found.loops and not found.others


def test_a_plain_jax_scan_and_its_gradient_are_layer_loops():
    def model(ws, x):
        y, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(y)

    ws, x = np.ones((5, 8, 8), np.float32), np.ones((4, 8), np.float32)
    (forward,) = loops_of_jax(model, ws, x).loops
    assert (forward.trips, forward.stacked_inputs != (), forward.reverse) == (5, True, False)
    forward, backward = loops_of_jax(jax.grad(model), ws, x).loops
    assert backward.reverse and backward.reads_saved_by == forward.name


def test_a_fori_loop_inside_a_layer_is_not_a_layer_loop():
    def power(w, x):
        return jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ w), x)

    found = loops_of_jax(power, np.ones((8, 8), np.float32), np.ones((4, 8), np.float32))
    assert not found.loops
    (name, why), = found.others
    assert "no slice of stacked arrays" in why


def test_threefry_rng_loops_are_not_layer_loops():
    found = loops_of(load_module(ZOO / "hf_gpt2_dropout_clip_sched_train.hlo"))
    assert not found.loops and found.others
    assert all("no dot" in why for _, why in found.others)


def reference(name: str) -> tuple[list, list]:
    with np.load(ZOO / f"{name}.npz") as z:
        args = [z[f"arg{k}"] for k in range(sum(1 for f in z.files if f.startswith("arg")))]
        outs = [z[f"out{k}"] for k in range(sum(1 for f in z.files if f.startswith("out")))]
    return args, outs


@pytest.mark.parametrize("name", ["flax_scan_lm_train", "flax_scan_remat_lm_train",
                                  "flax_scan_lm_fwd"])
def test_a_layer_loop_split_into_shorter_loops_computes_the_same(name):
    """Forward split at layers 2 and 5, backward at its iterations 1 and 4 (each loop of
    the split over its own slices): the step on one device equals the front end's result."""
    module = load_module(ZOO / f"{name}.hlo")
    found = loops_of(module)
    for loop, cuts in zip(found.loops, ([2, 5], [1, 4])):
        names = split_layer_loop(module, loop, cuts)
        assert len(names) == 3
    trips = [while_trip_count(x)[0] for x in module.entry.instructions if x.opcode == "while"]
    assert trips == [2, 3, 1, 1, 3, 2][:3 * len(found.loops)]
    args, want = reference(name)
    got = run_hlo_single_device(print_module(module), args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        # norm-wise, as the zoo compares: elementwise, 8 of 65536 values of the forward-only
        # LM come 1.4e-6 apart on this machine (its XLA sums in another order)
        assert np.linalg.norm(g - w) <= 1e-5 * max(np.linalg.norm(w), 1e-30)


def test_maxtexts_layer_loops_split_into_well_formed_loops():
    module = load_module(
        SHARED / "hlo-corpus" / "nv_maxtext_1n1g_jit_train_step_before_optimization.hlo")
    forward, backward = loops_of(module).loops
    split_layer_loop(module, forward, [3])
    split_layer_loop(module, backward, [5])
    verify_module(module)
    check_module(parse_hlo(print_module(module)), "split.hlo")
    found = find_layer_loops(module)
    assert [(x.trips, x.reverse) for x in found.loops] == \
        [(3, False), (5, False), (5, True), (3, True)]


def test_a_scanned_step_sharded_over_2x4_compiles_in_xla_and_computes_the_same():
    """A loop's result read by a reduce-scattered dot (a manual region): XLA partitions the
    get-tuple-element as the loop's element, so it reaches the region through a copy with
    the sharding the region needs (XLA's SPMD partitioner refused the module before)."""
    module = load_module(ZOO / "flax_scan_lm_train.hlo")
    inline_calls(module)
    mesh = LogicalMesh.parse("2x4")
    result = auto_shard(module, mesh, default_cluster(), time_limit=30)
    assert any(c.kind == "reduce-scatter" for _, c, _ in result.collectives)
    args, want = reference("flax_scan_lm_train")
    got = compile_hlo(print_module(result.module), cpu_devices(8)).run(args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
