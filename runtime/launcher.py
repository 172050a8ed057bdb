"""`alpa-run PLAN [options] -- MPI_ARGS`: run a plan under mpiexec, one rank per device (or
per `--devices-per-rank` devices).

After `--`, `np 8`, `-np 8` and `-n 8` set the number of ranks (default: the plan's devices
divided by the devices per rank); other arguments go to mpiexec as they are. The mpiexec is
the one installed with the `mpich` package (or `--mpiexec PATH`). Each rank runs
`python -m alpac.runtime.launcher PLAN --worker ...` (`alpac.runtime.worker`) under a guard
that records when it ended (`alpac.runtime.guard`); run that way directly under an existing
`mpiexec`, it works without the launcher.

The launcher checks the plan before starting anything (a missing or corrupt plan, or one for
another number of devices, ends with one line and exit code 2), passes the ranks' output
through without mpiexec's banners, and when a rank fails prints one line naming the rank and
the cause. Exit codes: 0 success, 1 `--check` failed, 2 bad input, 3 a rank failed (raised,
timed out, was killed), 128 + the signal's number when SIGTERM, SIGHUP or SIGINT stopped it
(it ends mpiexec and every rank first, and removes the shared memory killed ranks left).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import click

from alpac.runtime.comm import EXIT_RUNTIME, EXIT_USAGE
from alpac.runtime.processes import kill_tree, reap, remove_abandoned_segments, segments, tree
from alpac.runtime.status import STATUS_ENV

SCHEDULES = ("gpipe", "1f1b")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("plan", type=click.Path(path_type=Path))
@click.option("--inputs", type=click.Path(path_type=Path),
              help="Inputs as .npz: keys arg0, arg1, ... (by parameter number) or the HLO "
              "parameter names (default: random inputs from --seed).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--iters", default=1, show_default=True, type=click.IntRange(min=1),
              help="Steps to run; outputs feed their aliased inputs between steps.")
@click.option("--save", type=click.Path(path_type=Path),
              help="Write the outputs to this .npz (keys out0, out1, ... in flattened order).")
@click.option("--check", is_flag=True, help="Run the original module on one device for the "
              "same steps and compare (exit 1 if a relative error is over --rtol).")
@click.option("--rtol", default=1e-5, show_default=True,
              help="Tolerance of --check: max|out-ref|/max|ref| per output.")
@click.option("--report", type=click.Path(path_type=Path), help="Write the report as JSON.")
@click.option("--trace", type=click.Path(path_type=Path), help="Write every rank's timeline "
              "as a Chrome trace-event file (ui.perfetto.dev, chrome://tracing).")
@click.option("--schedule", type=click.Choice(SCHEDULES),
              help="Pipeline schedule (default: the plan's).")
@click.option("--devices-per-rank", default=1, show_default=True, type=click.IntRange(min=1),
              help="Devices each rank drives.")
@click.option("--mpiexec", "mpiexec_path", type=click.Path(path_type=Path),
              help="mpiexec to use (default: the one of the mpich package).")
@click.option("--timeout", default=300.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds any rank waits for another before giving up.")
@click.option("--platform", type=click.Choice(("auto", "cpu", "gpu")), default="auto",
              show_default=True, help="Devices to run on.")
@click.option("--allgather-min-bytes", default=1 << 20, show_default=True,
              type=click.IntRange(min=0), help="Replicated destinations of a cross-mesh "
              "transfer receive one part per device and all-gather it (Alpa's local "
              "all-gather) from this region size on; below, one device per region receives "
              "it and copies it to the others.")
@click.option("--worker", is_flag=True, help="Run as one rank (under mpiexec).")
@click.option("--quiet", is_flag=True, help="Print no report.")
@click.option("--debug", is_flag=True, help="Show the failing rank's traceback and every "
              "rank's messages.")
@click.pass_context
def cli(ctx, plan, inputs, seed, iters, save, check, rtol, report, trace, schedule,
        devices_per_rank, mpiexec_path, timeout, platform, allgather_min_bytes, worker, quiet,
        debug):
    """Run the plan in PLAN across MPI ranks: alpa-run PLAN [options] -- np N [mpiexec args]"""
    from alpac.runtime.worker import Options
    opts = Options(str(plan), str(inputs) if inputs else None, seed, iters,
                   str(save) if save else None, check, rtol, str(report) if report else None,
                   schedule, devices_per_rank, timeout, platform, quiet, allgather_min_bytes,
                   str(trace) if trace else None)
    if debug:
        os.environ["ALPAC_RUN_DEBUG"] = "1"
    if worker:
        from alpac.runtime.worker import main as worker_main
        sys.exit(worker_main(opts))
    sys.exit(launch(opts, ctx.obj["mpi"], mpiexec_path, debug))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    mpi: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, mpi = argv[:cut], argv[cut + 1:]
    try:
        cli.main(args=argv, prog_name="alpa-run", standalone_mode=False, obj={"mpi": mpi})
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(EXIT_USAGE)


def fail_usage(message: str) -> int:
    click.echo(f"alpa-run: error: {message}", err=True)
    return EXIT_USAGE


def parse_mpi_args(args: list[str]) -> tuple[int | None, list[str]]:
    """(number of ranks, the other mpiexec arguments) from the words after `--`."""
    n, rest = None, []
    i = 0
    while i < len(args):
        a = args[i]
        m = re.fullmatch(r"-{0,2}(?:np|n)=(\d+)", a)
        if m:
            n = int(m.group(1))
        elif a in ("np", "-np", "--np", "-n", "-n"):
            if i + 1 >= len(args) or not args[i + 1].isdigit():
                raise ValueError(f"'{a}' needs a number of ranks after it")
            n = int(args[i + 1])
            i += 1
        else:
            rest.append(a)
        i += 1
    if n is not None and n < 1:
        raise ValueError("the number of ranks must be at least 1")
    return n, rest


def find_mpiexec() -> str | None:
    """The mpiexec of the `mpich` package (next to this Python), else one on PATH."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution
        for f in distribution("mpich").files or []:
            if str(f).endswith("bin/mpiexec"):
                path = Path(f.locate()).resolve()
                if path.exists():
                    return str(path)
    except (PackageNotFoundError, ImportError, OSError):
        pass
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    return shutil.which("mpiexec")


