"""The all-reduces XLA's combiner merges (alpac.intraop.combine), and what the plan's estimate
charges for them: checked against the all-reduces XLA's own compiled module combines, and
priced by the calibration's `combined-all-reduce` table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from alpac.analysis.costmodel import CostModel
from alpac.hlo import parse_hlo
from alpac.intraop.collectives import Collective
from alpac.intraop.combine import combined_sets
from alpac.plan.cluster import load_cluster
from alpac.plan.mesh import LogicalMesh

MODELS = Path(__file__).resolve().parent.parent / "testdata" / "models"
STEP = """HloModule m
ENTRY e {
  p = f32[64,64] parameter(0)
  q = f32[64,64] parameter(1)
  a = f32[64,64] dot(p, q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  b = f32[64,64] dot(q, p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  c = f32[64,64] add(a, b)
  d = f32[64,64] multiply(p, q)
  ROOT t = (f32[64,64], f32[64,64], f32[64,64], f32[64,64]) tuple(a, b, c, d)
}
"""


def test_independent_all_reduces_of_one_module_and_axes_are_combined_in_program_order():
    instructions = {i.name: i for i in parse_hlo(STEP, "step").entry.instructions}
    ar = Collective("all-reduce", (0,), 16384)
    records = [("c", ar, 1), ("a", ar, 1), ("b", ar, 1), ("d", ar, 1),
               ("d", Collective("all-reduce", (1,), 16384), 1),  # other axes
               ("p", ar, 4),  # inside a loop: not combined
               ("q", Collective("all-gather", (0,), 16384), 1)]
    # a and b are independent; c is computed from them, so it starts a set of its own,
    # which d joins (d does not depend on c)
    assert combined_sets(records, instructions, lambda name: None) == [[1, 2], [0, 3]]
    # one module per group: d in another module than c combines with nothing
    assert combined_sets(records, instructions, lambda name: name == "d") == [[1, 2]]


CLUSTER = """\
name: combined
nodes: 1
devices_per_node: 4
device: {name: cpu, memory: 1GiB, flops: {f32: 20e9}}
links:
  intra_node: {bandwidth: 10GB/s, latency: 2us}
calibration:
  launch_s: 1.0e-4
  dot:
    f32: [[1e6, 1.0e-4], [1e9, 2.0e-2]]
  elementwise: [[1e3, 5.0e-5], [1e7, 2.0e-3]]
  collectives:
    intra_node:
      all-reduce: {4: [[1024, 2.0e-3], [1048576, 8.0e-3]]}
      all-gather: {4: [[1024, 2.0e-3], [1048576, 8.0e-3]]}
      reduce-scatter: {4: [[1024, 2.0e-3], [1048576, 8.0e-3]]}
COMBINED"""


def _plan(tmp_path, name: str, combined: str) -> dict:
    path = tmp_path / f"{name}.yaml"
    path.write_text(CLUSTER.replace("COMBINED", combined))
    out = tmp_path / name
    done = subprocess.run([sys.executable, "-m", "alpac.cli", "compile",
                           str(MODELS / "mlp_train.hlo"), "--cluster", str(path),
                           "--strategy", "data-parallel", "-o", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads((out / "plan.json").read_text()), load_cluster(path)


def test_a_data_parallel_step_s_gradient_all_reduces_are_priced_combined(tmp_path):
    """The data-parallel MLP step's gradient all-reduces are independent: XLA's compiled
    module runs them as combined all-reduces, and the estimate prices each at the
    `combined-all-reduce` table (the ILP's objective at the all-reduce table)."""
    plan, _ = _plan(tmp_path, "alone", "")
    cheap, cluster = _plan(tmp_path, "cheap", "      combined-all-reduce: "
                           "{4: [[1024, 5.0e-4], [1048576, 2.0e-3]]}\n")
    stage, alone = cheap["stages"][0], plan["stages"][0]
    assert stage["ilp"]["objective_s"] == pytest.approx(alone["ilp"]["objective_s"])
    assert alone["estimate"]["time_s"] == pytest.approx(alone["ilp"]["objective_s"])
    reduced = stage["collectives"]["all-reduce"]
    assert reduced["count"] >= 4
    model = CostModel(cluster, LogicalMesh((4,), (0, 1, 2, 3)))
    saved = alone["collectives"]["all-reduce"]["seconds"] - reduced["seconds"]
    assert saved > 0.5 * reduced["count"] * (2e-3 - model.combined_all_reduce(1024, (0,)))
    assert stage["estimate"]["time_s"] == pytest.approx(alone["estimate"]["time_s"] - saved)
    combined = _xla_combined_operands(tmp_path / "cheap", stage)
    assert combined >= reduced["count"] - 1, combined


def _xla_combined_operands(plan_dir: Path, stage: dict) -> int:
    """Operands of the all-reduces of two or more operands in XLA's compiled stage module."""
    from alpac.xla.bridge import compile_hlo, cpu_devices, ensure_host_device_count
    ensure_host_device_count(len(stage["mesh"]["devices"]))
    text = (plan_dir / stage["module"]).read_text()
    exe = compile_hlo(text, cpu_devices(len(stage["mesh"]["devices"])))
    found = 0
    for instr in parse_hlo(exe.compiled_text(), "<compiled>").instructions():
        if instr.opcode in ("all-reduce", "all-reduce-start") and instr.shape.is_tuple:
            found += len(instr.shape.leaves()) if len(instr.shape.leaves()) > 1 else 0
    return found
