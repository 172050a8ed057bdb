"""Measured tables in cluster.yaml (`calibration:`) and how the cost model prices with them:
interpolation, the fallbacks, and the launch overhead in a plan's estimate."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alpac.analysis.costmodel import (CostModel, host_cores_seconds, launch_cpu_seconds,
                                      launch_seconds, waiting_cpu_seconds)
from alpac.errors import UserError
from alpac.plan.calibration import Table, polls
from alpac.plan.cluster import load_cluster
from alpac.plan.mesh import LogicalMesh
from alpac.plan.program import Program
from alpac.plan.schedule import step_seconds
from alpac.runtime.timeline import build

MODELS = Path(__file__).resolve().parent.parent / "testdata" / "models"
CLUSTER = """\
name: calibrated
nodes: 2
devices_per_node: 2
device: {name: cpu, memory: 1GiB, flops: {f32: 20e9}}
links:
  intra_node: {bandwidth: 10GB/s, latency: 2us}
  inter_node: {bandwidth: 1GB/s, latency: 50us}
calibration:
  source: a test
  launch_s: LAUNCH
  dot:
    f32: [[1e6, 1.0e-4], [1e9, 2.0e-2]]
  elementwise: [[1e3, 5.0e-5], [1e7, 2.0e-3]]
  collectives:
    inter_node:
      all-reduce: {2: [[1024, 1.0e-4], [1048576, 5.0e-3]]}
  send:
    inter_node: [[1024, 8.0e-5], [1048576, 3.0e-3]]
