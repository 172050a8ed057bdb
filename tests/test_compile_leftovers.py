"""Nothing a killed `alpac compile` started outlives it for long: its ILP workers die with it,
and the next compile to the same target removes the temporary directories it left (never
those of a compile still running)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import TESTDATA

from alpac.plan import io
from alpac.procs import started
from alpac.runtime.processes import descendants

BIN = Path(sys.executable).parent


def test_killing_a_compile_kills_its_ilp_workers(tmp_path):
    # gpt_train's layer ILPs keep a pool of two workers busy for about 20 s on this machine
    compile_ = subprocess.Popen(
        [str(BIN / "alpac"), "compile", str(TESTDATA / "models" / "gpt_train.hlo"), "--jobs",
         "2", "--time-limit", "2", "-o", str(tmp_path / "plan")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: dict[int, str | None] = {}
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and compile_.poll() is None and time.monotonic() < deadline:
            workers = {p: started(p) for p in descendants(compile_.pid)}
            time.sleep(0.02)
        assert len(workers) >= 2, "the compile never started its ILP workers"
        compile_.send_signal(signal.SIGKILL)
        compile_.wait()
        deadline = time.monotonic() + 5
        while (left := [p for p, t in workers.items() if t is not None and started(p) == t]) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"workers {left} outlived the killed compile"
    finally:
        compile_.kill()
        compile_.wait()
        for pid, t in workers.items():
            if t is not None and started(pid) == t:
                os.kill(pid, signal.SIGKILL)


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_compile_removes_what_a_killed_compile_of_its_target_left(tmp_path):
    host, me, since = io._creator().split("-")
    out = tmp_path / "plan"
    stale = [tmp_path / f".plan.tmp-{host}-{_dead_pid()}-1-abcd1234",  # its compile ended
             tmp_path / f".plan.tmp-{host}-{me}-{int(since) + 1}-abcd1234",  # pid reused since
             tmp_path / f".plan.old-{host}-{_dead_pid()}-1"]  # killed before removing it
    live = [tmp_path / f".plan.tmp-{host}-{me}-{since}-abcd1234",  # a compile running here
            tmp_path / f".plan.tmp-00000000-{_dead_pid()}-1-abcd1234",  # another host's
            tmp_path / f".other.tmp-{host}-{_dead_pid()}-1-abcd1234"]  # another target's
    for d in stale + live:
        d.mkdir()
        (d / "plan.json").write_text("{}")
    out.mkdir()
    (out / "plan.json").write_text("{}")  # a previous plan
    r = subprocess.run([str(BIN / "alpac"), "compile", str(TESTDATA / "models" / "mlp_fwd.hlo"),
                        "--mesh", "2", "--time-limit", "2", "--jobs", "1", "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [d.name for d in stale if d.exists()] == []
    assert [d.name for d in live if not d.exists()] == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".plan.")) \
        == sorted(d.name for d in live if d.name.startswith(".plan."))
    assert '"schema"' in (out / "plan.json").read_text()


def test_a_plan_hidden_by_a_compile_killed_between_its_renames_is_put_back(tmp_path):
    host, _, _ = io._creator().split("-")
    hidden = tmp_path / f".plan.old-{host}-{_dead_pid()}-1"
    hidden.mkdir()
    (hidden / "plan.json").write_text("the previous plan")
    io._remove_leftovers(tmp_path / "plan")
    assert not hidden.exists()
    assert (tmp_path / "plan" / "plan.json").read_text() == "the previous plan"
