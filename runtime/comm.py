"""MPI between the ranks of `alpa-run`, with a deadline on every wait, and how a rank fails.

Nothing here blocks without a deadline: receives, barriers and the completion of sends are
non-blocking MPI requests polled (with a short, growing sleep, so that waiting ranks leave
the CPU to working ones) until `timeout` seconds pass; then the rank fails with a message that
says what it waited for and from which rank. A watchdog thread covers what cannot be polled
(a module whose collectives wait on a dead peer inside XLA).

A rank that fails reports once and calls MPI_Abort, so that mpiexec ends every other rank at
once. Under the launcher (`ALPAC_RUN_STATUS_DIR` set) the report is a JSON file the launcher
reads to print one line; run directly under mpiexec, it is that line on stderr.

Exit codes: 0 success, 1 a check failed, 2 bad input (plan, inputs, options), 3 a rank failed
while running (raised, timed out, was killed).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from alpac.plan.calibration import pauses
from alpac.runtime.status import STATUS_ENV, write_json

EXIT_CHECK = 1
EXIT_USAGE = 2
EXIT_RUNTIME = 3


class RankTimeout(Exception):
    """A wait passed its deadline."""


class Comm:
    """COMM_WORLD with deadlines. Tags below 2**20 are the executor's; the ones above are
    for the worker's own messages (outputs, statistics)."""

    def __init__(self, timeout: float):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = float(timeout)
        self._pending: list[tuple[object, object]] = []  # (request, buffer kept alive)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.watchdog = Watchdog(self.rank)
        self._progress: threading.Thread | None = None
        if self.size > 1:
            self._progress = threading.Thread(target=self._progress_loop,
                                              name="alpa-run-progress", daemon=True)
            self._progress.start()

    def own_cpu(self) -> float:
        """The CPU seconds alpa-run's own threads of this process used so far (the calling
        thread, the progress thread, the watchdog): its host work. The rest of the process's
        CPU time is XLA's threads (compute, collectives), MPI's and gloo's."""
        cpu = time.thread_time()
        for t in (self._progress, self.watchdog.thread):
            if t is not None and t.ident is not None and hasattr(time, "pthread_getcpuclockid"):
                try:
                    cpu += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                except OSError:  # the thread ended
                    pass
        return cpu

    # ---- waiting -------------------------------------------------------------------------
    def wait(self, request, what: str) -> None:
        """Poll `request` until it completes or the deadline passes (RankTimeout)."""
        if not request.Test():
            self._poll(request.Test, what)

    def _poll(self, done, what: str) -> None:
        """Sleep the polling's pauses (`pauses`) until `done()`; RankTimeout after the
        deadline."""
        deadline = time.monotonic() + self.timeout
        for pause in pauses():
            if done():
                return
            if time.monotonic() > deadline:
                raise RankTimeout(f"timed out after {self.timeout:g} s waiting for {what}")
            time.sleep(pause)

    def barrier(self, what: str = "the other ranks") -> None:
        if self.size > 1:
            self.wait(self.comm.Ibarrier(), what)

    # ---- buffers -------------------------------------------------------------------------
    def isend(self, buf: np.ndarray, dest: int, tag: int) -> None:
        """Start sending a contiguous buffer; completed by `progress` / `flush`, and in the
        background (large messages need the sender's MPI progress while it computes)."""
        buf = np.ascontiguousarray(buf)
        request = self.comm.Isend(buf, dest=dest, tag=tag)
        if request.Test():  # sent eagerly (a small message): no thread to wake for it
            return
        with self._lock:
            self._pending.append((request, buf))
        self._wake.set()

    def _progress_loop(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(2e-4)
            with self._lock:
                if self._pending:
                    self._pending = [(r, b) for r, b in self._pending if not r.Test()]
                if not self._pending:
                    self._wake.clear()

    def recv(self, buf: np.ndarray, source: int, tag: int, what: str) -> np.ndarray:
        self.wait(self.comm.Irecv(buf, source=source, tag=tag), f"{what} from rank {source}")
        return buf

    def progress(self) -> None:
        """Drop the sends that completed."""
        if self._pending:
            with self._lock:
                self._pending = [(r, b) for r, b in self._pending if not r.Test()]

    def flush(self, what: str = "sends to complete") -> None:
        """Wait for every started send (their receivers must have posted receives)."""
        self._poll(self._all_sent, what)

    def _all_sent(self) -> bool:
        self.progress()
        return not self._pending

    # ---- python objects ------------------------------------------------------------------
    def send_obj(self, obj, dest: int, tag: int) -> None:
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self.isend(data, dest, tag)

    def recv_obj(self, source: int, tag: int, what: str):
        status = self.MPI.Status()
        self._poll(lambda: self.comm.Iprobe(source=source, tag=tag, status=status),
                   f"{what} from rank {source}")
        buf = np.empty(status.Get_count(self.MPI.BYTE), np.uint8)
        self.comm.Recv(buf, source=source, tag=tag)
        return pickle.loads(buf.tobytes())

    def gather_obj(self, obj, tag: int, what: str) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        if self.rank != 0:
            self.send_obj(obj, 0, tag)
            self.flush(f"rank 0 to take {what}")
            return None
        return [obj] + [self.recv_obj(r, tag, what) for r in range(1, self.size)]

    def bcast_obj(self, obj, tag: int, what: str):
        if self.rank == 0:
            for r in range(1, self.size):
                self.send_obj(obj, r, tag)
            self.flush(f"the other ranks to take {what}")
            return obj
        return self.recv_obj(0, tag, what)


class Watchdog:
    """Fails the rank when an armed operation outlives its deadline."""

    def __init__(self, rank: int):
        self.rank = rank
        self._what: str | None = None
        self._deadline = 0.0
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def arm(self, what: str, seconds: float) -> None:
        with self._lock:
            self._what, self._deadline = what, time.monotonic() + seconds
            self._seconds = seconds
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, name="alpa-run-watchdog",
                                           daemon=True)
            self.thread.start()

    def disarm(self) -> None:
        with self._lock:
            self._what = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            with self._lock:
                what, late = self._what, time.monotonic() > self._deadline
            if what is not None and late:
                fail(self.rank, f"timed out after {self._seconds:g} s {what}", EXIT_RUNTIME)