"""


def cluster(tmp_path, launch: float = 1e-4, text: str = CLUSTER):
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("LAUNCH", repr(launch)))
    return path


def test_groups_crossing_the_nodes_at_once_are_priced_as_measured_so(tmp_path):
    """With an `inter_node_shared` table (a group per device of a node, all at once), a
    mesh whose collective runs a group per device of each node across them is priced by it;
    one whose collective runs fewer groups at once in between it and one group alone (a
    power of the groups at once); one group alone by the one-group table."""
    text = CLUSTER.replace("devices_per_node: 2", "devices_per_node: 4").replace(
        "  send:\n", "    inter_node_shared:\n"
        "      all-reduce: {2: [[1024, 4.0e-4], [1048576, 8.0e-3]]}\n  send:\n")
    c = load_cluster(cluster(tmp_path, text=text))
    every = CostModel(c, LogicalMesh((2, 4), tuple(range(8))))  # axis 0: 4 groups at once
    two = CostModel(c, LogicalMesh((2, 2), (0, 1, 4, 5)))  # 2 groups at once
    alone = CostModel(c, LogicalMesh((2,), (0, 4)))
    assert every.collective("all-reduce", 1024, (0,)) == pytest.approx(4e-4)
    assert every.collective("all-reduce", 1048576, (0,)) == pytest.approx(8e-3)
    assert alone.collective("all-reduce", 1024, (0,)) == pytest.approx(1e-4)
    assert two.collective("all-reduce", 1024, (0,)) == pytest.approx(math.sqrt(1e-4 * 4e-4))
    # without the shared table: one group carrying every group's bytes
    plain = CostModel(load_cluster(cluster(tmp_path, text=text.replace(
        "inter_node_shared", "intra_node"))), LogicalMesh((2, 4), tuple(range(8))))
    assert plain.collective("all-reduce", 1024, (0,)) == pytest.approx(
        alone.collective("all-reduce", 4096, (0,)))


def test_tables_interpolate_in_log_space_and_extrapolate_at_the_end_throughput():
    t = Table((1e3, 1e6), (1e-5, 1e-3))
    assert t(1e3) == pytest.approx(1e-5) and t(1e6) == pytest.approx(1e-3)
    assert t(math.sqrt(1e3 * 1e6)) == pytest.approx(math.sqrt(1e-5 * 1e-3))  # a power law
    assert t(4e6) == pytest.approx(4e-3)  # past the end: the last row's throughput
    slope = math.log(100) / math.log(1000)
    assert t(10) == pytest.approx(1e-5 * (10 / 1e3) ** slope)
    flat = Table((1e3, 1e6), (1e-5, 1e-6))  # a falling first segment: held flat below it
    assert flat(10) == pytest.approx(1e-5)


def test_the_cost_model_prices_from_the_tables_where_it_has_them(tmp_path):
    c = load_cluster(cluster(tmp_path))
    across = CostModel(c, LogicalMesh((2, 2), (0, 1, 2, 3)))  # axis 0 crosses the nodes
    alone = CostModel(c, LogicalMesh((2,), (0, 2)))  # one device of each node
    assert alone.collective("all-reduce", 1024, (0,)) == pytest.approx(1e-4)
    # the table was measured one group at a time: two groups at once share each node's link,
    # priced as one group carrying both groups' bytes
    assert across.collective("all-reduce", 1024, (0,)) == pytest.approx(
        alone.collective("all-reduce", 2048, (0,)))
    assert across.collective("all-reduce", 1048576, (0,)) == pytest.approx(1e-2)
    # a group size not measured: the nearest measured one, scaled by the ring formula
    four = across.collective("all-reduce", 1048576, (0, 1))
    ring = lambda n: 2 * ((n - 1) * 50e-6 + (n - 1) / n * 1048576 / 1e9)  # noqa: E731
    assert four == pytest.approx(5e-3 * ring(4) / ring(2))
    # no table for this kind or link: the alpha-beta formula
    assert across.collective("all-gather", 1e6, (1,)) == pytest.approx(2e-6 + 0.5 * 1e6 / 10e9)
    # work inside a module: the table as measured (the launch is counted per module run)
    assert across.compute(1e9, 1e6, "f32", "dot") == pytest.approx(2e-2)
    slope = math.log(2e-2 / 1e-4) / math.log(1e9 / 1e6)
    assert across.compute(1e3, 1e3, "f32", "dot") == pytest.approx(1e-4 * 1e-3 ** slope)
    assert across.compute(1e6, 1e7, "f32") == pytest.approx(2e-3)
    assert across.send(1024, 0, 2) == pytest.approx(8e-5)
    assert across.send(1024, 0, 1) == pytest.approx(2e-6 + 1024 / 10e9)  # intra: no table
    assert launch_seconds(c) == 1e-4


@pytest.mark.parametrize("bad, message", [
    ("    f32: [[1e6, 1.0e-4], [1e5, 2.0e-2]]", "calibration.dot.f32: sizes must be strictly"),
    ("    f32: [[1e6, -1]]", "calibration.dot.f32: expected a list of [size, seconds]"),
    ("    f32: oops", "calibration.dot.f32: expected a list of [size, seconds]"),
])
def test_a_wrong_table_is_named_with_its_line(tmp_path, bad, message):
    text = CLUSTER.replace("    f32: [[1e6, 1.0e-4], [1e9, 2.0e-2]]", bad)
    with pytest.raises(UserError, match=r"c\.yaml:12:") as e:
        load_cluster(cluster(tmp_path, text=text))
    assert message in str(e.value)


def test_the_launch_overhead_is_in_the_estimate(tmp_path):
    iteration = []
    for launch in (1e-4, 5e-3):
        out = tmp_path / f"plan-{launch}"
        done = subprocess.run([sys.executable, "-m", "alpac.cli", "compile",
                               str(MODELS / "mlp_train.hlo"), "--cluster",
                               str(cluster(tmp_path, launch)), "--mesh", "4", "-o", str(out)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        plan = json.loads((out / "plan.json").read_text())
        assert plan["cluster"]["calibration"]["launch_s"] == launch
        iteration.append(plan["estimate"]["iteration_time_s"] - plan["stages"][0]["estimate"]
                         ["time_s"])
    assert iteration == pytest.approx([1e-4, 5e-3])


def test_each_array_a_module_returns_or_a_step_feeds_is_priced(tmp_path):
    """alpa-run's host work per result (`array_s`) is in each module's launch:
    a one-stage plan's once per step, a pipeline stage's per microbatch for its forward and
    backward modules and per step for its update; and per array it feeds a step's modules
    (plan.json `feed_s`): a per-microbatch input on its mesh per microbatch, the others per
    step."""
    text = CLUSTER.replace("  launch_s: LAUNCH\n", "  launch_s: LAUNCH\n  array_s: 2.0e-5\n")
    out = tmp_path / "one"
    done = subprocess.run([sys.executable, "-m", "alpac.cli", "compile",
                           str(MODELS / "mlp_train.hlo"), "--cluster",
                           str(cluster(tmp_path, text=text)), "--mesh", "4", "-o", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    plan = json.loads((out / "plan.json").read_text())
    (module,) = plan["program"]["modules"]
    arrays, fed = len(module["outputs"]), len(plan["program"]["inputs"])
    assert arrays > 10 and fed > 10
    assert plan["estimate"]["iteration_time_s"] - plan["stages"][0]["estimate"]["time_s"] == \
        pytest.approx(1e-4 + 2e-5 * (arrays + fed))
    assert plan["stages"][0]["estimate"]["feed_s"]["per_step"] == pytest.approx(2e-5 * fed)
    plan = _two_stage_plan(tmp_path, "two", text)
    program = plan["program"]
    for stage in plan["stages"]:
        want = [0.0, 0.0]
        for m in program["modules"]:
            if m["stage"] == stage["index"]:
                want[0 if m["role"] in ("forward", "backward") else 1] += \
                    1e-4 + 2e-5 * len(m["outputs"])
        zeroed = [a for a in program["accumulators"]
                  if program["values"][a]["mesh"] == stage["index"]]
        assert zeroed  # one module zeroes them per step
        want[1] += 1e-4 + 2e-5 * len(zeroed)
        got = stage["estimate"]["launch_s"]
        assert [got["per_microbatch"], got["per_step"]] == pytest.approx(want)
        assert want[0] > 2e-4 and want[1] > 1e-4
        values = [program["values"][i["value"]] for i in program["inputs"]]
        mine = [v["scope"] for v in values if v["mesh"] == stage["index"]]
        got = stage["estimate"]["feed_s"]
        assert [got["per_microbatch"], got["per_step"]] == pytest.approx(
            [2e-5 * mine.count("microbatch"), 2e-5 * mine.count("step")])
        assert mine.count("step") > 0
    assert sum(s["estimate"]["feed_s"]["per_microbatch"] for s in plan["stages"]) > 0


def test_each_argument_a_module_takes_is_priced_in_its_launch(tmp_path):
    """With the calibration's `argument_s`, each module execution costs it per array it
    takes (a pipeline's forward and backward modules per microbatch; the module zeroing a
    stage's accumulators takes none), and an output carried into the next step's input is
    priced as the array returned and the argument taken (`array_s` + `argument_s`); an input
    copied from the host costs `feed_s`."""
    text = CLUSTER.replace("  launch_s: LAUNCH\n", "  launch_s: LAUNCH\n  array_s: 2.0e-5\n"
                           "  argument_s: 3.0e-6\n  feed_s: 3.0e-4\n")
    plan = _two_stage_plan(tmp_path, "two", text)
    program = plan["program"]
    carried = {parameter for _, parameter in program["aliases"]}
    for stage in plan["stages"]:
        want = [0.0, 0.0]
        for m in program["modules"]:
            if m["stage"] == stage["index"]:
                want[0 if m["role"] in ("forward", "backward") else 1] += \
                    1e-4 + 2e-5 * len(m["outputs"]) + 3e-6 * len(m["parameters"])
        zeroed = [a for a in program["accumulators"]
                  if program["values"][a]["mesh"] == stage["index"]]
        want[1] += 1e-4 + 2e-5 * len(zeroed)
        got = stage["estimate"]["launch_s"]
        assert [got["per_microbatch"], got["per_step"]] == pytest.approx(want)
        want = [0.0, 0.0]
        for i in program["inputs"]:
            v = program["values"][i["value"]]
            if v["mesh"] == stage["index"]:
                from_host = i["batch_dim"] is not None or i["parameter"] not in carried
                want[v["scope"] != "microbatch"] += 3e-4 if from_host else 2e-5 + 3e-6
        got = stage["estimate"]["feed_s"]
        assert [got["per_microbatch"], got["per_step"]] == pytest.approx(want)
        assert want[1] > 0


def test_an_input_copied_from_the_host_and_a_value_freed_are_priced_as_measured(tmp_path):
    """With the calibration's `feed_s` and `free_s`: an input alpa-run copies from the host
    each microbatch (a batch input) costs `feed_s`, one carried from the step before (an
    output aliased to it) the per-array figure; each array alpa-run frees costs `free_s`
    (plan.json `free_s`), as many per mesh as the runtime's tasks free there in a step."""
    text = CLUSTER.replace("  launch_s: LAUNCH\n", "  launch_s: LAUNCH\n  array_s: 2.0e-5\n"
                           "  feed_s: 3.0e-4\n  free_s: 7.0e-6\n")
    plan = _two_stage_plan(tmp_path, "two", text)
    program = plan["program"]
    carried = {parameter for _, parameter in program["aliases"]}
    assert carried
    freed = {}
    for task in build(Program.from_dict(program)).tasks:
        freed[task.mesh] = freed.get(task.mesh, 0) + len(task.free_after)
    B = plan["num_micro_batches"]
    for stage in plan["stages"]:
        want = [0.0, 0.0]
        for i in program["inputs"]:
            v = program["values"][i["value"]]
            if v["mesh"] == stage["index"]:
                fed_from_host = i["batch_dim"] is not None or i["parameter"] not in carried
                want[v["scope"] != "microbatch"] += 3e-4 if fed_from_host else 2e-5
        got = stage["estimate"]["feed_s"]
        assert [got["per_microbatch"], got["per_step"]] == pytest.approx(want)
        got = stage["estimate"]["free_s"]
        priced = (B * got["per_microbatch"] + got["per_step"]) / 7e-6
        assert freed[stage["index"]] > 10
        assert abs(priced - freed[stage["index"]]) <= 2, (priced, freed)
    batch_fed = [i for i in program["inputs"] if i["batch_dim"] is not None]
    assert batch_fed and plan["stages"][0]["estimate"]["feed_s"]["per_microbatch"] >= 3e-4


FUSED_CHAIN = """\
HloModule chain
add_f32 {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
ENTRY e {
  p = f32[1024,256] parameter(0)
  w = f32[256,256] parameter(1)
  ex = f32[1024,256] exponential(p)
  sq = f32[1024,256] multiply(ex, ex)
  half = f32[] constant(0.5)
  hb = f32[1024,256] broadcast(half), dimensions={}
  sc = f32[1024,256] add(sq, hb)
  zero = f32[] constant(0)
  rows = f32[1024] reduce(sc, zero), dimensions={1}, to_apply=add_f32
  d = f32[1024,256] dot(sc, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT t = (f32[1024], f32[1024,256]) tuple(rows, d)
}
"""


def test_a_fused_chain_is_priced_as_the_kernel_xla_makes_of_it(tmp_path):
    """exp, multiply, the broadcast constant and add run as one kernel (read p, write sc for
    the dot), the reduce as another that reads sc: each kernel costs the table once, on the
    bytes it moves, not each instruction on its own operands and result."""
    from alpac.analysis.costs import CostTable
    from alpac.analysis.fusion import kernel_shares
    from alpac.hlo import parse_hlo
    module = parse_hlo(FUSED_CHAIN)
    costs = CostTable(module)
    shares = kernel_shares(module.entry, costs, cpu=True)
    by_name = {i.name: s for i, s in shares.items()}
    array = 1024 * 256 * 4
    # p read, sc written (and the scalar the broadcast is made from)
    assert by_name["sc"].kernel == pytest.approx(2 * array + 4)
    assert by_name["hb"].own == 0  # made again inside the kernel
    assert by_name["ex"].kernel == by_name["sc"].kernel and by_name["ex"].kind == "elementwise"
    assert by_name["rows"].kernel == pytest.approx(array + 1024 * 4 + 4)  # sc, rows, zero
    assert by_name["rows"].kind == "reduce" and "d" not in by_name
    model = CostModel(load_cluster(cluster(tmp_path)), LogicalMesh((1,), (0,)))
    kernel_seconds = sum(model.compute(costs[i].flops, s.own, "f32", s.kind, s.kernel)
                         for i, s in shares.items() if s.kernel == by_name["sc"].kernel)
    assert kernel_seconds == pytest.approx(model.compute(0, 2 * array))
    per_instruction = sum(model.compute(costs[i].flops, costs[i].bytes_accessed)
                          for i in shares if by_name[i.name].kernel == by_name["sc"].kernel)
    assert per_instruction > 2.5 * kernel_seconds


def test_a_kernel_costs_its_arithmetic_where_that_takes_longer_than_its_memory(tmp_path):
    text = CLUSTER.replace("  launch_s: LAUNCH\n",
                           "  launch_s: LAUNCH\n  flop_s: 1.0e-9\n  transcendental_s: 1.0e-8\n")
    c = load_cluster(cluster(tmp_path, text=text))
    assert (c.calibration.flop_s, c.calibration.transcendental_s) == (1e-9, 1e-8)
    model = CostModel(c, LogicalMesh((1,), (0,)))
    # 1e6 adds and 1e5 exps on 1 KB: 2 ms of arithmetic against 50 µs of memory
    assert model.compute(1e6, 1e3, "f32", "elementwise", 1e3, 1e5) == pytest.approx(2e-3)
    # a quarter of a 10 MB kernel's bytes, a few ops: its share of the kernel's memory time
    assert model.compute(10, 2.5e6, "f32", "elementwise", 1e7) == pytest.approx(2e-3 / 4)
    # the figures are kept in plan.json's copy of the cluster, and a negative one is refused
    assert c.calibration.to_dict()["transcendental_s"] == 1e-8
    with pytest.raises(UserError, match="calibration.flop_s: expected non-negative seconds"):
        load_cluster(cluster(tmp_path, text=text.replace("flop_s: 1.0e-9", "flop_s: -1")))


def test_the_roofline_prices_fused_kernels_at_the_bandwidth_programs_get(tmp_path):
    """A datasheet file with `efficiency:` (no tables): the fused chain moves its kernel's
    bytes at memory_bandwidth x efficiency.memory, dots run at peak x efficiency.dot, and a
    collective's bandwidth term is the link's x its efficiency."""
    from alpac.analysis.costs import CostTable
    from alpac.analysis.fusion import kernel_shares
    from alpac.hlo import parse_hlo
    text = CLUSTER.split("calibration:")[0].replace(
        "memory: 1GiB, flops: {f32: 20e9}", "memory: 1GiB, flops: {f32: 20e12}, "
        "memory_bandwidth: 100GB/s") + \
        "efficiency: {dot: 0.5, memory: 0.8, inter_node: 0.25}\n"
    model = CostModel(load_cluster(cluster(tmp_path, text=text)),
                      LogicalMesh((2, 2), (0, 1, 2, 3)))
    assert model.prices_kernels
    module = parse_hlo(FUSED_CHAIN)
    costs = CostTable(module)
    shares = kernel_shares(module.entry, costs, cpu=True)
    chain = [(i, s) for i, s in shares.items() if s.kernel == pytest.approx(2 * 1024 * 256 * 4 + 4)]
    seconds = sum(model.compute(costs[i].flops, s.own, "f32", s.kind, s.kernel)
                  for i, s in chain)  # within 1%: a tiny op's arithmetic outlasts its bytes
    assert seconds == pytest.approx(2 * 1024 * 256 * 4 / 80e9, rel=0.01)
    assert model.compute(1e12, 0, "f32", "dot") == pytest.approx(1e12 / 10e12)
    ring = 2 * (50e-6 + 0.5 * 1e6 / 0.25e9)  # all-reduce of 1 MB over 2 devices across nodes
    assert model.collective("all-reduce", 1e6, (0,)) == pytest.approx(ring)


def test_a_broadcast_two_kernels_use_is_made_again_in_each():
    """XLA makes a broadcast again inside every kernel that uses it: one broadcast feeding two
    kernels moves the bytes of two broadcasts feeding one each (a scanned model unrolled
    has the latter, its unrolled twin the former; their plans must price alike)."""
    from alpac.analysis.costs import CostTable
    from alpac.analysis.fusion import kernel_shares
    from alpac.hlo import parse_hlo
    head = "HloModule m\nENTRY e {\n  p = f32[512,512] parameter(0)\n  c = f32[] constant(2)\n"
    shared = head + """  b = f32[512,512] broadcast(c), dimensions={}
  x = f32[512,512] multiply(p, b)
  y = f32[512,512] add(p, b)
  ROOT t = (f32[512,512], f32[512,512]) tuple(x, y)
}
"""
    apart = head + """  b1 = f32[512,512] broadcast(c), dimensions={}
  b2 = f32[512,512] broadcast(c), dimensions={}
  x = f32[512,512] multiply(p, b1)
  y = f32[512,512] add(p, b2)
  ROOT t = (f32[512,512], f32[512,512]) tuple(x, y)
}
"""
    totals = []
    for text in (shared, apart):
        module = parse_hlo(text)
        shares = kernel_shares(module.entry, CostTable(module), cpu=True)
        totals.append(sum(s.own for s in shares.values()))
    assert totals[0] == totals[1] == 2 * (2 * 512 * 512 * 4 + 4)


def xla_kernels(text: str) -> list[str]:
    """The opcodes of the kernels XLA's compiled module (one CPU device) runs: its entry's
    instructions, less parameters, constants and tuples."""
    import re

    from alpac.xla.bridge import compile_hlo, cpu_devices
    compiled = compile_hlo(text, cpu_devices(1)).compiled_text()
    entry = compiled[compiled.index("\nENTRY"):]
    return re.findall(r"= \S+ (?!parameter|constant|tuple)([a-z-]+)\(", entry)


SHARED_PRODUCERS = """HloModule m
sum {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
ENTRY e {
  p = f32[256,256] parameter(0)
  q = f32[256,256] parameter(1)
  a = f32[256,256] add(p, q)
  x = f32[256,256] multiply(a, q)
  y = f32[256,256] subtract(a, p)
  e = f32[256,256] exponential(p)
  u = f32[256,256] multiply(e, q)
  v = f32[256,256] add(e, p)
  c = f32[256,256] multiply(p, p)
  zero = f32[] constant(0)
  rows = f32[256] reduce(c, zero), dimensions={1}, to_apply=sum
  m = f32[256,256] maximum(q, q)
  cols = f32[256] reduce(m, zero), dimensions={0}, to_apply=sum
  ROOT t = (""" + ", ".join(["f32[256,256]"] * 4 + ["f32[256]"] * 2) + """) \
tuple(x, y, u, v, rows, cols)
}
"""


def test_kernels_are_the_ones_xla_runs_a_cheap_shared_op_made_again_in_each():
    """The add two kernels read is made again inside both (XLA repeats cheap ops), the exp
    two read is a kernel of its own, and each reduction runs its operand's op inside it:
    seven kernels, as many as the module XLA compiles runs, with the add's operands read
    by both of its kernels."""
    from alpac.analysis.costs import CostTable
    from alpac.analysis.fusion import kernel_shares
    from alpac.hlo import parse_hlo
    module = parse_hlo(SHARED_PRODUCERS)
    shares = {i.name: s for i, s in
              kernel_shares(module.entry, CostTable(module), cpu=True).items()}
    kernels = {s.root.name for s in shares.values()
               if s.root.opcode not in ("parameter", "constant", "tuple")}
    assert kernels == {"x", "y", "e", "u", "v", "rows", "cols"}
    assert shares["a"].root.name in ("x", "y") and shares["a"].own == 2 * 2 * 256 * 256 * 4
    assert shares["e"].root.name == "e"
    assert len(xla_kernels(SHARED_PRODUCERS)) == len(kernels)


SHARED_TWICE = """HloModule m
ENTRY e {
  p = f32[256,256] parameter(0)
  q = f32[256,256] parameter(1)
  b = f32[256,256] add(p, q)
  b1 = f32[256,256] multiply(b, p)
  b2 = f32[256,256] subtract(b, q)
  k1 = f32[256,256] add(b1, q)
  k2 = f32[256,256] multiply(b1, p)
  k3 = f32[256,256] maximum(b2, p)
  k4 = f32[256,256] minimum(b2, q)
  ROOT t = (f32[256,256], f32[256,256], f32[256,256], f32[256,256]) tuple(k1, k2, k3, k4)
}
"""


def test_a_cheap_op_is_read_in_every_kernel_its_duplicated_users_are_made_in():
    """b's two users are each made again in two kernels, so b is made in all four, as in
    the module XLA compiles: its operands are read four times, its users' twice."""
    from alpac.analysis.costs import CostTable
    from alpac.analysis.fusion import kernel_shares
    from alpac.hlo import parse_hlo
    module = parse_hlo(SHARED_TWICE)
    shares = {i.name: s for i, s in
              kernel_shares(module.entry, CostTable(module), cpu=True).items()}
    array = 256 * 256 * 4
    assert {s.root.name for s in shares.values()} >= {"k1", "k2", "k3", "k4"}
    assert shares["b"].own == 4 * 2 * array
    assert shares["b1"].own == shares["b2"].own == 2 * array  # p (or q); b is inside
    assert len(xla_kernels(SHARED_TWICE)) == 4


SHARED = CLUSTER + "  concurrency: [[1, 1.0e-3], [2, 2.0e-3], [4, 4.0e-3]]\n"


def test_a_device_with_fewer_beside_it_computes_faster_where_they_share_a_host(tmp_path):
    """The concurrency table (one device's dot with 1, 2, 4 devices working): on the cluster
    cut to fewer devices compute costs that share of the tables' all-devices figures;
    collectives do not change."""
    c = load_cluster(cluster(tmp_path, text=SHARED))
    assert c.calibration.to_dict()["concurrency"] == [[1, 1e-3], [2, 2e-3], [4, 4e-3]]
    assert [c.calibration.compute_share(n) for n in (1, 2, 4, 8)] == [0.25, 0.5, 1.0, 1.0]
    alone, full = (CostModel(c.cut(n), LogicalMesh((n,), tuple(range(n)))) for n in (1, 4))
    assert alone.compute(1e8, 0, "f32", "dot") == pytest.approx(0.25 * full.compute(1e8, 0,
                                                                                    "f32", "dot"))
    pair = LogicalMesh((2,), (0, 1))
    assert CostModel(c.cut(2), pair).collective("all-reduce", 1e6, (0,)) == \
        CostModel(c, pair).collective("all-reduce", 1e6, (0,))
    assert c.cut(3) is None and c.cut(4) is c and (c.cut(2).nodes, c.cut(2).devices_per_node) \
        == (1, 2)


def test_the_host_s_work_alone_is_measured_not_scaled_like_compute(tmp_path):
    """Launching a module (and each array it returns) on a cluster cut to fewer devices costs
    the one-alone figures on one device, the every-device ones on all, in between as the
    compute share goes; a file without the one-alone figures scales by the compute share."""
    every = (1e-4, 2e-5)  # launch_s, array_s with every device working
    text = SHARED.replace("  launch_s: LAUNCH\n", "  launch_s: LAUNCH\n  array_s: 2.0e-5\n")
    scaled = load_cluster(cluster(tmp_path, text=text))
    assert [launch_seconds(scaled.cut(n), 10) for n in (1, 2, 4)] == pytest.approx(
        [share * (every[0] + 10 * every[1]) for share in (0.25, 0.5, 1.0)])
    text += "  launch_alone_s: 6.0e-5\n  array_alone_s: 1.0e-5\n"
    c = load_cluster(cluster(tmp_path, text=text))
    assert c.calibration.to_dict()["array_alone_s"] == 1e-5
    alone, full = 6e-5 + 10 * 1e-5, every[0] + 10 * every[1]
    assert [launch_seconds(c.cut(n), 10) for n in (1, 2, 4)] == pytest.approx(
        [alone, alone + (full - alone) * (0.5 - 0.25) / 0.75, full])


def test_one_device_alone_is_priced_by_its_own_tables_where_measured(tmp_path):
    """With the compute tables measured on one device alone, a cluster cut to one device
    prices its work by them (a small kernel gains less than the concurrency table's dot: here
    2x against 4x), every device by the every-device tables, and 2 in between as the compute
    share goes; a bf16 dot gains what the f32 dot of its size does, and arithmetic the
    concurrency share."""
    text = SHARED + ("  flop_s: 1.0e-9\n  dot:\n    f32: [[1e6, 1.0e-4], [1e9, 2.0e-2]]\n"
                     "    bf16: [[1e6, 5.0e-5], [1e9, 1.0e-2]]\n"
                     "  alone:\n    dot: [[1e6, 5.0e-5], [1e9, 5.0e-3]]\n"
                     "    elementwise: [[1e3, 2.5e-5], [1e7, 5.0e-4]]\n"
                     "    reduce: [[1e3, 2.5e-5], [1e7, 5.0e-4]]\n")
    text = text.replace("  dot:\n    f32: [[1e6, 1.0e-4], [1e9, 2.0e-2]]\n", "", 1)
    c = load_cluster(cluster(tmp_path, text=text))
    assert c.calibration.to_dict()["alone"]["dot"] == [[1e6, 5e-5], [1e9, 5e-3]]

    def model(n):
        return CostModel(c.cut(n), LogicalMesh((n,), tuple(range(n))))
    kernel = [model(n).compute(0, 1e3, kind="elementwise", kernel_bytes=1e3) for n in (1, 2, 4)]
    assert kernel == pytest.approx([2.5e-5, 2.5e-5 + 2.5e-5 / 3, 5e-5])
    assert model(1).compute(1e9, 0, "f32", "dot") == pytest.approx(5e-3)
    assert model(1).compute(1e9, 0, "bf16", "dot") == pytest.approx(1e-2 * 5e-3 / 2e-2)
    arithmetic = model(1).compute(1e6, 1e3, kind="elementwise", kernel_bytes=1e3)
    assert arithmetic == pytest.approx(0.25 * 1e6 * 1e-9)
    with pytest.raises(UserError, match="alone.*unknown key 'send'"):
        load_cluster(cluster(tmp_path, text=text + "    send: [[1, 1.0]]\n"))


def test_the_automatic_plan_leaves_devices_idle_where_that_is_faster(tmp_path):
    """On a host whose 4 devices share its cores (a device alone 4x as fast), the tiny MLP
    step runs fastest on one device: the automatic plan says so, and explain tells why; a
    --mesh plan is priced on the devices it uses. Without the table every device works."""
    plans = {}
    for name, text, flags in (("shared", SHARED, []), ("independent", CLUSTER, []),
                              ("mesh", SHARED, ["--mesh", "2"])):
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "alpac.cli", "compile",
                               str(MODELS / "mlp_train.hlo"), "--cluster",
                               str(cluster(tmp_path, text=text)), "-o", str(out), *flags],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        plans[name] = json.loads((out / "plan.json").read_text())
    assert plans["shared"]["devices_used"] == 1
    assert [s["mesh"]["devices"] for s in plans["shared"]["stages"]] == [[0]]
    # each device count's assignment was priced as the plan it makes: the one kept is the
    # least, at the estimate the plan reports
    tried = json.loads((tmp_path / "shared" / "compile-stats.json").read_text())
    tried = tried["stage_dp"]["devices_tried"]
    assert sorted(map(int, tried)) == [1, 2, 4]
    assert min(tried.values()) == tried["1"] == pytest.approx(
        plans["shared"]["estimate"]["iteration_time_s"])
    assert "devices_used" not in plans["independent"]
    assert sorted(d for s in plans["independent"]["stages"] for d in s["mesh"]["devices"]) \
        == [0, 1, 2, 3]
    assert plans["mesh"]["devices_used"] == 2
    explained = subprocess.run([sys.executable, "-m", "alpac.cli", "explain",
                                str(tmp_path / "shared")], capture_output=True, text=True)
    assert "runs on 1 of the cluster's 4 devices, the rest idle" in \
        " ".join(explained.stdout.split())