def check_plan(opts) -> int:
    """The plan's device count (UserError if the plan cannot be run: loading it checks every
    file it names, `alpac.plan.io.plan_file`)."""
    from alpac.errors import UserError
    from alpac.plan.io import SOURCE_FILE
    from alpac.plan.program import load_program
    from alpac.runtime.timeline import build
    plan_dir = Path(opts.plan)
    plan, _, program, where = load_program(plan_dir)
    build(program, opts.schedule, where)
    if opts.check and not os.path.lexists(plan_dir / SOURCE_FILE):
        raise UserError("--check needs the original module source.hlo in the plan",
                        path=str(plan_dir))
    if opts.inputs and not Path(opts.inputs).is_file():
        raise UserError("no such inputs file", path=opts.inputs)
    if opts.iters > 1:
        from alpac.plan.notes import STATELESS_STEP, notes_of
        for note in notes_of(plan, STATELESS_STEP):
            click.echo(f"alpa-run: note: {note}", err=True)
    return max(d for m in program.meshes for d in m.devices) + 1


def launch(opts, mpi_args: list[str], mpiexec_path: Path | None, debug: bool) -> int:
    from alpac.errors import UserError
    try:
        devices = check_plan(opts)
    except UserError as e:
        return fail_usage(str(e))
    try:
        n, extra = parse_mpi_args(mpi_args)
    except ValueError as e:
        return fail_usage(str(e))
    k = opts.devices_per_rank
    if n is None:
        if devices % k:
            return fail_usage(f"the plan runs on {devices} devices, which {k} devices per "
                              f"rank do not divide")
        n = devices // k
    if n * k != devices:
        return fail_usage(f"{opts.plan}/plan.json: the plan runs on {devices} devices, but "
                          f"{n} ranks x {k} devices per rank = {n * k} were asked for"
                          f"{_what_fits(devices, n, k)}")
    mpiexec = str(mpiexec_path) if mpiexec_path else find_mpiexec()
    if not mpiexec or not Path(mpiexec).exists() and not shutil.which(mpiexec):
        return fail_usage("no mpiexec found (install the mpich package or pass --mpiexec)")
    return run_ranks(mpiexec, n, extra, ["alpac.runtime.launcher", opts.plan, "--worker",
                                         *worker_args(opts)], debug)


