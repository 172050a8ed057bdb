"""Budgets on parsing: small hostile files (YAML alias bombs, JSON, HLO and StableHLO nested
thousands deep, recursive HLO computations, absurd counts and figures) are refused with exit
code 2 and one line naming the file, never a traceback, a RecursionError, a segfault,
unbounded memory or a solver error, by `alpac inspect`, `alpac compile --cluster`, `alpac
explain` and `alpa-run`. The bounds live in alpac/hlo/limits.py (HLO, StableHLO),
alpac/plan/cluster.py and calibration.py (cluster files) and alpac/plan/io.py (plan files)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import TESTDATA  # noqa: E402

BIN = Path(sys.executable).parent
DEEP = 5000  # nesting far past Python's recursion limit


def _assert_refused(result, phrase: str, file: Path, prog: str = "alpac") -> None:
    """Exit 2 and exactly one line on stderr, naming `file` and saying `phrase`."""
    assert result.returncode == 2, result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert file.name in lines[0] and phrase in lines[0], lines[0]


def _alpac(*args, cwd: Path | None = None):
    return subprocess.run([str(BIN / "alpac"), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


# ---- HLO: alpac inspect ------------------------------------------------------------------

def _entry(body: str, header: str = "") -> str:
    return f"HloModule m{header}\n\nENTRY main {{\n{body}\n}}\n"


def _copy_of(shape: str) -> str:
    return _entry(f"  p = {shape} parameter(0)\n  ROOT c = {shape} copy(p)")


def _tuple_chain(n: int) -> str:
    """Tuples of tuples built by instructions printed without shapes (XLA infers them)."""
    body = ["  t0 = f32[2] parameter(0)"]
    body += [f"  t{i} = tuple(t{i - 1})" for i in range(1, n + 1)]
    return _entry("\n".join(body))


def _called(callee_of: dict[str, str], entry_calls: str) -> str:
    """A module whose computations each call one other, by `to_apply`."""
    comps = [f"{name} {{\n  p = f32[2] parameter(0)\n  ROOT c = f32[2] call(p), "
             f"to_apply={callee}\n}}\n" for name, callee in callee_of.items()]
    return "HloModule m\n\n" + "\n".join(comps) + "\nENTRY main {\n  p = f32[2] parameter(0)" \
        f"\n  ROOT c = f32[2] call(p), to_apply={entry_calls}\n}}\n"


def _while_chain(n: int) -> str:
    """While loops nested `n` deep: each body loops the one before."""
    comps = ["cond {\n  p = s32[] parameter(0)\n  z = s32[] constant(3)\n"
             "  ROOT lt = pred[] compare(p, z), direction=LT\n}\n",
             "b0 {\n  p = s32[] parameter(0)\n  ROOT n = s32[] negate(p)\n}\n"]
    comps += [f"b{i} {{\n  p = s32[] parameter(0)\n  ROOT w = s32[] while(p), condition=cond, "
              f"body=b{i - 1}\n}}\n" for i in range(1, n)]
    return "HloModule m\n\n" + "\n".join(comps) + "\nENTRY main {\n  p = s32[] parameter(0)\n" \
        f"  ROOT w = s32[] while(p), condition=cond, body=b{n - 1}\n}}\n"


_SELF_WHILE = """HloModule m

cond {
  p = s32[] parameter(0)
  z = s32[] constant(3)
  ROOT lt = pred[] compare(p, z), direction=LT
}

body {
  p = s32[] parameter(0)
  ROOT w = s32[] while(p), condition=cond, body=body
}

