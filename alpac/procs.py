"""This machine's processes, as alpac's parts that start or outlive processes need them:
whether a process is still the one it was (its start time), and a child that dies with its
parent.

Low in the import order (beside `alpac.errors`): the plan writer, the layer pricing's worker
pool and the runtime all use it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def started(pid: int) -> str | None:
    """The start time of process `pid` (/proc/PID/stat field 22, in clock ticks since boot),
    which tells it from a later process given the same pid; None when it has ended (or is a
    zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]  # after the name, which may hold spaces


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent ends (PR_SET_PDEATHSIG), where
    Linux allows it: for a child started from the parent's main thread, the signal comes when
    that thread ends, so with the process."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def die_with(parent: int) -> None:
    """`die_with_parent` for a child of `parent` (its pid before the fork), ending at once
    should `parent` have ended before the request was made (the child is then another's)."""
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
