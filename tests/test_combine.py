"""XLA's all-reduce combiner as the estimate prices it: the all-reduces alpac predicts run as
as many as XLA's compiled module has (a data-parallel step's gradient all-reduces as one,
Megatron's dependent ones apart), each combined group priced once on its bytes."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from conftest import TESTDATA

from alpac.driver import build_pipeline, compile_model
from alpac.hlo import parse_hlo
from alpac.plan.cluster import default_cluster
from alpac.xla.bridge import compile_hlo, cpu_devices


@cache
def plan(name: str, strategy: str) -> Path:
    out = Path("/tmp") / f"alpac-combine-{name}-{strategy.replace(':', '_')}"
    options = {"stage-construction": {"mesh": "8", "strategy": strategy}}  # no ZeRO rewrite
    compile_model(TESTDATA / "models" / f"{name}.hlo", default_cluster(),
                  build_pipeline(None, ("reduce-scatter",), options), out)
    return out


def xla_all_reduces(path: Path, stage: dict) -> int:
    """All-reduce instructions in the module XLA compiles for the stage."""
    exe = compile_hlo((path / stage["module"]).read_text(), cpu_devices(8))
    return sum(1 for i in parse_hlo(exe.compiled_text()).instructions()
               if i.opcode in ("all-reduce", "all-reduce-start"))


@pytest.mark.parametrize("name,strategy,combines", [
    ("mlp_train", "data-parallel", True), ("gpt_train", "data-parallel", True),
    ("gpt_train", "megatron:dp=2,tp=4", False)])
def test_the_all_reduces_run_as_xla_combines_them(name, strategy, combines):
    path = plan(name, strategy)
    p = json.loads((path / "plan.json").read_text())
    stage = p["stages"][0]
    predicted = stage["collectives"]["all-reduce"]
    assert predicted["combined"] == xla_all_reduces(path, stage)
    assert (predicted["combined"] < predicted["count"]) == combines
    ilp, estimate = stage["ilp"]["objective_s"], stage["estimate"]
    if combines:  # fewer latencies paid: a smaller estimate
        assert estimate["time_s"] < ilp
    else:
        assert estimate["time_s"] == pytest.approx(ilp)
    assert estimate["communication_s"] == pytest.approx(
        sum(c["seconds"] for c in stage["collectives"].values()))