def _what_fits(devices: int, n: int, k: int) -> str:
    """The launch that runs a plan on `devices`: n ranks' devices each, or k per rank."""
    fits = ([f"--devices-per-rank {devices // n}"] if devices % n == 0 else []) + \
        ([f"-- np {devices // k}"] if devices % k == 0 else [])
    return f" (pass {' or '.join(fits)})" if fits else ""


def run_ranks(mpiexec: str, n: int, extra: list[str], module_args: list[str], debug: bool,
              prog: str = "alpa-run") -> int:
    """`python -m MODULE_ARGS...` as n ranks under mpiexec, supervised: the exit code (see
    the module's docstring); `prog` names the command in the error lines."""
    status = Path(tempfile.mkdtemp(prefix="alpa-run-"))
    # each rank runs under a guard that records when it ended (see alpac.runtime.guard)
    cmd = [mpiexec, "-n", str(n), *extra, sys.executable, "-m", "alpac.runtime.guard",
           *module_args]
    env = dict(os.environ)
    env[STATUS_ENV] = str(status)
    env["PYTHONUNBUFFERED"] = "1"
    if sys.stdout.isatty():
        env.setdefault("ALPAC_RUN_COLOR", "1")
        env.setdefault("ALPAC_RUN_WIDTH", str(shutil.get_terminal_size().columns))
    try:
        with _StopSignals() as stop:
            return _supervise(cmd, env, status, n, debug, prog, stop)
    finally:
        shutil.rmtree(status, ignore_errors=True)


def worker_args(opts) -> list[str]:
    out = ["--seed", str(opts.seed), "--iters", str(opts.iters), "--rtol", repr(opts.rtol),
           "--devices-per-rank", str(opts.devices_per_rank), "--timeout", repr(opts.timeout),
           "--platform", opts.platform, "--allgather-min-bytes", str(opts.allgather_min_bytes)]
    for flag, value in (("--inputs", opts.inputs), ("--save", opts.save),
                        ("--report", opts.report), ("--trace", opts.trace),
                        ("--schedule", opts.schedule)):
        if value is not None:
            out += [flag, value]
    if opts.check:
        out.append("--check")
    if opts.quiet:
        out.append("--quiet")
    return out


_BANNER = re.compile(r"^(=+|=\s.*|YOUR APPLICATION TERMINATED WITH THE EXIT STRING:.*|"
                     r"This typically refers to a problem with your application\.|"
                     r"Please see the FAQ page for debugging suggestions|"
                     r"Abort\(\d+\) on node \d+.*application called MPI_Abort.*|"
                     r"Ctrl-C caught\.\.\. cleaning up processes|"
                     r"\[mpiexec@[^\]]*\] (Sending Ctrl-C to processes as requested|"
                     r"Press Ctrl-C again to force abort))$")


# gloo's connection messages (two ranks' may interleave on one line)
_GLOO = re.compile(r"^(\[Gloo\] Rank )+(\d+ is connected to \d+ peer ranks.*)?$|"
                   r"peer ranks\. Expected number of connected peer ranks is")


