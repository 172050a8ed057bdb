"""Programs written by others (testdata/zoo): each compiles and runs under alpa-run equal to
its front end's own result, in one configuration per program (all of them: `make zoo`); the
corpus modules given before partitioning compile for the DGX cluster."""

import json

import pytest

from testdata.zoo import run as zoo

PROGRAMS = sorted(zoo.manifest())
CONFIGS = list(zoo.CONFIGS)


@pytest.mark.parametrize("index,name", list(enumerate(PROGRAMS)))
def test_zoo_program_runs_exact(index, name, tmp_path):
    config = CONFIGS[index % len(CONFIGS)]  # every configuration is exercised by some program
    outcome = zoo.run_one(name, config, tmp_path)
    assert outcome.status == "exact", (config, outcome.reason, outcome.worst)


def test_zoo_covers_three_front_ends():
    front_ends = {info["frontend"] for info in zoo.manifest().values()}
    assert {"jax-flax", "tensorflow", "pytorch-xla"} <= front_ends, front_ends


MAXTEXT = "nv_maxtext_1n1g_jit_train_step_before_optimization"


@pytest.mark.parametrize("name", ["mobilenet_v2", MAXTEXT,
                                  "nv_maxtext_deepseek_1n4g_jit_train_step_before_optimization"])
def test_corpus_module_compiles_on_the_dgx_cluster(name, tmp_path):
    """MobileNet-V2 once ran out of memory (an RNG's constant arithmetic priced along every
    path), MaxText crashed (no dot outside its layer loop), DeepSeek did not fit (loop state,
    annotations and custom kernels forced replicated). MaxText's scanned decoder pipelines:
    two stages forced here (the automatic plan takes 80 s: `make zoo`), each holding its own
    iterations of the layer loops."""
    flags = ("--strategy", "megatron:dp=4,tp=4,pp=2") if name == MAXTEXT else ()
    outcome = zoo.compile_corpus(name, tmp_path, flags=flags)
    assert outcome.status == "compiled", outcome.reason
    assert outcome.compile_peak_mb < 4096
    plan = json.loads((tmp_path / f"{name}.plan" / "plan.json").read_text())
    if name == MAXTEXT:
        first, second = (s["loop_iterations"] for s in plan["stages"])
        assert first[0] == 0 and second[-1] == 7 and max(first) <= min(second) + 1
        assert plan["layer_loops"]["cut_parameters"] == 3 * 8 * 8  # weights, Adam's moments
