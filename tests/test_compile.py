"""`alpac compile` with no options on the default local cluster, for every testdata model: the
plan fits the memory it was given by its own estimate, uses each device at most once, and its
program computes what the original module computes (run in one process on virtual devices)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TESTDATA
from program_interpreter import run_program

from alpac.driver import build_pipeline, compile_model
from alpac.plan.cluster import default_cluster
from alpac.plan.program import Program
from alpac.xla.bridge import run_hlo_single_device

MODELS = json.loads((TESTDATA / "models" / "manifest.json").read_text())


def model_names() -> list[str]:
    return sorted(p.stem for p in (TESTDATA / "models").glob("*.hlo"))


@pytest.mark.parametrize("name", model_names())
def test_default_compile_fits_and_computes_the_same(name, tmp_path):
    path = TESTDATA / "models" / f"{name}.hlo"
    _, out = compile_model(path, default_cluster(), build_pipeline(), tmp_path / "plan")
    plan = json.loads((out / "plan.json").read_text())
    budget = plan["memory_budget_bytes"]
    assert plan["estimate"]["peak_memory_bytes"] <= budget
    assert all(s["estimate"]["peak_memory_bytes"] <= budget for s in plan["stages"])
    devices = [d for s in plan["stages"] for d in s["mesh"]["devices"]]
    assert len(devices) == len(set(devices)) and set(devices) <= set(range(8))

    assert_computes_the_same(out, name)


def assert_computes_the_same(out, name: str) -> None:
    """The plan's program, run on virtual devices, equals the source on one device."""
    plan = json.loads((out / "plan.json").read_text())
    data = np.load(TESTDATA / "models" / f"{name}.npz")
    source = (out / "source.hlo").read_text()
    args = [data[f"arg{i}"] for i in range(sum(k.startswith("arg") for k in data.files))]
    program = Program.from_dict(plan["program"])
    texts = {p.name: p.read_text() for p in out.glob("*.hlo")}
    got = run_program(program, texts, args)
    want = run_hlo_single_device(source, args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        scale = max(float(np.max(np.abs(w))), 1e-30) if w.size else 1.0
        assert np.max(np.abs(g - w), initial=0.0) <= 1e-5 * scale, name


def test_a_tight_budget_gets_stages_that_store_weights_split(tmp_path):
    """Under a budget near the least the step can reach (100 KB; one stage of the step as it
    is fits 115 KB) the DP takes the memory-lean (ZeRO-3) layer option: the weights of those
    stages are stored split, and the plan still computes the same."""
    _, out = compile_model(TESTDATA / "models" / "mlp_train.hlo", default_cluster(),
                           build_pipeline(), tmp_path / "plan", memory_budget=100_000)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["estimate"]["peak_memory_bytes"] <= 100_000
    lean = [s for s in plan["stages"] if s["weights_stored_split"]]
    assert lean
    for stage in lean:
        rows = json.loads((out / stage["decisions"]).read_text())
        state = [r for r in rows if r["opcode"] == "parameter" and "[]" not in r["shape"]
                 and r["instruction"].startswith("arg") and ".mb" not in r["instruction"]]
        assert state and all("S" in r["sharding"] for r in state)  # weights, optimizer state
    assert_computes_the_same(out, "mlp_train")


def test_a_model_that_cannot_fit_is_refused_with_the_smallest_memory(tmp_path):
    run = subprocess.run([sys.executable, "-m", "alpac.cli", "compile",
                          str(TESTDATA / "models" / "mlp_train.hlo"), "--memory-budget", "20KB",
                          "-o", str(tmp_path / "plan")], capture_output=True, text=True,
                         cwd=ROOT)
    assert run.returncode == 2, run.stderr
    assert "smallest memory per device alpac can reach is" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "plan").exists()


def assert_gpt_plan_computes_the_same(out: Path, plan: dict, rtol: float = 1e-5) -> None:
    """The plan of the testdata GPT step (or of one of its shape), run in this process,
    equals one device."""
    data = np.load(TESTDATA / "models" / "gpt_train.npz")
    args = [data[f"arg{i}"] for i in range(sum(k.startswith("arg") for k in data.files))]
    texts = {p.name: p.read_text() for p in out.glob("*.hlo")}
    got = run_program(Program.from_dict(plan["program"]), texts, args)
    want = run_hlo_single_device((out / "source.hlo").read_text(), args)
    for g, w in zip(got, want):
        scale = max(float(np.max(np.abs(w))), 1e-30) if w.size else 1.0
        assert np.max(np.abs(g - w), initial=0.0) <= rtol * scale


