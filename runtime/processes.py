"""What the launcher ends and cleans up after mpiexec, on this machine (read from /proc).

`kill_tree`: mpiexec and every process below it (hydra's proxies, the ranks' guards, the
ranks), for a stop that cannot wait for the ranks: ranks under `jax.distributed` catch SIGTERM
(its preemption notice) and go on, and a rank blocked in a collective never sees a signal
it handles. `remove_abandoned_segments`: the shared-memory segments of MPICH that killed
ranks could not unlink; each would hold its memory until the machine restarts.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from alpac.procs import started as _started

SHM = Path("/dev/shm")
SEGMENT_PREFIX = "mpich_shm_"


def kill_tree(root: int) -> None:
    """SIGKILL `root` and every process below it. Each is stopped (SIGSTOP) first, until a
    scan finds none new, so that no process forks a child the scan misses while its parent
    dies (the child would be left to init, out of reach)."""
    stopped: set[int] = set()
    while new := [p for p in [root, *descendants(root)] if p not in stopped]:
        for pid in new:
            _signal(pid, signal.SIGSTOP)
            stopped.add(pid)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)


def tree(root: int) -> dict[int, str]:
    """`root` and the processes below it, each with its start time (so that a pid reused
    later is not taken for it)."""
    return {p: t for p in [root, *descendants(root)] if (t := _started(p)) is not None}


def reap(processes: dict[int, str], grace: float) -> None:
    """Wait until every one of `processes` (a `tree`) has ended; SIGKILL those left after
    `grace` seconds. A rank can outlive mpiexec by a moment, mapping MPICH's shared memory
    until it exits, so the memory is only known to be abandoned after this."""
    if _ended(processes, grace):
        return
    for pid in _running(processes):
        _signal(pid, signal.SIGKILL)
    _ended(processes, grace)


def _ended(processes: dict[int, str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _running(processes):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _running(processes: dict[int, str]) -> list[int]:
    return [p for p, t in processes.items() if _started(p) == t]


def descendants(root: int) -> list[int]:
    """The processes below `root`, by their parent ids."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (parent := _parent(entry.name)) is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _parent(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # ended meanwhile
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:  # ended meanwhile
        pass


def segments() -> set[str]:
    """The names of MPICH's shared-memory segments now present."""
    try:
        return {e.name for e in os.scandir(SHM) if e.name.startswith(SEGMENT_PREFIX)}
    except OSError:
        return set()


def remove_abandoned_segments(before: set[str]) -> None:
    """Remove the segments that appeared since `before` and that no process maps any more."""
    new = segments() - before
    if new:
        for name in new - _mapped(new):
            try:
                (SHM / name).unlink()
            except OSError:  # another user's, or gone already
                pass


def _mapped(names: set[str]) -> set[str]:
    """Those of `names` some process (of those whose memory maps this one may read) maps."""
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            maps = Path(f"/proc/{entry.name}/maps").read_text()
        except OSError:
            continue
        found |= {n for n in names if f"{SHM}/{n}" in maps}
    return found