# ---- failing -----------------------------------------------------------------------------

_failed = threading.Lock()
# mpiexec forwards a rank's stderr through its process manager, and MPI_Abort can overtake
# what is still in the pipe: a rank that reports on stderr gives the line this long to pass
_FORWARD_S = 0.5


def report_error(rank: int | None, message: str, code: int, detail: str | None = None) -> bool:
    """Tell the launcher (status file) or the user (stderr) what went wrong, once; whether
    it went to stderr."""
    status = os.environ.get(STATUS_ENV)
    where = f"rank {rank}: " if rank is not None else ""
    if status:
        try:
            write_json(Path(status) / f"error.rank{rank if rank is not None else 'x'}.json",
                       {"rank": rank, "message": message, "code": code, "time": time.time(),
                        "detail": detail})
            return False
        except OSError:
            pass
    sys.stderr.write(f"alpa-run: error: {where}{message}\n")
    if detail and os.environ.get("ALPAC_RUN_DEBUG"):
        sys.stderr.write(detail)
    sys.stderr.flush()
    return True


def fail(rank: int | None, message: str, code: int, detail: str | None = None) -> None:
    """Report and end every rank (MPI_Abort); never returns."""
    if not _failed.acquire(blocking=False):
        time.sleep(3600)  # another thread is already failing this rank
    try:
        if report_error(rank, message, code, detail):
            time.sleep(_FORWARD_S)
        sys.stdout.flush()
    finally:
        abort(code)


def abort(code: int) -> None:
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(code)
    except Exception:
        pass
    os._exit(code)


def describe(exc: BaseException) -> tuple[str, int, str]:
    """(one-line message, exit code, traceback text) of an exception a rank raised."""
    from alpac.errors import CheckFailed, UserError
    tb = "".join(traceback.format_exception(exc))
    if isinstance(exc, UserError):
        return str(exc), EXIT_USAGE, tb
    if isinstance(exc, CheckFailed):
        return str(exc), EXIT_CHECK, tb
    if isinstance(exc, RankTimeout):
        return str(exc), EXIT_RUNTIME, tb
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": "), EXIT_RUNTIME, tb
