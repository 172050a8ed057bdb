"""SIGTERM, SIGHUP or SIGINT to `alpa-run` ends mpiexec and every rank, removes the shared
memory the ranks left, and exits 128 + the signal's number with one line; `kill_tree` ends
a process tree whose processes ignore the polite signals and start sessions of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alpac.runtime.processes import descendants, kill_tree, segments

BIN = Path(sys.executable).parent


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None


def _alive(pid: int, cmdline: str) -> bool:
    """The process `pid` still runs the same command (not ended, not a zombie, not reused)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and _cmdline(pid) == cmdline


def _mapped_anywhere(name: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"/dev/shm/{name}" in Path(f"/proc/{pid}/maps").read_text():
                return True
        except OSError:
            continue
    return False


def _wait_for_ranks(launcher: subprocess.Popen, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = [p for p in descendants(launcher.pid) if " -m alpac.runtime.launcher "
                   in (_cmdline(p) or "") and "alpac.runtime.guard" not in _cmdline(p)]
        if len(workers) == n and segments():
            return
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.2)
    raise AssertionError("the ranks did not start")


@pytest.mark.parametrize("sig,group", [(signal.SIGTERM, False), (signal.SIGHUP, False),
                                       (signal.SIGINT, False), (signal.SIGINT, True)])
def test_a_signal_ends_every_rank(mlp_plan, sig, group):
    """`group`: to the launcher's whole process group, as Ctrl-C in a terminal (the ranks see
    it too: none reports a KeyboardInterrupt of its own)."""
    before = segments()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    launcher = subprocess.Popen([str(BIN / "alpa-run"), str(mlp_plan), "--iters", "100000",
                                 "--quiet", "--", "np", "2"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
    try:
        _wait_for_ranks(launcher, 2)
        time.sleep(2)  # the ranks run steps
        tree = {p: _cmdline(p) for p in descendants(launcher.pid)}
        if group:
            os.killpg(launcher.pid, sig)
        else:
            launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            kill_tree(launcher.pid)
    assert launcher.returncode == 128 + sig, err
    assert err.splitlines() == [f"alpa-run: stopped by {sig.name}: mpiexec and every rank "
                                f"were ended"], err
    assert out == ""
    assert any("hydra_pmi_proxy" in (c or "") for c in tree.values()), tree
    left = [c for p, c in tree.items() if c and _alive(p, c)]
    assert not left, left
    abandoned = [s for s in segments() - before if not _mapped_anywhere(s)]
    assert not abandoned, abandoned


_STUBBORN = """
import os, signal, subprocess, sys, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
depth = int(sys.argv[1])
if depth:
    subprocess.Popen([sys.executable, "-c", sys.argv[2], str(depth - 1), sys.argv[2]],
                     start_new_session=True)
time.sleep(600)
"""


def test_kill_tree_ends_processes_that_ignore_signals():
    root = subprocess.Popen([sys.executable, "-c", _STUBBORN, "3", _STUBBORN])
    try:
        deadline = time.monotonic() + 60
        while len(descendants(root.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        tree = {p: _cmdline(p) for p in [root.pid, *descendants(root.pid)]}
        assert len(tree) == 4
        kill_tree(root.pid)
        assert root.wait(timeout=10) == -signal.SIGKILL
        time.sleep(0.5)
        left = [c for p, c in tree.items() if c and _alive(p, c)]
        assert not left, left
    finally:
        if root.poll() is None:
            root.kill()
