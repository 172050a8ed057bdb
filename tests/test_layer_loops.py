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
from alpac.hlo import parse_hlo
from alpac.hlo.transforms import inline_calls
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