ENTRY main {
  p = s32[] parameter(0)
  ROOT w = s32[] while(p), condition=cond, body=body
}
"""
_ALIASED = "  p = f32[2] parameter(0)\n  ROOT c = f32[2] copy(p)"

HLO_CASES = {
    "tuple shape 5000 deep": (_copy_of("(" * DEEP + "f32[2]" + ")" * DEEP),
                              "tuple shape nested more than 64 deep"),
    "inferred tuples 100 deep": (_tuple_chain(100), "'t65' makes a tuple shape nested more "
                                                    "than 64 deep"),
    "entry layout 5000 deep": (_entry(_ALIASED, ", entry_computation_layout={(" + "(" * DEEP
                                      + "f32[2]" + ")" * DEEP + ")->f32[2]}"),
                               "malformed entry_computation_layout: tuple shape nested"),
    "calls itself": (_called({"f": "f"}, "f"), "computation 'f' calls itself (f -> f)"),
    "calls itself through another": (_called({"g": "f", "f": "g"}, "f"),
                                     "calls itself (g -> f -> g)"),
    "while body is itself": (_SELF_WHILE, "computation 'body' calls itself (body -> body)"),
    "while loops 5000 deep": (_while_chain(DEEP), "nests calls more than 64 deep"),
    "alias of a missing parameter": (
        _entry(_ALIASED, ", input_output_alias={ {}: (5, {}, may-alias) }"),
        "input_output_alias: no parameter 5 (the entry has 1)"),
    "alias of a missing output": (
        _entry(_ALIASED, ", input_output_alias={ {3}: (0, {}, may-alias) }"),
        "input_output_alias: the entry's result has no index {3}"),
    "alias of a missing parameter index": (
        _entry(_ALIASED, ", input_output_alias={ {}: (0, {1}, may-alias) }"),
        "input_output_alias: parameter 0 has no index {1}"),
    "alias of another size": (
        _entry("  p = f32[4] parameter(0)\n  ROOT c = f32[2] slice(p), slice={[0:2]}",
               ", input_output_alias={ {}: (0, {}, may-alias) }"), "differ in size"),
    "donor of a missing parameter": (_entry(_ALIASED, ", buffer_donor={ (3, {}) }"),
                                     "buffer_donor: no parameter 3"),
    "dimension of 2^63": (_copy_of(f"f32[{2**63}]"), "larger than XLA's limit"),
    "dimension of 5000 digits": (_copy_of(f"f32[{'9' * DEEP}]"), "larger than XLA's limit"),
    "65 dimensions": (_copy_of(f"f32[{','.join(['1'] * 65)}]"), "65 dimensions; at most 64"),
    "2^64 elements": (_copy_of(f"f32[{2**32},{2**32}]"), "more elements than XLA's limit"),
    "parameter number of 5000 digits": (
        _entry(f"  p = f32[2] parameter({'9' * DEEP})\n  ROOT c = f32[2] copy(p)"),
        "parameter numbers are below 1,000,000"),
}


@pytest.mark.parametrize("case", sorted(HLO_CASES))
def test_inspect_refuses_a_hostile_module(case, tmp_path):
    text, phrase = HLO_CASES[case]
    model = tmp_path / "hostile.hlo"
    model.write_text(text)
    _assert_refused(_alpac("inspect", model), phrase, model)


def test_inspect_refuses_stablehlo_nested_past_xla_s_stack(tmp_path):
    """XLA's MLIR parser recurses in C++: a tuple type 5,000 deep was a segfault."""
    deep = "tuple<" * DEEP + "tensor<2xf32>" + ">" * DEEP
    model = tmp_path / "deep.mlir"
    model.write_text(f"module {{\n  func.func public @main(%arg0: {deep}) -> {deep} {{\n"
                     f"    return %arg0 : {deep}\n  }}\n}}\n")
    _assert_refused(_alpac("inspect", model), "nested more than 256 brackets deep", model)


@pytest.mark.parametrize("suffix", [".hlo", ".pb", ".mlir"])
@pytest.mark.parametrize("command", ["inspect", "compile"])
def test_a_model_file_over_its_size_bound_is_refused_unread(command, suffix, tmp_path):
    """Sparse: 5 GiB on no disk, and refused by its size, so not read either."""
    model = tmp_path / f"huge{suffix}"
    with open(model, "wb") as f:
        f.truncate(5 << 30)
    args = ("-o", tmp_path / "plan") if command == "compile" else ()
    r = _alpac(command, model, *args)
    _assert_refused(r, "is 5368709120 bytes (5.0 GiB); a model file may be at most 4 GiB",
                    model)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_as_model_file_is_refused(device):
    _assert_refused(_alpac("inspect", device), "is a character device; expected a model file",
                    Path(device))