class _Output:
    """Passes the ranks' output through, holding stderr lines back briefly so that the noise
    of ranks being ended after a failure can be dropped."""

    HOLD = 0.5

    def __init__(self, debug: bool):
        self.debug = debug
        self.failed = False
        self.exit_string: str | None = None
        self._held: deque = deque()
        self._lock = threading.Lock()
        self.dropped: list[str] = []

    def pump(self, stream, is_err: bool) -> None:
        blanks = 0  # blank lines held: mpiexec's banner of a killed job starts with one
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            m = re.match(r"^YOUR APPLICATION TERMINATED WITH THE EXIT STRING: (.*)$", line)
            if m:
                self.exit_string = m.group(1).strip()
            if _GLOO.search(line) and not self.debug:
                continue
            if _BANNER.match(line.strip()) and not self.debug:
                self.failed, blanks = True, 0
                continue
            if not line.strip() and not self.debug:
                blanks += 1
                continue
            for _ in range(blanks):
                self._write("", is_err)
            blanks = 0
            self._write(line, is_err)
        if not self.failed:
            for _ in range(blanks):
                self._write("", is_err)

    def _write(self, line: str, is_err: bool) -> None:
        if is_err and not self.debug:
            with self._lock:
                self._held.append((time.monotonic(), line))
        else:
            target = sys.stderr if is_err else sys.stdout
            target.write(line + "\n")
            target.flush()

    def release(self, final: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            while self._held and (final or now - self._held[0][0] > self.HOLD):
                _, line = self._held.popleft()
                if self.failed:
                    self.dropped.append(line)
                else:
                    sys.stderr.write(line + "\n")
            sys.stderr.flush()


def _supervise(cmd, env, status: Path, n: int, debug: bool, prog: str,
               stop: "_StopSignals") -> int:
    segments_before = segments()
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
    except OSError as e:
        return fail_usage(f"cannot start {cmd[0]}: {e.strerror}")
    out = _Output(debug)
    readers = [threading.Thread(target=out.pump, args=(proc.stdout, False), daemon=True),
               threading.Thread(target=out.pump, args=(proc.stderr, True), daemon=True)]
    for t in readers:
        t.start()
    deaths = _Deaths(status)
    job = _watch(proc, out, deaths, stop)
    for t in readers:
        t.join(timeout=5)
    # ranks that were killed left MPICH's shared memory behind; mpiexec may still exit 0
    # (as on Ctrl-C to the whole process group), so its exit code does not tell
    reap(job, _END_GRACE)
    remove_abandoned_segments(segments_before)
    if stop.received:
        out.failed = True
        out.release(final=True)
        click.echo(f"{prog}: stopped by {signal.Signals(stop.received).name}: mpiexec and "
                   f"every rank were ended", err=True)
        return 128 + stop.received
    return _verdict(proc.returncode, out, deaths, status, debug, prog)


def _watch(proc, out: "_Output", deaths: "_Deaths", stop: "_StopSignals") -> dict[int, str]:
    """Until mpiexec exits: pass the output on; end the job when a rank died without a word
    and mpiexec does not end it, or when a signal asks the launcher to stop. Returns the
    processes of the job seen on this machine (a `tree`), which may outlive mpiexec."""
    ended_at, job, seen_at = None, {}, 0.0
    while proc.poll() is None:
        time.sleep(0.05)
        if time.monotonic() - seen_at > 1.0:
            job.update(tree(proc.pid))
            seen_at = time.monotonic()
        if stop.received:
            out.failed = True
            _end(proc, signal.SIGINT)  # as Ctrl-C to mpiexec: it passes it to every rank
            return job
        if list(deaths.status.glob("error.rank*.json")):
            out.failed = True
        out.release()
        if ended_at is None and deaths.silent():
            ended_at = time.monotonic()  # a rank died without a word: end the others
            out.failed = True
        if ended_at is not None and time.monotonic() - ended_at > _GRACE:
            _end(proc, signal.SIGTERM)
    return job


def _verdict(rc: int, out: "_Output", deaths: "_Deaths", status: Path, debug: bool,
             prog: str) -> int:
    """The exit code of the run mpiexec ended with `rc`, and one line naming the rank that
    failed first and why."""
    errors = []
    for f in status.glob("error.rank*.json"):
        try:
            errors.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError):
            pass
    if errors or rc not in (0, 1):
        out.failed = True
    out.release(final=True)
    first_error = min(errors, key=lambda e: e["time"]) if errors else None
    reported = {e.get("rank") for e in errors}
    # a rank that vanished without a word before any rank reported an error was killed
    silent = {r: t for r, t in deaths.silent().items() if r not in reported}
    if silent and (first_error is None or min(silent.values()) < first_error["time"]):
        dead = min(silent, key=silent.get)  # mpiexec ended the others after it
        how = f" ({out.exit_string})" if out.exit_string else f" (mpiexec exit code {rc})"
        click.echo(f"{prog}: error: rank {dead} ended unexpectedly{how}; the other ranks were "
                   f"stopped", err=True)
        if debug and out.dropped:
            click.echo("\n".join(out.dropped), err=True)
        return EXIT_RUNTIME
    if first_error is not None:
        where = f"rank {first_error['rank']}: " if first_error.get("rank") is not None else ""
        click.echo(f"{prog}: error: {where}{first_error['message']}", err=True)
        if debug and first_error.get("detail"):
            click.echo(first_error["detail"], err=True)
        return int(first_error.get("code") or EXIT_RUNTIME)
    if rc in (0, 1):
        return rc
    how = f" ({out.exit_string})" if out.exit_string else f" (mpiexec exit code {rc})"
    click.echo(f"{prog}: error: a rank ended unexpectedly{how}; the other ranks were "
               f"stopped", err=True)
    return EXIT_RUNTIME