@pytest.mark.parametrize("stage_limit, plan_limit", [(7.0, 7.0), (7.0, 9.0), (None, 9.0)])
def test_the_automatic_plan_s_stages_are_solved_once_within_the_user_s_time_limit(
        tmp_path, monkeypatch, stage_limit, plan_limit):
    """Choosing the device count on a shared host solves each candidate's stage ILPs; those
    solves keep to --time-limit, and the intra-op pass keeps the chosen one's solutions
    instead of solving them again, unless it was asked for other settings. A limit given to
    the intra-op pass alone (`--passes` with `intra-op-sharding{time_limit=9}`) holds for
    the stage construction too: one solve per stage, not two."""
    from alpac.driver import build_pipeline, compile_model
    from alpac.interop import shard
    solves, running = [], []
    solve = shard.shard_within

    def counted(module, mesh, cluster, budget, time_limit, *rest, **options):
        solves.append((running[-1], time_limit))
        return solve(module, mesh, cluster, budget, time_limit, *rest, **options)
    monkeypatch.setattr(shard, "shard_within", counted)
    options = {"intra-op-sharding": {"time_limit": str(plan_limit)}}
    if stage_limit is not None:
        options["stage-construction"] = {"time_limit": str(stage_limit)}
    ctx, _ = compile_model(MODELS / "mlp_train.hlo", load_cluster(cluster(tmp_path, text=SHARED)),
                           build_pipeline(None, (), options), tmp_path / "plan",
                           on_start=lambda p: running.append(p.name))
    chosen_at = stage_limit or plan_limit
    chosen = [s for s, limit in solves if s == "stage-construction" and limit == chosen_at]
    assert len(chosen) >= 3 and len(chosen) == len(solves) - sum(
        s == "intra-op-sharding" for s, _ in solves)  # one per candidate stage
    again = [limit for s, limit in solves if s == "intra-op-sharding"]
    assert again == ([] if plan_limit == chosen_at else [plan_limit])
    sharded = ctx.get(shard.ShardedStages)
    assert sharded.assignment.runs_on.num_devices == 1  # the final assignment, cut to one