def test_a_model_file_at_the_bound_is_read_by_size_only(tmp_path, monkeypatch):
    from alpac.errors import UserError
    from alpac.hlo import limits
    model = tmp_path / "m.hlo"
    model.write_text(_copy_of("f32[2]"))
    size = model.stat().st_size
    assert limits.read_bounded(model, size, "model file") == model.read_bytes()
    with pytest.raises(UserError, match=f"is {size} bytes"):
        limits.read_bounded(model, size - 1, "model file")


@pytest.mark.parametrize("text", [_tuple_chain(64), _while_chain(63)],
                         ids=["tuples 64 deep", "calls 64 deep"])  # (the entry and 63 loops)
def test_modules_at_the_limits_are_read(text, tmp_path):
    model = tmp_path / "edge.hlo"
    model.write_text(text)
    r = _alpac("inspect", model)
    assert r.returncode == 0, r.stderr


def test_a_model_of_a_dimension_2_32_is_refused_in_one_line(tmp_path):
    model = tmp_path / "big.hlo"
    model.write_text(_copy_of(f"f32[{2**32}]"))
    r = _alpac("compile", model, "--mesh", "2", "--time-limit", "2", "--jobs", "1", "-o",
               tmp_path / "plan")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "does not fit" in r.stderr


# ---- cluster files: alpac compile --cluster ----------------------------------------------

BASE = (TESTDATA / "clusters" / "local-cpu.yaml").read_text()


def _bomb(open_: str, close: str, entry) -> str:
    """Nine aliases of the one before, nine deep: 9^9 values from ~1 kB."""
    lines = [f"a0: &a0 {open_}" + ", ".join(entry(k, "lol") for k in range(9)) + close]
    lines += [f"a{i}: &a{i} {open_}" + ", ".join(entry(k, f"*a{i - 1}") for k in range(9))
              + close for i in range(1, 10)]
    return "\n".join(lines) + "\n" + BASE


def _alias_depth() -> str:
    """Each anchor 60 deep around an alias of the one before: 300 levels expanded."""
    lines = ["a0: &a0 " + "[" * 60 + "1" + "]" * 60]
    lines += [f"a{i}: &a{i} " + "[" * 60 + f"*a{i - 1}" + "]" * 60 for i in range(1, 5)]
    return "\n".join(lines) + "\n" + BASE


_CALIBRATED = (TESTDATA / "clusters" / "local-cpu-calibrated-np2.yaml").read_text()