# after a rank dies without a word: seconds for the other ranks to report an error of their
# own, and for mpiexec to end the job itself and say how the rank died (it usually takes
# milliseconds; on a loaded machine over a second, and ending it sooner loses the reason)
_GRACE = 5.0
# after the launcher signals mpiexec to end the job: seconds before it kills what is left
_END_GRACE = 3.0


def _end(proc, first: signal.Signals) -> None:
    """End mpiexec and every rank: `first` to mpiexec, which passes it to the ranks on every
    host; what is left on this machine after `_END_GRACE` is killed (`kill_tree`), and
    the ranks that outlive mpiexec are waited for."""
    job = tree(proc.pid)
    proc.send_signal(first)
    try:
        proc.wait(timeout=_END_GRACE)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
    reap(job, _END_GRACE)


class _StopSignals:
    """SIGTERM, SIGHUP and SIGINT to the launcher while it supervises the ranks: noted, not
    raised, so that it ends mpiexec and every rank before it exits (128 + the signal)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __enter__(self) -> "_StopSignals":
        self.received: int | None = None
        self._before = {s: signal.signal(s, self._note) for s in self.SIGNALS}
        return self

    def _note(self, signum: int, _frame) -> None:
        self.received = self.received or signum

    def __exit__(self, *_) -> None:
        for s, handler in self._before.items():
            signal.signal(s, handler)


class _Deaths:
    """How and when each rank's process ended, from the records of the ranks' guards
    (alpac.runtime.guard) and the pid files the ranks write. (One machine; elsewhere
    nothing is known.)"""

    def __init__(self, status: Path):
        self.status = status

    @property
    def pids(self) -> dict[int, int]:
        out = {}
        for f in self.status.glob("pid.rank*"):
            try:
                out[int(f.name[len("pid.rank"):])] = int(f.read_text())
            except (OSError, ValueError):
                continue
        return out

    def gone(self) -> dict[int, float]:
        """rank -> wall time its process ended."""
        ended = {}
        for f in self.status.glob("ended.pid*.json"):
            try:
                record = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            ended[record["pid"]] = record["time"]
        return {rank: ended[pid] for rank, pid in self.pids.items() if pid in ended}

    def silent(self) -> dict[int, float]:
        """rank -> wall time it ended, of the ranks that ended with neither an error report
        nor a normal finish."""
        return {rank: t for rank, t in self.gone().items()
                if not (self.status / f"done.rank{rank}").exists()
                and not (self.status / f"error.rank{rank}.json").exists()}


if __name__ == "__main__":
    main()