def test_megatron_strategy_is_planned_as_asked_and_computes_the_same(tmp_path):
    path = TESTDATA / "models" / "gpt_train.hlo"
    options = {"stage-construction": {"strategy": "megatron:dp=2,tp=2,pp=2", "layers": "4"}}
    _, out = compile_model(path, default_cluster(), build_pipeline(None, (), options),
                           tmp_path / "plan")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["strategy"] == "megatron:dp=2,tp=2,pp=2"
    assert [s["mesh"]["logical_shape"] for s in plan["stages"]] == [[2, 2], [2, 2]]
    assert [s["layers"] for s in plan["stages"]] == [[0, 1], [2, 3]]
    for stage in plan["stages"]:  # weight matrices split over the tensor-parallel axis only
        rows = json.loads((out / stage["decisions"]).read_text())
        matrices = [r for r in rows if r["opcode"] == "parameter" and r["shape"].count(",") == 1
                    and "mb" not in r["instruction"] and "S1" in r["sharding"]]
        assert matrices and all("S0" not in r["sharding"] for r in matrices)
    # weight gradients accumulated unreduced, all-reduced once per step by the update
    assert all(e["reduced_once_per_step"] > 0 for e in plan["reduce_scatter"])
    for stage in plan["stages"]:
        assert "all-reduce(" in (out / stage["modules"]["apply"]).read_text()
    assert_gpt_plan_computes_the_same(out, plan)


def test_megatron_distributed_optimizer_splits_the_optimizer_state(tmp_path):
    """`distopt=1` (Megatron-LM's distributed optimizer): each stage keeps less for its
    optimizer state than plain Megatron does, and the step computes the same."""
    path = TESTDATA / "models" / "gpt_train.hlo"
    static = {}
    for strategy in ("megatron:dp=2,tp=2,pp=2", "megatron:dp=2,tp=2,pp=2,distopt=1"):
        options = {"stage-construction": {"strategy": strategy, "layers": "4"}}
        _, out = compile_model(path, default_cluster(), build_pipeline(None, (), options),
                               tmp_path / strategy[-1])
        plan = json.loads((out / "plan.json").read_text())
        static[strategy] = [s["estimate"]["static_bytes"] for s in plan["stages"]]
    plain, split = static.values()
    assert all(b < 0.9 * a for a, b in zip(plain, split)), static
    assert_gpt_plan_computes_the_same(out, plan)


def test_a_tied_embeddings_first_stage_gradient_is_reduced_there_once_per_step(tmp_path):
    """The testdata GPT in bf16 (the lookup reads the embedding in stage 0, the head and the
    update in stage 1), 4 microbatches: the lookup's share of the embedding gradient is
    accumulated unreduced and all-reduced over dp once per step by stage 0's update, and
    moves to stage 1 summed, as Megatron all-reduces it (it was all-reduced every
    microbatch); the step computes what one device does, to bf16's precision (other sums'
    orders move some outputs by up to 3%; a gradient reduced twice or not at all moves its
    weight's by 50% or more)."""
    from testdata.generate import GPTConfig, gpt_train_hlo
    path = tmp_path / "gpt_bf16.hlo"
    path.write_text(gpt_train_hlo(GPTConfig(dtype="bfloat16"), 16))
    options = {"stage-construction": {"strategy": "megatron:dp=2,tp=2,pp=2", "layers": "4",
                                      "micro_batches": "4"}}
    _, out = compile_model(path, default_cluster(), build_pipeline(None, (), options),
                           tmp_path / "plan")
    plan = json.loads((out / "plan.json").read_text())
    first_update = (out / plan["stages"][0]["modules"]["apply"]).read_text()
    assert re.search(r"accumulate\d+\.part\.deferred\.all-reduce = ", first_update)
    assert "all-reduce(" not in (out / plan["stages"][0]["modules"]["backward"]).read_text()
    moved = [t for t in Program.from_dict(plan["program"]).transfers if ".part" in t.value]
    assert [(t.src_mesh, t.dst_mesh, t.scope) for t in moved] == [(0, 1, "step")]
    assert moved[0].value.endswith(".part.sum")
    assert_gpt_plan_computes_the_same(out, plan, rtol=0.1)


def test_between_stages_only_inputs_accumulators_and_scalars_move_once_per_step(tmp_path):
    """The update's weight-sized constants (Adam's β broadcast, which XLA shares among all
    weights of a shape) are made by each stage that reads them, not moved every step."""
    options = {"stage-construction": {"stages": "0-1,2-3", "layers": "4"}}
    _, out = compile_model(TESTDATA / "models" / "gpt_train.hlo", default_cluster(),
                           build_pipeline(None, (), options), tmp_path / "plan")
    program = Program.from_dict(json.loads((out / "plan.json").read_text())["program"])
    inputs = {i.value for i in program.inputs} | set(program.accumulators)
    per_step = [t for t in program.transfers if t.scope == "step"]
    assert per_step and all(t.value in inputs or t.bytes <= 8 for t in per_step), \
        [(t.value, t.bytes) for t in per_step if t.value not in inputs]


def test_progress_reports_every_ilp_solve(tmp_path):
    reports = []
    ctx, out = compile_model(TESTDATA / "models" / "mlp_train.hlo", default_cluster(),
                             build_pipeline(), tmp_path / "plan",
                             on_progress=lambda *r: reports.append(r))
    layer = [r for r in reports if r[0].startswith("layer ILPs")]
    finished = {what: total for what, done, total in layer if done == total}
    assert sum(finished.values()) == ctx.stats["stage_dp"]["layer_ilps"] > 0
    for what, total in finished.items():  # each solve reported once, in order
        assert [d for w, d, _ in layer if w == what] == list(range(total + 1))
    stages = ctx.plan_entries()["stages"]
    assert sum(r[0].startswith("stage ILPs") for r in reports) == len(stages)