def _edited(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


CLUSTER_CASES = {
    "alias bomb of lists": (_bomb("[", "]", lambda k, v: v), "more than 100,000 values"),
    "alias bomb of mappings": (_bomb("{", "}", lambda k, v: f"k{k}: {v}"),
                               "more than 100,000 values"),
    "lists 5000 deep": ("name: " + "[" * DEEP + "]" * DEEP + "\n",
                        "YAML nested more than 64 levels deep"),
    "mappings 5000 deep": ("name: " + "{a: " * DEEP + "1" + "}" * DEEP + "\n",
                           "YAML nested more than 64 levels deep"),
    "aliases 300 deep": (_alias_depth(), "64 levels deep with its aliases expanded"),
    "recursive alias": ("name: &x [*x]\n", "recursive YAML alias"),
    "recursive mapping alias": ("name: &x {a: *x}\n", "recursive YAML alias"),
    "2 MiB": ("# " + "x" * (2 << 20) + "\n" + BASE, "larger than 1 MiB"),
    "10^12 nodes": (_edited(BASE, "nodes: 1", "nodes: 1000000000000"),
                    "nodes: expected a whole number from 1 to 1,000,000"),
    "nodes of 5001 digits": (_edited(BASE, "nodes: 1", "nodes: 1" + "0" * DEEP),
                             "invalid YAML: Exceeds the limit (4300 digits)"),
    "nodes of 20000 bits": (_edited(BASE, "nodes: 1", "nodes: 0x" + "f" * DEEP),
                            "got an integer of 20000 bits"),
    "2 x 10^6 devices": (_edited(BASE, "devices_per_node: 8", "devices_per_node: 1000000")
                         .replace("nodes: 1", "nodes: 2"), "a cluster may have at most"),
    "bandwidth 1e-300": (_edited(BASE, "bandwidth: 10GB/s", "bandwidth: 1e-300"),
                         "links.intra_node.bandwidth: expected a bandwidth from 1000 to"),
    "bandwidth 1e300": (_edited(BASE, "bandwidth: 10GB/s", "bandwidth: 1e300"),
                        "bytes/s, got '1e300'"),
    "latency 1e300": (_edited(BASE, "latency: 2us", "latency: 1e300"),
                      "expected a latency from 0 to 10 s"),
    "flops 1e-300": (_edited(BASE, "20e9", "1e-300"), "device.flops.f32: expected a FLOP/s"),
    "memory 1e300": (_edited(BASE, "memory: 3GiB", "memory: 1e300"),
                     "device.memory: expected a size from 1e+06 to 1e+16 bytes"),
    "efficiency 1e-300": (BASE + "efficiency: {dot: 1e-300}\n", "from 0.001 to 1"),
    "calibrated seconds 1e300": (_edited(_CALIBRATED, "flop_s: 1.6072e-10", "flop_s: 1e300"),
                                 "calibration.flop_s: expected non-negative seconds up to"),
    "calibrated size 1e-300": (_edited(_CALIBRATED, "[65536, 2.9872e-05]", "[1e-300, 1]"),
                               "calibration.dot.f32: expected a list of [size, seconds] rows"),
}


@pytest.mark.parametrize("case", sorted(CLUSTER_CASES))
def test_compile_refuses_a_hostile_cluster_file(case, tmp_path):
    text, phrase = CLUSTER_CASES[case]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(text)
    r = _alpac("compile", TESTDATA / "models" / "mlp_fwd.hlo", "--cluster", cluster, "-o",
               tmp_path / "plan")
    _assert_refused(r, phrase, cluster)
    assert not (tmp_path / "plan").exists()


def test_anchors_and_aliases_of_a_real_file_are_read(tmp_path):
    from alpac.plan.cluster import load_cluster
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(_edited(BASE, "  intra_node: {bandwidth: 10GB/s, latency: 2us}\n  "
                               "inter_node: {bandwidth: 10GB/s, latency: 2us}",
                               "  intra_node: &link {bandwidth: 10GB/s, latency: 2us}\n  "
                               "inter_node: *link"))
    c = load_cluster(cluster)
    assert c.inter_node == c.intra_node and c.intra_node.bandwidth == 10e9


def test_calibrate_check_reads_through_the_same_bounds(tmp_path):
    from alpac.errors import UserError
    from alpac.runtime.calibrate import _load_recorded
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER_CASES["alias bomb of mappings"][0])
    with pytest.raises(UserError, match="more than 100,000 values"):
        _load_recorded(str(cluster))


# ---- plan files: alpac explain, alpa-run -------------------------------------------------

def _deep_json(n: int) -> list:
    return json.loads("[" * n + "]" * n)


def _edit_plan(change):
    def tamper(plan: Path) -> Path:
        data = json.loads((plan / "plan.json").read_text())
        change(data)
        (plan / "plan.json").write_text(json.dumps(data))
        return plan / "plan.json"
    return tamper


def _deep_text(plan: Path, name: str) -> Path:
    (plan / name).write_text("[" * DEEP + "]" * DEEP)
    return plan / name


def _digits(plan: Path) -> Path:
    """num_micro_batches of 5,001 digits, which Python's JSON parser refuses to convert."""
    text = (plan / "plan.json").read_text()
    count = '"num_micro_batches": 1,'
    assert count in text
    (plan / "plan.json").write_text(text.replace(count, count[:-1] + "0" * DEEP + ",", 1))
    return plan / "plan.json"


def _many_stages(data: dict) -> None:
    """100 program modules (the one, repeated) of 65,536 microbatches: 6.5 million tasks."""
    data["program"]["modules"] *= 100
    data["num_micro_batches"] = data["program"]["num_micro_batches"] = 1 << 16


