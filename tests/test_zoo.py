"""Programs written by others (testdata/zoo): a sample of them compiles and runs under
alpa-run equal to its front end's own result, one configuration per program (every program in
every configuration: `make zoo`); the corpus modules given before partitioning compile for the
DGX cluster."""

import json
from pathlib import Path

import numpy as np
import pytest

from testdata.zoo import run as zoo

PROGRAMS = sorted(zoo.manifest())
CONFIGS = list(zoo.CONFIGS)
# Every front end, configuration and kind of program, at the least cost (a run of each takes
# 10-70 s here), each in one configuration: the scanned language models (one with dropout,
# whose PRNG loops and per-layer keys once broke two stages of one-device ranks under gloo),
# one decoder LM of the Hugging Face family (GPT-2, GPT-J, GPT-Neo, OPT, LLaMA, Mistral, Gemma:
# LLaMA's RoPE and RMSNorm), BERT with remat, ELECTRA, ResNet, the forward passes, the opcode
# programs, Keras and PyTorch/XLA. The rest, and every program in every configuration:
# `make zoo`.
SAMPLE = {
    "flax_scan_dropout_lm_train": "2x2-pp2",
    "flax_scan_lm_fwd": "default",
    "flax_scan_lm_train": "2x2",
    "flax_scan_remat_lm_train": "2x2-mb4",
    "hf_bert_fwd": "2x2-mb4",
    "hf_bert_remat_train": "2x2-pp2-remat",
    "hf_electra_train": "default",
    "hf_gpt2_train": "2x2-pp2",
    "hf_llama_train": "2x2",
    "hf_resnet_train": "2x2-pp2-remat",
    "hf_t5_fwd": "2x2",
    "hf_vit_fwd": "2x2-pp2",
    "opc_batchnorm_train": "default",
    "opc_lapack_fwd": "2x2",
    "opc_linalg_train": "2x2-mb4",
    "opc_pool_sort_train": "2x2-pp2",
    "opc_random_train": "2x2-pp2-remat",
    "opc_spectral_train": "default",
    "opc_xla_ops_fwd": "2x2",
    "tf_keras_cnn_train": "2x2-mb4",
    "tf_keras_transformer_train": "2x2-pp2",
    "torch_xla_gpt_train": "2x2-pp2-remat",
}


@pytest.mark.parametrize("name,config", SAMPLE.items())
def test_zoo_program_runs_exact(name, config, tmp_path):
    outcome = zoo.run_one(name, config, tmp_path)
    assert outcome.status == "exact", (config, outcome.reason, outcome.worst)


def test_zoo_covers_three_front_ends():
    front_ends = {info["frontend"] for info in zoo.manifest().values()}
    assert {"jax-flax", "tensorflow", "pytorch-xla"} <= front_ends, front_ends


def test_the_sample_covers_every_configuration_and_front_end():
    manifest = zoo.manifest()
    assert set(SAMPLE) <= set(manifest)
    assert set(SAMPLE.values()) == set(CONFIGS)
    assert {manifest[p]["frontend"] for p in SAMPLE} == {i["frontend"] for i in manifest.values()}
    assert {p for p in PROGRAMS if p.startswith(("opc_", "tf_", "torch_"))} <= set(SAMPLE)


def test_an_output_is_noise_only_as_near_the_float64_result_as_the_reference(tmp_path):
    """BEiT's class token (unused by its mean pooling) has a gradient of pure cancellation that
    Adam scales to a full step: the float32 reference itself is 3e-5 from the program run in
    float64, and a plan's result as near is reduction noise; a value 1e-3 off is not."""
    info = zoo.manifest()["hf_beit_train"]
    hlo, npz = (Path(info["dir"]) / f"hf_beit_train.{ext}" for ext in ("hlo", "npz"))
    ref = np.load(npz)
    outs = {k: ref[k] for k in ref.files if k.startswith("out")}
    np.savez(tmp_path / "same.npz", **outs)
    np.savez(tmp_path / "wrong.npz", **{**outs, "out0": outs["out0"] + 1e-3 * np.abs(
        outs["out0"]).max()})
    same = zoo.f64_errors("same", hlo, npz, tmp_path / "same.npz", tmp_path)
    assert same["out0"][0] == same["out0"][1] > 1e-5
    wrong = zoo.f64_errors("wrong", hlo, npz, tmp_path / "wrong.npz", tmp_path)
    assert wrong["out0"][0] > 10 * zoo.TRUTH_FACTOR * wrong["out0"][1]
    assert wrong["out1"] == same["out1"]


MAXTEXT = "nv_maxtext_1n1g_jit_train_step_before_optimization"


@pytest.mark.parametrize("name", ["mobilenet_v2", MAXTEXT,
                                  "nv_maxtext_deepseek_1n4g_jit_train_step_before_optimization"])
def test_corpus_module_compiles_on_the_dgx_cluster(name, tmp_path):
    """MobileNet-V2 once ran out of memory (an RNG's constant arithmetic priced along every
    path), MaxText crashed (no dot outside its layer loop), DeepSeek did not fit (loop state,
    annotations and custom kernels forced replicated). MaxText's scanned decoder pipelines:
    two stages forced here (the automatic plan takes 80 s: `make zoo`), each looping over its
    own iterations of the layer loops."""
    flags = ("--strategy", "megatron:dp=4,tp=4,pp=2") if name == MAXTEXT else ()
    outcome = zoo.compile_corpus(name, tmp_path, flags=flags)
    assert outcome.status == "compiled", outcome.reason
    assert outcome.compile_peak_mb < 4096
    plan = json.loads((tmp_path / f"{name}.plan" / "plan.json").read_text())
    if name == MAXTEXT:
        first, second = (s["loop_iterations"] for s in plan["stages"])
        assert first[0] == 0 and second[-1] == 7 and max(first) <= min(second) + 1
        # one loop per stage, each holding its stage's rows of the stacked weights and
        # Adam's moments (8 stacked weights, 3 arrays each, 2 pieces)
        assert len(plan["layer_loops"]["per_stage"]) == 4
        assert plan["layer_loops"]["cut_parameters"] == 3 * 8 * 2
