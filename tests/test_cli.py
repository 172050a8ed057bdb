"""The `alpac` command as a user meets it: exit codes, one-line errors, the pass registry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, TESTDATA

from testdata.wide import many_parameters_hlo

ALPAC = [sys.executable, "-m", "alpac.cli"]


def run(*args, env=None, cwd=None):
    return subprocess.run([*ALPAC, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd or ROOT, timeout=300)


def assert_one_line_error(result, *phrases, code=2):
    assert result.returncode == code, result.stderr + result.stdout
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_inspect_json():
    result = run("inspect", TESTDATA / "models" / "mlp_train.hlo", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["parameters"][0]["index"] == 0
    assert len(summary["aliases"]) == len(summary["outputs"]) - 1  # all but the loss
    assert summary["cost"]["flops"] > 0
    assert summary["opcodes"]["dot"] > 0


def test_inspect_many_parameters_returned_as_outputs(tmp_path):
    """Thousands of parameters, each returned negated and as it is (issue 54: this was
    quadratic; benchmarks/bench_parameters.py times it)."""
    model = tmp_path / "wide.hlo"
    model.write_text(many_parameters_hlo(2000, echo_parameters=True))
    result = run("inspect", model, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["instructions"] == 4001
    assert [p["index"] for p in summary["parameters"]] == list(range(2000))
    assert len(summary["outputs"]) == 4000
    assert summary["step"]["batch"]["evidence"] == [
        "2000 unaliased parameters come back as outputs of the same shape that depend on them "
        "(state)"]


def test_inspect_rich():
    result = run("inspect", TESTDATA / "models" / "gpt_fwd.hlo")
    assert result.returncode == 0, result.stderr
    assert "instructions by opcode" in result.stdout and "MFLOP" in result.stdout


BAD_MODELS = {
    "empty.hlo": (b"", ["empty.hlo:1:1", "empty"]),
    "truncated.hlo": (b"HloModule m\nENTRY %e {\n  %p = f32[2] parameter(0)\n  ROOT %a = f32[2] "
                      b"add(%p,", ["truncated.hlo:4:", "unbalanced"]),
    "garbage.hlo": (bytes(range(256)) * 4, ["garbage.hlo:", "not UTF-8"]),
    "undefined_comp.hlo": (b"HloModule m\nENTRY %e {\n  %p = f32[2] parameter(0)\n  %z = f32[] "
                           b"constant(0)\n  ROOT %r = f32[] reduce(%p, %z), dimensions={0}, "
                           b"to_apply=%sum\n}\n", ["undefined_comp.hlo:5:", "'sum'"]),
    "undefined_operand.hlo": (b"HloModule m\nENTRY %e {\n  ROOT %a = f32[2] add(%x, %x)\n}\n",
                              ["undefined_operand.hlo:3:", "'x'"]),
    "bad_shape.hlo": (b"HloModule m\nENTRY %e {\n  ROOT %p = f32[2,,-1] parameter(0)\n}\n",
                      ["bad_shape.hlo:3:", "shape"]),
    "garbage.pb": (b"\x00\x01\x02garbage", ["garbage.pb", "HloModuleProto"]),
}


@pytest.mark.parametrize("name", sorted(BAD_MODELS))
def test_bad_model_exit_2(tmp_path, name):
    data, phrases = BAD_MODELS[name]
    path = tmp_path / name
    path.write_bytes(data)
    assert_one_line_error(run("inspect", path), *phrases)


def test_missing_path_and_directory(tmp_path):
    assert_one_line_error(run("inspect", tmp_path / "nope.hlo"), "nope.hlo", "no such file")
    assert_one_line_error(run("inspect", tmp_path), "is a directory")


BAD_CLUSTERS = {
    "missing key": ("name: c\nnodes: 1\ndevice: {name: x, memory: 1GiB, flops: {f32: 1e12}}\n"
                    "links:\n  intra_node: {bandwidth: 1GB/s, latency: 1us}\n",
                    "devices_per_node"),
    "unknown unit": ("name: c\nnodes: 1\ndevices_per_node: 2\n"
                     "device: {name: x, memory: 1GiB, flops: {f32: 1e12}}\n"
                     "links:\n  intra_node: {bandwidth: 1 furlong/s, latency: 1us}\n",
                     "links.intra_node.bandwidth"),
    "negative size": ("name: c\nnodes: 1\ndevices_per_node: 2\n"
                      "device: {name: x, memory: -1GiB, flops: {f32: 1e12}}\n"
                      "links:\n  intra_node: {bandwidth: 1GB/s, latency: 1us}\n",
                      "device.memory"),
}


@pytest.mark.parametrize("case", sorted(BAD_CLUSTERS))
def test_bad_cluster_exit_2(tmp_path, case):
    text, phrase = BAD_CLUSTERS[case]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(text)
    result = run("compile", TESTDATA / "models" / "mlp_fwd.hlo", "--cluster", cluster,
                 "-o", tmp_path / "plan", "--passes", "load")
    assert_one_line_error(result, "cluster.yaml:", phrase)
    assert not (tmp_path / "plan").exists()


def test_unknown_pass_is_usage_error(tmp_path):
    result = run("compile", TESTDATA / "models" / "mlp_fwd.hlo", "--passes", "load,nope",
                 "-o", tmp_path / "plan")
    assert_one_line_error(result, "unknown pass 'nope'")


def test_compile_dump_and_timings(tmp_path):
    out = tmp_path / "plan"
    result = run("compile", TESTDATA / "models" / "mlp_fwd.hlo", "-o", out,
                 "--passes", "load,inline-calls,cost-analysis", "--dump-after", "inline-calls",
                 "--timings")
    assert result.returncode == 0, result.stderr
    assert "cost-analysis" in result.stdout  # the timings table
    assert (tmp_path / "plan.dump" / "after-inline-calls.hlo").read_text().startswith("HloModule")
    plan = json.loads((out / "plan.json").read_text())
    assert [p["name"] for p in plan["compiler"]["passes"]] == ["load", "inline-calls",
                                                               "cost-analysis"]


PLUGIN = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "alpac-hello-pass"
        version = "0.1"
        [project.entry-points."alpac.passes"]
        hello = "alpac_hello_pass:HelloPass"
    """,
    "alpac_hello_pass/__init__.py": """
        from dataclasses import dataclass
        from alpac.hlo import Module
        from alpac.passes.manager import Pass

        @dataclass(frozen=True)
        class Greeting:
            greeting: str
            entry_instructions: int

            def plan_entries(self):
                return {"hello": {"greeting": self.greeting,
                                  "entry_instructions": self.entry_instructions}}

        @dataclass(frozen=True)
        class HelloPass(Pass):
            name = "hello"
            description = "count entry instructions (a test plug-in)"
            requires = (Module,)
            provides = (Greeting,)
            greeting: str = "hi"

            def run(self, ctx):
                ctx.put(Greeting(self.greeting, len(ctx.get(Module).entry.instructions)))
    """,
}


