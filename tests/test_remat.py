"""Recomputation in pipeline stages (`--remat`): the plans compute what one device computes,
the backward modules really recompute (XLA holds less between a stage's forward and backward,
by what alpac estimated), and the stage DP recomputes only where memory asks for it."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from conftest import SCRATCH, TESTDATA
from test_runtime import alpa_run, ok

from alpac.driver import build_pipeline, compile_model
from alpac.plan.cluster import load_cluster
from alpac.xla.bridge import compile_hlo, cpu_devices

CLUSTER = TESTDATA / "clusters" / "local-cpu.yaml"


def test_per_layer_choice_against_brute_force():
    """The per-layer recomputation the stage DP gets for a memory limit: what it reports is
    what its modes add up to, it meets the limit whenever some choice does, and it is within
    one layer's move of the cheapest choice (found by trying every combination)."""
    import itertools

    import numpy as np

    from alpac.interop.remat import REMAT_MODES, RematMenu
    rng = np.random.default_rng(0)
    for _ in range(300):
        L = int(rng.integers(1, 6))
        kept = -np.sort(-rng.uniform(1, 10, (L, 3)), axis=1)
        seconds = np.sort(rng.uniform(0, 5, (L, 3)), axis=1)
        seconds[:, 0] = 0
        odd = rng.random(L) < 0.3  # selective slower than full: it must be skipped
        seconds[odd, 1] = seconds[odd, 2] + 1
        first = int(rng.integers(0, L))
        last = int(rng.integers(first, L))
        span = kept[first:last + 1]
        limit = rng.uniform(0.9 * span[:, 2].sum(), 1.1 * span[:, 0].sum())
        combos = [(sum(seconds[first + i, m] for i, m in enumerate(c)),
                   sum(kept[first + i, m] for i, m in enumerate(c)))
                  for c in itertools.product(range(3), repeat=last - first + 1)]
        best = min((t for t, k in combos if k <= limit), default=None)
        got = RematMenu(seconds, kept).choose(first, last, limit)
        assert (got is None) == (best is None)
        if got is None:
            continue
        extra, held, modes = got
        index = [REMAT_MODES.index(modes.get(i, REMAT_MODES[0])) for i in range(first, last + 1)]
        assert extra == pytest.approx(sum(seconds[first + i, m] for i, m in enumerate(index)))
        assert held == pytest.approx(sum(kept[first + i, m] for i, m in enumerate(index)))
        assert held <= limit + 1e-9
        assert extra <= best + seconds.max() + 1e-9
        assert not any(odd[i] and modes.get(i) == REMAT_MODES[1] for i in range(first, last + 1))


@cache
def plan(name: str, remat: str, budget: float | None = None) -> Path:
    """Two stages of one layer each on four devices each, four microbatches."""
    out = SCRATCH / f"alpac-remat-{name}-{remat}-{budget}"
    options = {"stage-construction": {"layers": "2", "stages": "0-0,1-1", "micro_batches": "4",
                                      "stage_meshes": "1x4,1x4", "jobs": "1", "remat": remat}}
    compile_model(TESTDATA / "models" / f"{name}.hlo", load_cluster(CLUSTER),
                  build_pipeline(None, (), options), out, memory_budget=budget)
    return out


def stages(path: Path) -> list[dict]:
    return json.loads((path / "plan.json").read_text())["stages"]


@pytest.mark.parametrize("name,remat", [("gpt_train", "selective"), ("bert_train", "full")])
def test_recomputing_plans_match_one_device(name, remat):
    path = plan(name, remat)
    assert [s["remat"] for s in stages(path)] == [{"0": remat}, {"1": remat}]
    r = ok(alpa_run(path, "--check", "--rtol", "1e-5", "--devices-per-rank", 8, "--", "np", 1))
    assert "passed" in r.stdout


def test_forward_hands_on_less_as_estimated():
    """For the BERT step, what a microbatch keeps from its forward for its backward leaves the
    forward module as outputs: XLA's compiled output bytes of each stage's forward module drop
    from `none` to `full` by the estimated activation bytes (within 15%), and the backward
    module's temporaries grow (it recomputes)."""
    measured = {}
    for remat in ("none", "full"):
        path = plan("bert_train", remat)
        for entry in stages(path):
            devices = cpu_devices(len(entry["mesh"]["devices"]))
            stats = {role: compile_hlo((path / file).read_text(), devices).memory_stats()
                     for role, file in entry["modules"].items()}
            measured[(remat, entry["index"])] = (
                stats, entry["estimate"]["activation_bytes_per_microbatch"])
    for s in (0, 1):
        (none, est_none), (full, est_full) = measured[("none", s)], measured[("full", s)]
        estimated = est_none - est_full
        drop = none["forward"]["output_bytes"] - full.get("forward", {}).get("output_bytes", 0)
        assert estimated > 0.5 * est_none
        assert abs(drop - estimated) <= 0.15 * estimated, (s, drop, estimated)
        assert full["backward"]["temp_bytes"] > none["backward"]["temp_bytes"]


def test_auto_recomputes_only_when_memory_asks():
    """With room to spare `auto` plans as `none`; with a budget that only recomputation meets
    it recomputes and fits."""
    roomy = stages(plan("gpt_train", "auto"))
    assert all(set(s["remat"].values()) == {"none"} for s in roomy)
    needed = max(s["estimate"]["peak_memory_bytes"] for s in roomy)
    tight = stages(plan("gpt_train", "auto", budget=0.8 * needed))
    assert any(set(s["remat"].values()) != {"none"} for s in tight)
    assert all(s["estimate"]["peak_memory_bytes"] <= 0.8 * needed for s in tight)


def test_programs_that_recompute_keep_their_checkpoints(tmp_path):
    """A Hugging Face BERT step written with gradient checkpointing (jax.checkpoint's
    opt-barriers) under `--remat full`: the layers the program checkpoints are left as the
    program has them (recorded as `program`, every opt-barrier still in the backward modules,
    none added), the others recompute, and the step matches the front end's own result."""
    from testdata.zoo import run as zoo
    outcome = zoo.run_one("hf_bert_remat_train", "2x2-pp2-remat", tmp_path)
    assert outcome.status == "exact", (outcome.reason, outcome.worst)
    path = tmp_path / "hf_bert_remat_train.2x2-pp2-remat.plan"
    remat = [s["remat"] for s in stages(path)]
    assert "program" in {m for r in remat for m in r.values()}
    assert "full" in {m for r in remat for m in r.values()}
    barriers = (path / "source.hlo").read_text().count(" opt-barrier(")
    emitted = sum(f.read_text().count(" opt-barrier(") for f in path.glob("stage*.*.hlo"))
    assert barriers > 0 and emitted == barriers
