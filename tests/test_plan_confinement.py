"""A plan is confined to its directory: each file it names, and plan.json itself, is a regular
file inside it (a symlink only to one) within a size bound, or the plan is refused with one
line and exit code 2 by `alpac explain` (with --verify, --against) and by `alpa-run` before
mpiexec starts; and no file outside the directory is opened on the way (an audit hook)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _edit_plan(plan: Path, change) -> None:
    data = json.loads((plan / "plan.json").read_text())
    change(data)
    (plan / "plan.json").write_text(json.dumps(data))


def _symlink(plan: Path, name: str, target: str) -> None:
    (plan / name).unlink()
    (plan / name).symlink_to(target)


def _outside_copy(plan: Path, name: str) -> None:
    """`name` a symlink to a copy of itself outside the plan directory."""
    outside = plan.parent / f"outside-{name}"
    shutil.copy(plan / name, outside)
    _symlink(plan, name, str(outside))


def _fifo(plan: Path, name: str) -> None:
    (plan / name).unlink()
    os.mkfifo(plan / name)


def _replace_by_dir(plan: Path, name: str) -> None:
    (plan / name).unlink()
    (plan / name).mkdir()


def _sparse(plan: Path, name: str, size: int) -> None:
    with open(plan / name, "r+b") as f:
        f.truncate(size)


def _set_module(name: str):
    def change(data):
        data["stages"][0]["module"] = name
        data["program"]["modules"][0]["file"] = name
    return lambda plan: _edit_plan(plan, change)


def _set_decisions(name: str):
    return lambda plan: _edit_plan(plan, lambda d: d["stages"][0].update(decisions=name))


# (tampering, what the one line says)
TAMPERINGS = {
    "absolute module": (_set_module("/etc/passwd"), "names the module file '/etc/passwd'"),
    "dotdot decisions": (_set_decisions("../../etc/passwd"),
                         "names the decisions file '../../etc/passwd'"),
    "absolute device": (_set_module("/dev/zero"), "names the module file '/dev/zero'"),
    "symlink outside": (lambda p: _outside_copy(p, "stage0.hlo"), "outside the plan directory"),
    "symlink to device": (lambda p: _symlink(p, "stage0.decisions.json", "/dev/zero"),
                          "is a symlink to /dev/zero, outside the plan directory"),
    "source symlink": (lambda p: _symlink(p, "source.hlo", "/etc/passwd"),
                       "source.hlo: is a symlink to /etc/passwd"),
    "fifo module": (lambda p: _fifo(p, "stage0.hlo"), "stage0.hlo: is a FIFO"),
    "directory decisions": (lambda p: _replace_by_dir(p, "stage0.decisions.json"),
                            "stage0.decisions.json: is a directory"),
    "huge decisions": (lambda p: _sparse(p, "stage0.decisions.json", 3 << 30),
                       "may be at most 1 GiB"),
    "plan.json fifo": (lambda p: _fifo(p, "plan.json"), "plan.json: is a FIFO"),
    "plan.json directory": (lambda p: _replace_by_dir(p, "plan.json"),
                            "plan.json: is a directory"),
    "plan.json huge": (lambda p: _sparse(p, "plan.json", 3 << 30), "may be at most 1 GiB"),
    "plan.json to outside": (lambda p: _outside_copy(p, "plan.json"),
                             "outside the plan directory"),
    "missing module": (lambda p: (p / "stage0.hlo").unlink(),
                       "the plan's module file stage0.hlo is missing"),
}


@pytest.fixture(params=sorted(TAMPERINGS))
def tampered(request, mlp_plan, tmp_path):
    plan = tmp_path / "plan"
    shutil.copytree(mlp_plan, plan)
    tamper, phrase = TAMPERINGS[request.param]
    tamper(plan)
    return plan, phrase


def _assert_refused(result, phrase: str, prog: str) -> None:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr + result.stdout
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"{prog}: error: ") and phrase in lines[0], lines[0]


def test_explain_refuses_a_tampered_plan(tampered):
    plan, phrase = tampered
    r = subprocess.run([str(BIN / "alpac"), "explain", str(plan)], capture_output=True,
                       text=True, timeout=60)
    _assert_refused(r, phrase, "alpac")


def test_alpa_run_refuses_a_tampered_plan_before_mpiexec(tampered, tmp_path):
    plan, phrase = tampered
    started = tmp_path / "mpiexec-started"
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\ntouch {started}\n")
    fake.chmod(0o755)
    r = subprocess.run([str(BIN / "alpa-run"), str(plan), "--mpiexec", str(fake), "--",
                        "np", "2"], capture_output=True, text=True, timeout=60)
    _assert_refused(r, phrase, "alpa-run")
    assert not started.exists()


@pytest.mark.parametrize("mode", [["--verify"], ["--against", "report.json"],
                                  ["--trace", "trace.json"], ["--json"]])
def test_every_explain_mode_refuses(mlp_plan, tmp_path, mode):
    plan = tmp_path / "plan"
    shutil.copytree(mlp_plan, plan)
    _outside_copy(plan, "stage0.hlo")
    (tmp_path / "report.json").write_text("{}")
    r = subprocess.run([str(BIN / "alpac"), "explain", str(plan), *mode], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    _assert_refused(r, "outside the plan directory", "alpac")
    assert not (tmp_path / "trace.json").exists()


def test_a_symlink_to_a_file_inside_is_accepted(mlp_plan, tmp_path):
    plan = tmp_path / "plan"
    shutil.copytree(mlp_plan, plan)
    (plan / "stage0.hlo").rename(plan / "module.hlo")
    (plan / "stage0.hlo").symlink_to("module.hlo")
    r = subprocess.run([str(BIN / "alpac"), "explain", str(plan)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ---- nothing outside the plan directory is opened ---------------------------------------

_opened: list[str] | None = None


def _record_open(event: str, args) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, Path)):
        _opened.append(os.fsdecode(args[0]))


def _opens_while(action) -> list[str]:
    """The paths opened while `action()` runs (an audit hook, which stays installed for the
    session: it records only here)."""
    global _opened
    if not getattr(_opens_while, "installed", False):
        sys.addaudithook(_record_open)
        _opens_while.installed = True
    _opened = []
    try:
        action()
        return _opened
    finally:
        _opened = None


@pytest.mark.parametrize("name", ["absolute module", "symlink outside", "symlink to device",
                                  "source symlink", "fifo module", "plan.json to outside"])
def test_nothing_outside_the_plan_is_opened(mlp_plan, tmp_path, name):
    from click.testing import CliRunner

    from alpac.cli import main
    from alpac.errors import UserError
    from alpac.runtime.launcher import check_plan
    from alpac.runtime.worker import Options

    def explain(plan: Path) -> int:
        return CliRunner().invoke(main, ["explain", str(plan)]).exit_code

    def launch_check(plan: Path) -> None:
        with pytest.raises(UserError):
            check_plan(Options(str(plan)))

    plan = tmp_path / "plan"
    shutil.copytree(mlp_plan, plan)
    # the untampered plan: warms the imports up, and shows that the hook sees the reads
    seen = _opens_while(lambda: (explain(plan), check_plan(Options(str(plan)))))
    assert any(p.endswith("stage0.decisions.json") for p in seen), seen
    TAMPERINGS[name][0](plan)
    inside = plan.resolve()
    codes = []
    seen = _opens_while(lambda: codes.append(explain(plan)))
    seen += _opens_while(lambda: launch_check(plan))
    assert codes == [2]
    outside = [p for p in seen if not Path(p).resolve().is_relative_to(inside)]
    assert not outside, outside