def test_pass_from_installed_package(tmp_path):
    src = tmp_path / "src"
    for rel, text in PLUGIN.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(textwrap.dedent(text))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(site), str(src)],
                   check=True, capture_output=True)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    listed = run("passes", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "hello" in listed.stdout and "a test plug-in" in listed.stdout

    out = tmp_path / "plan"
    result = run("compile", TESTDATA / "models" / "mlp_fwd.hlo", "-o", out,
                 "--passes", "load,hello{greeting=bonjour}", env=env)
    assert result.returncode == 0, result.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["hello"]["greeting"] == "bonjour"
    assert plan["hello"]["entry_instructions"] > 0


def test_failing_pass_is_named(tmp_path):
    # cost-analysis needs a module: without `load` before it the manager names what is missing
    result = run("compile", TESTDATA / "models" / "mlp_fwd.hlo", "-o", tmp_path / "plan",
                 "--passes", "cost-analysis")
    assert result.returncode == 1
    assert "pass 'cost-analysis' failed" in result.stderr
    assert not (tmp_path / "plan").exists()


def _wait_for_cpu(proc: subprocess.Popen, seconds: float) -> None:
    """Until `proc` has used `seconds` of CPU time (a wall-clock wait lands elsewhere in the
    compile on a loaded machine)."""
    import time
    tick = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        if (int(fields[11]) + int(fields[12])) / tick >= seconds:
            return
        time.sleep(0.05)
    raise AssertionError(f"the compile did not use {seconds} s of CPU in 300 s")


def test_ctrl_c_during_compile_is_130_in_one_line(tmp_path):
    """Ctrl-C reaches the whole process group: alpac and its ILP workers. It exits 130 with one
    line (click's own handler said `Aborted!` and exit 1), leaves the previous plan as it was
    and no temporary directory or worker behind."""
    import signal
    import time

    from alpac.runtime.processes import descendants
    out = tmp_path / "plan"
    out.mkdir()
    (out / "previous").write_text("kept")
    proc = subprocess.Popen([*ALPAC, "compile", TESTDATA / "models" / "gpt_train.hlo", "-o",
                             out, "--mesh", "2x4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True,  # Ctrl-C as a terminal gives it, even
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for_cpu(proc, 4.0)  # past loading jax: in the passes or the ILP, on any load
    below = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    out_text, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (err, out_text)
    assert err.strip().splitlines() == ["alpac: interrupted; nothing was written"], err
    assert [p.name for p in tmp_path.iterdir()] == ["plan"]
    assert (out / "previous").read_text() == "kept"
    time.sleep(1)
    assert not [p for p in below if os.path.exists(f"/proc/{p}") and
                open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]


def test_notes_say_what_the_figures_do_not(tmp_path):
    """A training step whose state is not donated repeats its first step under --iters: compile,
    explain and alpa-run say so; a plan for the uncalibrated default cluster says its clock is
    assumed. A calibrated cluster and a donated step have nothing to note."""
    text = (TESTDATA / "models" / "mlp_train.hlo").read_text()
    header, rest = text.split("\n", 1)
    (tmp_path / "stateless.hlo").write_text(header.split(",", 1)[0] + "\n" + rest)
    made = run("compile", tmp_path / "stateless.hlo", "-o", tmp_path / "plan")
    assert made.returncode == 0, made.stderr
    notes = [ln for ln in made.stderr.splitlines() if ln.startswith("alpac: note: ")]
    assert len(notes) == 2, made.stderr
    assert "aliases no output to an input" in notes[0] and "donate_argnums" in notes[0]
    assert "'local-cpu' is not calibrated" in notes[1]
    explained = run("explain", tmp_path / "plan")
    assert [ln for ln in explained.stdout.splitlines() if ln.startswith("note: ")] == \
        [n.removeprefix("alpac: ") for n in notes]
    launched = subprocess.run([str(Path(sys.executable).parent / "alpa-run"), tmp_path / "plan",
                               "--iters", "2", "--quiet", "--devices-per-rank", "8", "--", "np",
                               "1"], capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr
    assert launched.stderr.splitlines()[0] == "alpa-run: note: " + notes[0].removeprefix(
        "alpac: note: ")
    donated = run("compile", TESTDATA / "models" / "mlp_train.hlo", "-o", tmp_path / "donated",
                  "--cluster", TESTDATA / "clusters" / "local-cpu-calibrated-np2.yaml")
    assert donated.returncode == 0 and "note:" not in donated.stderr, donated.stderr


def test_explain_pipelined_plan_draws_the_schedule(tmp_path):
    plan = tmp_path / "plan"
    done = run("compile", TESTDATA / "models" / "mlp_train.hlo", "--stages", "0-0,1-1",
               "--micro-batches", "4", "-o", plan)
    assert done.returncode == 0, done.stderr
    shown = run("explain", plan, "--limit", "3")
    assert shown.returncode == 0, shown.stderr
    rows = [line for line in shown.stdout.splitlines() if line.startswith("  stage ")]
    assert len(rows) == 2  # one timeline row per stage, each with 4 forwards and 4 backwards
    for row in rows:
        cells = row.split("│")[1]
        assert [cells.count(f"F{m}") for m in range(4)] == [1] * 4
        assert [cells.count(f"B{m}") for m in range(4)] == [1] * 4
    assert "weight update" in shown.stdout


def test_stage_meshes_and_remat_are_planned_as_asked(tmp_path):
    """`--stage-meshes` pins each stage's submesh and logical mesh, `--remat` is shown per
    stage by explain and recorded per layer; bad values are one line, exit 2."""
    plan = tmp_path / "plan"
    model = TESTDATA / "models" / "mlp_train.hlo"
    done = run("compile", model, "--cluster", TESTDATA / "clusters" / "local-cpu.yaml",
               "--stages", "0-0,1-1", "--stage-meshes", "1x4,1x4:2x2", "--micro-batches", "4",
               "--remat", "full", "-o", plan)
    assert done.returncode == 0, done.stderr
    stages = json.loads((plan / "plan.json").read_text())["stages"]
    assert [s["mesh"]["physical_shape"] for s in stages] == [[1, 4], [1, 4]]
    assert stages[1]["mesh"]["logical_shape"] == [2, 2]
    assert [s["remat"] for s in stages] == [{"0": "full"}, {"1": "full"}]
    shown = run("explain", plan, "--limit", "1")
    assert shown.stdout.count("recomputation in the backward: full (layers") == 2
    assert_one_line_error(run("compile", model, "--stage-meshes", "1x4", "-o", plan),
                          "--stage-meshes '1x4' needs --stages")
    assert_one_line_error(run("compile", model, "--stages", "0-0,1-1", "--stage-meshes",
                              "1x4,four", "-o", plan), "'four' should look like 1x4")
    assert_one_line_error(run("compile", model, "--mesh", "4", "--remat", "full", "-o", plan),
                          "--remat full recomputes in the backward of pipeline stages")
    assert_one_line_error(run("compile", model, "--passes",
                              "load,cost-analysis,stage-construction{remat=some}", "-o", plan),
                          "--remat 'some' should be one of")