PLAN_CASES = {
    "plan.json 5000 deep": (lambda p: _deep_text(p, "plan.json"),
                            "the plan file nests deeper than 64 levels"),
    "decisions 5000 deep": (lambda p: _deep_text(p, "stage0.decisions.json"),
                            "the stage's decisions file nests deeper than 64 levels"),
    "10^9 microbatches": (_edit_plan(lambda d: d.update(num_micro_batches=10**9)),
                          "num_micro_batches is 1000000000; expected a whole number from 1 to "
                          "65,536"),
    "10^9 program microbatches": (
        _edit_plan(lambda d: d["program"].update(num_micro_batches=10**9)),
        "program.num_micro_batches is 1000000000"),
    "microbatches of text": (_edit_plan(lambda d: d.update(num_micro_batches="many")),
                             "num_micro_batches is many"),
    "microbatches of 5001 digits": (_digits, "corrupt plan file: Exceeds the limit"),
    "6.5 million tasks": (_edit_plan(_many_stages), "more than the 4,194,304 tasks"),
}


def _tampered(case: str, mlp_plan: Path, tmp_path: Path) -> tuple[Path, Path, str]:
    """A copy of the plan with `case` done to it, the file changed and the phrase expected."""
    plan = tmp_path / "plan"
    shutil.copytree(mlp_plan, plan)
    tamper, phrase = PLAN_CASES[case]
    return plan, tamper(plan), phrase


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_explain_refuses_a_hostile_plan(case, mlp_plan, tmp_path):
    plan, file, phrase = _tampered(case, mlp_plan, tmp_path)
    _assert_refused(_alpac("explain", plan), phrase, file)


@pytest.mark.parametrize("case", sorted(set(PLAN_CASES) - {"decisions 5000 deep"}))
def test_alpa_run_refuses_a_hostile_plan_before_mpiexec(case, mlp_plan, tmp_path):
    plan, file, phrase = _tampered(case, mlp_plan, tmp_path)  # (it reads no decisions file)
    started = tmp_path / "mpiexec-started"
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\ntouch {started}\n")
    fake.chmod(0o755)
    r = subprocess.run([str(BIN / "alpa-run"), str(plan), "--mpiexec", str(fake), "--",
                        "np", "2"], capture_output=True, text=True, timeout=120)
    _assert_refused(r, phrase, file, prog="alpa-run")
    assert not started.exists()


def test_explain_against_refuses_a_deep_report(mlp_plan, tmp_path):
    report = tmp_path / "report.json"
    report.write_text("{\"a\": " * DEEP + "1" + "}" * DEEP)
    _assert_refused(_alpac("explain", mlp_plan, "--against", report),
                    "the report nests deeper than 64 levels", report)


def test_explain_against_refuses_a_report_over_its_size_bound(mlp_plan, tmp_path):
    report = tmp_path / "report.json"
    with open(report, "wb") as f:
        f.truncate(1 << 30)  # sparse
    _assert_refused(_alpac("explain", mlp_plan, "--against", report),
                    "is 1073741824 bytes (1.0 GiB); a report may be at most 256 MiB", report)


def test_explain_against_refuses_a_device_and_reads_a_fifo_without_writer(mlp_plan, tmp_path):
    _assert_refused(_alpac("explain", mlp_plan, "--against", "/dev/zero"),
                    "is a character device; expected a report", Path("/dev/zero"))
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    assert _alpac("explain", mlp_plan, "--against", fifo).returncode == 2  # empty, no hang


def test_a_deep_stats_file_is_left_out(mlp_plan, tmp_path):
    """compile-stats.json holds timings only: a plan whose stats do not read still explains."""
    plan = tmp_path / "plan"
    shutil.copytree(mlp_plan, plan)
    _deep_text(plan, "compile-stats.json")
    assert _alpac("explain", plan).returncode == 0


def test_json_depth_bound_counts_brackets_outside_strings():
    from alpac.errors import UserError
    from alpac.plan.io import JSON_DEPTH_MAX, parse_json
    assert parse_json(json.dumps(_deep_json(JSON_DEPTH_MAX)), "f.json", "f") \
        == _deep_json(JSON_DEPTH_MAX)
    brackets = "[" * DEEP + '"{'  # inside a string: not nesting
    assert parse_json(json.dumps([brackets]), "f.json", "f") == [brackets]
    text = "{\"a\":\n" + "[" * (JSON_DEPTH_MAX + 1) + "]" * (JSON_DEPTH_MAX + 1) + "}"
    with pytest.raises(UserError, match=r"^f\.json:2: the f nests deeper than 64 levels"):
        parse_json(text, "f.json", "f")