def test_a_time_limit_set_on_one_ilp_pass_holds_for_the_others_left_unset():
    from alpac.driver import build_pipeline
    limits = {p.name: p.time_limit for p in build_pipeline(
        "stage-construction{time_limit=4},intra-op-sharding,reduce-scatter")}
    assert limits == {"stage-construction": 4.0, "intra-op-sharding": 4.0,
                      "reduce-scatter": 4.0}
    limits = {p.name: p.time_limit for p in build_pipeline(
        "stage-construction{time_limit=4},intra-op-sharding{time_limit=6},reduce-scatter")}
    assert limits == {"stage-construction": 4.0, "intra-op-sharding": 6.0,
                      "reduce-scatter": 6.0}  # the intra-op pass's limit first
    defaults = {p.name: p.time_limit for p in build_pipeline(
        "stage-construction,intra-op-sharding")}
    assert defaults["stage-construction"] == defaults["intra-op-sharding"] > 0


def _two_stage_plan(tmp_path, name: str, text: str) -> dict:
    out = tmp_path / name
    done = subprocess.run([sys.executable, "-m", "alpac.cli", "compile",
                           str(MODELS / "mlp_train.hlo"), "--cluster",
                           str(cluster(tmp_path, text=text)), "-o", str(out), "--layers", "2",
                           "--stages", "0-0,1-1", "--micro-batches", "4"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads((out / "plan.json").read_text())


def test_a_stage_s_time_includes_receiving_from_and_sending_to_the_other_stage(tmp_path):
    """alpa-run receives between modules on the host: every transfer into a stage is priced
    as the cluster's send of its bytes (the measured table across nodes) and counted in that
    stage's time per microbatch or per step, and so in the iteration. Sending costs the
    source stage its copy through the host (the table between two devices of a node), none
    without that table."""
    slow = CLUSTER.replace("[[1024, 8.0e-5], [1048576, 3.0e-3]]",
                           "[[1024, 8.0e-4], [1048576, 3.0e-2]]")
    staged = CLUSTER + "    intra_node: [[1024, 2.0e-5], [1048576, 1.0e-3]]\n"
    plan = _two_stage_plan(tmp_path, "staged", staged)
    table = load_cluster(cluster(tmp_path, text=staged)).calibration.send["intra_node"]
    want = {}
    for t in plan["program"]["transfers"]:
        per = want.setdefault(t["src_mesh"], [0.0, 0.0])
        per[0 if t["scope"] == "microbatch" else 1] += table(t["bytes"])
    got = {s["index"]: s["estimate"]["send_s"] for s in plan["stages"]}
    assert {m: [g["per_microbatch"], g["per_step"]] for m, g in got.items() if m in want} == \
        {m: pytest.approx(w) for m, w in want.items()}
    assert all(w[0] > 0 for w in want.values()) and len(want) == 2
    plans = {name: _two_stage_plan(tmp_path, name, text)
             for name, text in (("fast", CLUSTER), ("slow", slow))}
    for name, plan in plans.items():
        table = load_cluster(cluster(tmp_path, text=CLUSTER if name == "fast" else slow)
                             ).calibration.send["inter_node"]
        meshes = plan["program"]["meshes"]
        assert all(m["devices"][0] // 2 != meshes[0]["devices"][0] // 2 for m in meshes[1:])
        want = {}
        for t in plan["program"]["transfers"]:
            per = want.setdefault(t["dst_mesh"], [0.0, 0.0])
            per[0 if t["scope"] == "microbatch" else 1] += table(t["bytes"])
        got = {s["index"]: s["estimate"]["receive_s"] for s in plan["stages"]}
        assert all(s["estimate"]["send_s"] == {"per_microbatch": 0.0, "per_step": 0.0}
                   for s in plan["stages"])
        for mesh, (per_microbatch, per_step) in want.items():
            assert got[mesh]["per_microbatch"] == pytest.approx(per_microbatch)
            assert got[mesh]["per_step"] == pytest.approx(per_step)
        assert all(r["per_microbatch"] > 0 for r in got.values())
    fast, slow = (plans[k]["estimate"]["iteration_time_s"] for k in ("fast", "slow"))
    assert slow > fast


def test_adam_s_bias_corrections_are_computed_in_every_stage(tmp_path):
    """1 - β^t from the step count is a scalar each stage's update computes itself: no stage
    waits every step for another's update to send it (only program inputs cross once per
    step)."""
    plan = _two_stage_plan(tmp_path, "plan", CLUSTER)
    per_step = [t["value"] for t in plan["program"]["transfers"] if t["scope"] == "step"]
    assert per_step and all(v.startswith("arg") for v in per_step)


def _host_work(stage: dict, B: int) -> float:
    """A stage's priced host work per step (plan.json: per microbatch and per step)."""
    from alpac.interop.emit import HOST_WORK
    return sum(B * stage["estimate"][k]["per_microbatch"] + stage["estimate"][k]["per_step"]
               for k in HOST_WORK if k in stage["estimate"])


def test_the_host_s_cores_bound_a_step_whose_ranks_share_them(tmp_path):
    """Where a calibration says how many ranks shared each host and on how many cores, a step
    takes at least what the busiest host's cores need: every rank its stage's host work,
    every device its compute at the share of the cores it had when the tables were measured
    (none on devices that do not share the cores); the plan's estimate is the larger of that
    and the pipeline, and explain says which bound it."""
    counts = "  ranks_per_host: 2\n  host_cores: 1\n"
    c = load_cluster(cluster(tmp_path, text=SHARED + counts))
    assert (c.calibration.to_dict()["ranks_per_host"], c.calibration.host_cores) == (2, 1)
    stages = [((0, 1), 1e-3, 2e-3), ((2, 3), 3e-3, 1e-3)]  # devices, host work, compute
    # one host: nodes 0 and 1 do 1 + 3 ms of host work; each device's compute second is a
    # quarter of the one core (its 4 devices working share it)
    assert host_cores_seconds(c, stages) == pytest.approx(4e-3 + (2 * 2e-3 + 2 * 1e-3) / 4)
    assert host_cores_seconds(c.cut(2), [((0, 1), 1e-3, 2e-3)]) == pytest.approx(
        1e-3 + 2 * 2e-3 / 2)  # two devices working: each compute second is half the core
    assert host_cores_seconds(load_cluster(cluster(tmp_path, text=CLUSTER + counts)),
                              stages) == pytest.approx(4e-3)  # devices of their own
    assert host_cores_seconds(load_cluster(cluster(tmp_path, text=SHARED)), stages) == 0.0
    with pytest.raises(UserError, match="expected a whole number >= 0"):
        load_cluster(cluster(tmp_path, text=SHARED + "  ranks_per_host: -1\n"))

    plan = _two_stage_plan(tmp_path, "bound", (SHARED + counts).replace("LAUNCH", "5.0e-3"))
    est, B = plan["estimate"], plan["num_micro_batches"]
    loads = [(s["mesh"]["devices"], _host_work(s, B), s["estimate"]["compute_s"])
             for s in plan["stages"]]
    for s, (devices, host, compute) in zip(plan["stages"], loads):  # explain --against's
        assert s["estimate"]["cpu_per_rank_s"] == pytest.approx(  # a rank's 2 devices: 2/4
            {"host": host, "compute": compute * 2 / 4})
    times = [s["estimate"]["time_per_microbatch_s"] for s in plan["stages"]]
    applies = [s["estimate"]["apply_s"] for s in plan["stages"]]
    pipeline = step_seconds(sum(times), max(times), max(applies), B)
    assert est["host_cores_s"] == pytest.approx(host_cores_seconds(c, loads))
    assert est["iteration_time_s"] == est["host_cores_s"] > pipeline
    shown = subprocess.run([sys.executable, "-m", "alpac.cli", "explain",
                            str(tmp_path / "bound")], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"})
    assert "bound by the host's cores: 2 ranks share 1 core(s)" in shown.stdout
    unbound = _two_stage_plan(tmp_path, "unbound", SHARED.replace("LAUNCH", "1.0e-4") + counts)
    assert unbound["estimate"]["iteration_time_s"] > unbound["estimate"]["host_cores_s"] > 0


def test_a_rank_that_waits_pays_the_cpu_of_waking_its_launches_and_its_polling(tmp_path):
    """A pipeline's rank launches each module after waiting for a message: the calibration's
    `launch_cpu_s` (CPU of a launch after an idle pause; one device alone:
    `launch_cpu_alone_s`) beyond the launch's figure, per module execution; and its wait
    sleeps between polls, each `pause_cpu_s` of CPU and `pause_s` long. Both count toward
    the host's cores (plan.json `idle_cpu_s` per stage), not the stages' times."""
    # the polling's sleeps: 20 µs, then 1.5x longer each, to 1 ms; each `late` longer
    assert polls(0.0, 7e-5) == 0 and polls(1e-3, 0.0) == 9 and polls(1e-3, 7e-5) == 7
    assert polls(0.1, 0.0) - polls(0.05, 0.0) == 50  # past the longest: one per ms
    figures = ("  launch_cpu_s: 4.0e-4\n  launch_cpu_alone_s: 5.0e-5\n"
               "  pause_cpu_s: 2.0e-5\n  pause_s: 9.0e-5\n")
    counts = "  ranks_per_host: 2\n  host_cores: 1\n"
    text = (SHARED + counts + figures).replace("LAUNCH", "1.0e-4")
    c = load_cluster(cluster(tmp_path, text=text))
    assert launch_cpu_seconds(c) == pytest.approx(3e-4)
    assert launch_cpu_seconds(c.cut(1)) == pytest.approx(5e-5 - launch_seconds(c.cut(1)))
    assert waiting_cpu_seconds(c, 1e-3) == pytest.approx(2e-5 * polls(1e-3, 7e-5))

    plan = _two_stage_plan(tmp_path, "idle", text)
    program, B = plan["program"], plan["num_micro_batches"]
    times = [s["estimate"]["time_per_microbatch_s"] for s in plan["stages"]]
    applies = [s["estimate"]["apply_s"] for s in plan["stages"]]
    step = step_seconds(sum(times), max(times), max(applies), B)
    loads = []
    for s, stage in enumerate(plan["stages"]):
        launches = sum(B if m["role"] in ("forward", "backward") else 1
                       for m in program["modules"] if m["stage"] == s)
        launches += any(program["values"][v]["mesh"] == s for v in program["accumulators"])
        waits = sum(B if scope == "microbatch" else 1 for src, dst, scope in
                    {(t["src_mesh"], t["dst_mesh"], t["scope"]) for t in program["transfers"]}
                    if dst == s)
        assert launches > 2 * B and waits >= B
        wait = (step - B * times[s] - applies[s]) / waits
        want = launches * 3e-4 + waits * waiting_cpu_seconds(c, wait)
        assert stage["estimate"]["idle_cpu_s"] == pytest.approx(want)
        # the launches' part is XLA's threads waking, the polling's alpa-run's
        assert stage["estimate"]["wake_cpu_s"] == pytest.approx(launches * 3e-4)
        assert stage["estimate"]["cpu_per_rank_s"] == pytest.approx({
            "host": _host_work(stage, B) + want - launches * 3e-4,
            "compute": stage["estimate"]["compute_s"] * 2 / 4 + launches * 3e-4})
        loads.append((stage["mesh"]["devices"], _host_work(stage, B) + want,
                      stage["estimate"]["compute_s"]))
    assert plan["estimate"]["host_cores_s"] == pytest.approx(host_cores_seconds(c, loads))
    without = _two_stage_plan(tmp_path, "busy", text.replace(figures, ""))
    assert without["estimate"]["host_cores_s"] < plan["estimate"]["host_cores_s"]


BATCHED = "lhs_batch_dims={0}, rhs_batch_dims={0}, rhs_contracting_dims={1}"
BATCHED_DOTS = f"""\
HloModule batched
ENTRY e {{
  a = f32[8,16,4]{{2,1,0}} parameter(0)
  b = f32[8,16,16]{{2,1,0}} parameter(1)
  forward = f32[8,4,16]{{2,1,0}} dot(a, b), lhs_contracting_dims={{1}}, {BATCHED}
  kept = f32[8,16,4]{{2,1,0}} transpose(a), dimensions={{0,1,2}}
  normal = f32[8,16,16]{{2,1,0}} dot(kept, forward), lhs_contracting_dims={{2}}, {BATCHED}
  ROOT t = (f32[8,4,16]{{2,1,0}}, f32[8,16,16]{{2,1,0}}) tuple(forward, normal)
}}
"""


def test_a_batched_dot_whose_lhs_holds_its_matrices_transposed_pays_each_matrix(tmp_path):
    """XLA's CPU backend runs a batched dot whose lhs has its contracted dimension before its
    free one (and whose rhs too) in a loop of its own: `matrix_s` per matrix a device holds,
    beyond the dot table; other batched dots are the table alone."""
    from alpac.analysis.costs import CostTable, transposed_batch
    from alpac.hlo import parse_hlo
    from alpac.intraop.builder import build_graph, strategy_seconds
    module = parse_hlo(BATCHED_DOTS)
    by_name = {i.name: i for i in module.entry.instructions}
    assert transposed_batch(by_name["forward"]) == 1 and transposed_batch(by_name["normal"]) == 0
    text = CLUSTER.replace("  launch_s: LAUNCH\n", "  launch_s: LAUNCH\n  matrix_s: 1.0e-6\n")
    c = load_cluster(cluster(tmp_path, text=text))
    assert c.calibration.to_dict()["matrix_s"] == 1e-6
    model = CostModel(c, LogicalMesh((1,), (0,)))
    table = model.compute(16384, 0, "f32", "dot")
    assert model.compute(16384, 0, "f32", "dot", matrices=8) == pytest.approx(table + 8e-6)
    # on 2 devices: split on the batch, each device has 4 matrices; split on n, all 8
    costs = CostTable(module)
    sg = build_graph(module, LogicalMesh((2,), (0, 1)), c, costs)
    plain = CostModel(c, LogicalMesh((2,), (0, 1)))
    extra = {}
    for instr in (by_name["forward"], by_name["normal"]):
        for st in sg.plans[instr].strategies:
            flops = costs[instr].flops / st.divisor
            split = tuple(bool(axes) for axes in st.outputs[0].dim_axes)
            extra[instr.name, split] = strategy_seconds(sg, instr, st) - \
                plain.compute(flops, 0, "f32", "dot") - \
                sum(col.seconds(sg.model) for col in st.collectives)
    assert extra["forward", (True, False, False)] == pytest.approx(4e-6)
    assert extra["forward", (False, False, True)] == pytest.approx(8e-6)
    assert all(v == pytest.approx(0) for (name, _), v in extra.items() if name == "normal")


def _residual_chain(layers: int) -> str:
    """A residual stream summed layer by layer, each sum also reduced (a norm's statistics)."""
    lines = ["HloModule m", "sum {", "  a = f32[] parameter(0)", "  b = f32[] parameter(1)",
             "  ROOT c = f32[] add(a, b)", "}", "ENTRY e {",
             "  a0 = f32[256,256] parameter(0)", "  y = f32[256,256] parameter(1)",
             "  z = f32[] constant(0)"]
    for k in range(1, layers + 1):
        lines += [f"  a{k} = f32[256,256] add(a{k - 1}, y)",
                  f"  r{k} = f32[256] reduce(a{k}, z), dimensions={{1}}, to_apply=sum"]
    outs = [f"a{layers}"] + [f"r{k}" for k in range(1, layers + 1)]
    shapes = ["f32[256,256]"] + ["f32[256]"] * layers
    lines += [f"  ROOT t = ({', '.join(shapes)}) tuple({', '.join(outs)})", "}"]
    return "\n".join(lines) + "\n"


def test_gpu_fusion_writes_a_summed_stream_rather_than_make_it_again_in_every_kernel():
    """On a GPU, a binary op whose repeats would read more bytes than writing it once is
    written (XLA's priority fusion decides by the bytes): a residual stream summed layer by
    layer, each sum also reduced, moves bytes in proportion to its depth, each sum read in at
    most three kernels; making every sum again in every kernel below it (the rule kept for
    CPU plans) grows with the depth's square."""
    from alpac.analysis.costs import CostTable
    from alpac.analysis.fusion import kernel_shares
    from alpac.hlo import parse_hlo

    def shares(layers: int, cpu: bool) -> dict:
        module = parse_hlo(_residual_chain(layers))
        return {i.name: s for i, s in kernel_shares(module.entry, CostTable(module),
                                                    cpu=cpu).items()}

    def total(layers: int, cpu: bool) -> float:
        return sum(s.own for s in shares(layers, cpu).values())

    array = 256 * 256 * 4
    assert total(16, cpu=False) / total(8, cpu=False) < 2.2
    assert all(s.own <= 3 * 2 * array for name, s in shares(16, cpu=False).items()
               if name.startswith("a"))
    assert total(16, cpu=True) / total(8, cpu=True) > 3.0
