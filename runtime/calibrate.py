"""`alpac calibrate`: measure what programs get from this machine's devices and links, and
write it as a cluster.yaml with a `calibration:` section (schema: alpac.plan.calibration).

The `alpac` command (the compiler side, which never imports the runtime) starts this module
as `python -m alpac.runtime.calibrate OPTIONS_JSON [MPI_ARGS]`. It launches the ranks like
`alpa-run` (the launcher's mpiexec supervision), in two phases: `local` (single-process jax on
every rank: launching, dots, elementwise and reduce, sends, and with one rank its
collectives) and, with more than one rank, `inter` (multi-process jax, gloo on CPU: every
collective, a rank's own among its devices included, for a multi-rank alpa-run sends those
through gloo too; jax cannot be both in one process). Each phase's rank 0 gathers the ranks'
medians into a JSON file; this process shows the progress rank 0 reports, then writes the
YAML file, or with `--check` compares a sample of a recorded file's rows and reports the
drift per table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from alpac.runtime.comm import EXIT_CHECK, EXIT_RUNTIME, EXIT_USAGE
from alpac.plan.calibration import HOST_COUNTS, SCALARS
from alpac.plan.io import write_replacing
from alpac.runtime.calibration_grid import (Point, collective_bytes, collective_phase,
                                            dot_shapes, dot_side, grid)
from alpac.runtime.status import STATUS_ENV, write_json

PROGRESS = "progress.json"
TRANSPORT_FAILED = "transport-failed"  # a rank of the phase saw gloo's transport fail
GLOO_FAILED = re.compile(r"\bGloo\b.*\bfailed\b", re.IGNORECASE)
TAG_GATHER = (1 << 28) + 18
# check: sample rows up to these sizes (FLOPs for dots, bytes otherwise), so that it is quick
CHECK_MAX_FLOPS, CHECK_MAX_BYTES = 3e8, 8 << 20


@dataclass
class Options:
    output: str | None = None
    check: str | None = None
    tolerance: float = 0.5
    quick: bool = False
    devices_per_rank: int | None = None
    name: str | None = None
    mpiexec: str | None = None
    timeout: float = 300.0
    platform: str = "auto"
    debug: bool = False
    report: str | None = None  # with check: the drift per table as JSON


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        sys.exit(worker(argv[1], Path(argv[2])))
    from alpac.errors import UserError
    try:
        sys.exit(calibrate(Options(**json.loads(argv[0])), argv[1:]))
    except UserError as e:  # e.g. the cluster file or the drift report could not be written
        sys.exit(fail_usage(str(e)))


def fail_usage(message: str) -> int:
    print(f"alpac: error: {message}", file=sys.stderr)
    return EXIT_USAGE


# ---- the command ---------------------------------------------------------------------------

def calibrate(opts: Options, mpi_args: list[str]) -> int:
    """Check the options, run the phases, write the file or the drift report: exit code."""
    from alpac.errors import UserError
    from alpac.runtime.launcher import find_mpiexec, parse_mpi_args
    from alpac.runtime.worker import resolve_platform
    try:
        n, extra = parse_mpi_args(mpi_args)
        recorded = _load_recorded(opts.check) if opts.check else None
        n, k = _topology(opts, n, recorded)
    except (ValueError, UserError) as e:
        return fail_usage(str(e))
    for path in (opts.output, opts.report):
        if path and not Path(path).resolve().parent.is_dir():
            return fail_usage(f"{path}: its directory does not exist")
    mpiexec = opts.mpiexec or find_mpiexec()
    if not mpiexec or not Path(mpiexec).exists() and not shutil.which(mpiexec):
        return fail_usage("no mpiexec found (install the mpich package or pass --mpiexec)")
    samples = sample(recorded["calibration"], n, k) if recorded else None
    gpu = resolve_platform(opts.platform) == "gpu"
    points = [p for s in samples for p in s.points] if samples else grid(n, k, opts.quick, gpu)
    work = Path(tempfile.mkdtemp(prefix="alpac-calibrate-"))
    try:
        start = time.time()
        (work / "points.json").write_text(json.dumps(
            {"options": asdict(opts), "k": k, "points": [asdict(p) for p in points]}))
        phases = ["local"] + (["inter"] if any(p.phase == "inter" for p in points) else [])
        for phase in phases:
            code = _run_phase_once_more(mpiexec, n, extra, phase, work, opts.debug)
            if code:
                return code
        by_index = {}
        for phase in phases:
            by_index.update({int(i): s for i, s in
                             json.loads((work / f"{phase}.json").read_text())["seconds"].items()})
        seconds = [by_index[i] for i in range(len(points))]
        if samples:
            return report_drift(samples, seconds, opts.tolerance, opts.report)
        info = json.loads((work / "local.json").read_text())["info"]
        return write_calibrated(opts, n, k, points, seconds, info, time.time() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load_recorded(path: str) -> dict:
    """A calibrated cluster file, checked by the cluster reader (UserError if it is bad)."""
    from alpac.errors import UserError
    from alpac.plan.cluster import load_cluster, read_cluster_file
    load_cluster(path)
    data, _ = read_cluster_file(path)
    if "calibration" not in data:
        raise UserError("no calibration section to check (write one with alpac calibrate -o)",
                        path=path)
    return data


def _topology(opts: Options, n: int | None, recorded: dict | None) -> tuple[int, int]:
    """(ranks, devices per rank): as given, else the recorded file's, else 1 and 1."""
    if recorded is None:
        return n or 1, opts.devices_per_rank or 1
    nodes, per = recorded["nodes"], recorded["devices_per_node"]
    got = (n or nodes, opts.devices_per_rank or per)
    if got != (nodes, per):
        raise ValueError(f"{opts.check} was measured with {nodes} ranks x {per} devices, not "
                         f"{got[0]} x {got[1]}: check it with the same -- np and "
                         f"--devices-per-rank")
    return got


def _run_phase_once_more(mpiexec: str, n: int, extra: list[str], phase: str, work: Path,
                         debug: bool) -> int:
    """`_run_phase`, and once more where gloo's transport failed under it (a rank's socket
    write between processes, "Gloo ReduceScatter failed: ... writev ...: Bad address", about
    one 4-rank calibration in 20 here; the next ran through): the exit code."""
    def attempt() -> int:
        (work / TRANSPORT_FAILED).unlink(missing_ok=True)
        with _ProgressView(work / PROGRESS, phase):
            return _run_phase(mpiexec, n, extra, phase, work, debug)
    code = attempt()
    if code == EXIT_RUNTIME and (work / TRANSPORT_FAILED).exists():
        print("alpac: gloo's connection between the ranks failed (above); measuring the "
              f"{phase} phase once more", file=sys.stderr)
        code = attempt()
    return code


def _run_phase(mpiexec: str, n: int, extra: list[str], phase: str, work: Path,
               debug: bool) -> int:
    from alpac.runtime.launcher import run_ranks
    if debug:
        os.environ["ALPAC_RUN_DEBUG"] = "1"
    return run_ranks(mpiexec, n, extra, ["alpac.runtime.calibrate", "--worker", phase,
                                         str(work)], debug, prog="alpac")


class _ProgressView:
    """A progress bar (stderr) fed by the file rank 0 rewrites after each point."""

    TITLES = {"local": "on each rank", "inter": "collectives, as multi-rank runs do them"}

    def __init__(self, path: Path, phase: str):
        self.path, self.phase = path, phase
        self._stop = threading.Event()

    def __enter__(self):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=True)
        self.task = self.progress.add_task(f"{self.TITLES[self.phase]}: starting the ranks",
                                           total=None)
        self.progress.start()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.wait(0.2):
            try:
                state = json.loads(self.path.read_text())
            except (OSError, ValueError):
                continue
            if state.get("phase") == self.phase:
                self.progress.update(self.task, completed=state["done"], total=state["total"],
                                     description=f"{self.TITLES[self.phase]}: {state['what']}")

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self.progress.stop()


# ---- one rank ------------------------------------------------------------------------------

def worker(phase: str, work: Path) -> int:
    """One rank of one phase (under mpiexec): measure its points, gather them to rank 0."""
    spec = json.loads((work / "points.json").read_text())
    opts = Options(**spec["options"])
    from alpac.runtime.comm import Comm, describe, fail
    from alpac.runtime.worker import configure_devices
    comm = Comm(opts.timeout)
    status = os.environ.get(STATUS_ENV)
    if status:  # lets the launcher name a rank that dies without a word
        (Path(status) / f"pid.rank{comm.rank}").write_text(str(os.getpid()))
    try:
        points = [Point(tuple(p["table"]), p["size"], tuple(p["shape"]), p["phase"])
                  for p in spec["points"]]
        platform = configure_devices(spec["k"], opts.platform)  # before jax is imported
        _injected_gloo_failure(comm.rank, phase, work)
        _measure(comm, phase, work, points, spec["k"], platform, opts.timeout)
        if status:
            (Path(status) / f"done.rank{comm.rank}").write_text("0")
    except BaseException as e:  # noqa: BLE001 - a rank must never leave the others waiting
        if GLOO_FAILED.search(str(e)):  # the transport, not the work: worth a second run
            (work / TRANSPORT_FAILED).write_text(str(e))
        fail(comm.rank, *describe(e))
    return 0


def _injected_gloo_failure(rank: int, phase: str, work: Path) -> None:
    """Fault injection for the tests: ALPAC_TEST_GLOO_FAIL_RANK=r makes rank r fail the
    multi-rank phase as gloo's transport does, its first ALPAC_TEST_GLOO_FAIL_TIMES runs."""
    chosen = os.environ.get("ALPAC_TEST_GLOO_FAIL_RANK")
    if phase != "inter" or chosen is None or int(chosen) != rank:
        return
    failed = len(list(work.glob("injected.*")))
    if failed < int(os.environ.get("ALPAC_TEST_GLOO_FAIL_TIMES", "1")):
        (work / f"injected.{failed}").write_text("")
        raise RuntimeError("Gloo AllReduce failed: writev: Bad address (injected, "
                           "ALPAC_TEST_GLOO_FAIL_RANK)")


def _measure(comm, phase: str, work: Path, points: list[Point], k: int, platform: str,
             timeout: float) -> None:
    from alpac.runtime.probes import Rank
    from alpac.runtime.worker import Options as RunOptions
    from alpac.runtime.worker import _init_jax
    jax = _init_jax(comm, RunOptions("", devices_per_rank=k, timeout=timeout), platform,
                    phase == "inter")
    rank = Rank(comm, jax, k, distributed=phase == "inter")
    info = _device_info(comm, rank, platform) if phase == "local" else None
    mine = [(i, p) for i, p in enumerate(points) if p.phase == phase]
    seconds = []
    for done, (i, p) in enumerate(mine):
        comm.barrier(f"the other ranks to measure {p.describe()}")
        if comm.rank == 0:
            write_json(work / PROGRESS, {"phase": phase, "done": done, "total": len(mine),
                                          "what": p.describe()})
        seconds.append(rank.measure(p))
    per_rank = comm.gather_obj(seconds, TAG_GATHER, "the measurements")
    if comm.rank == 0:  # the median over the ranks that took part
        medians = {i: statistics.median(s[j] for s in per_rank if s[j] is not None)
                   for j, (i, _) in enumerate(mine)}
        write_json(work / f"{phase}.json", {"seconds": medians, "info": info})
    comm.barrier("the other ranks to finish")
    if phase == "inter":
        jax.distributed.shutdown()


def _device_info(comm, rank, platform: str) -> dict | None:
    """Rank 0: the device's name and memory (on CPU, as the default cluster divides it: this
    host's memory over the devices of the ranks on it), the host for the file's header, and
    how many ranks share its host on how many cores (the union of their affinities)."""
    from alpac.runtime.worker import rank_placement
    placement = rank_placement(comm)
    if comm.rank != 0:
        return None
    host = placement[0][0]
    mine = [cores for name, cores in placement if name == host]
    device = rank.local[0]
    if platform == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // \
            (rank.k * len(mine))
    else:
        memory = (device.memory_stats() or {}).get("bytes_limit", 0)
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo()
                  if line.startswith("model name")), "unknown CPU")
    return {"platform": platform, "name": device.device_kind, "memory": int(memory),
            "host": host, "cpu": f"{model}, {os.cpu_count()} cores",
            "ranks_per_host": len(mine), "host_cores": len(set().union(*map(set, mine)))}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


# ---- the calibrated file -------------------------------------------------------------------

def tables(points: list[Point], seconds: list[float]) -> dict:
    """The `calibration:` tables: per table, [size, seconds] rows in ascending size, no row
    costing more than a larger one (`_ascending`)."""
    rows: dict[tuple, dict[int, list[float]]] = {}
    for p, s in zip(points, seconds):
        rows.setdefault(p.table, {}).setdefault(p.size, []).append(s)
    out: dict = {}
    for table, by_size in rows.items():
        node = out
        for key in table[:-1]:
            node = node.setdefault(key, {})
        leaf = int(table[-1]) if table[0] == "collectives" else table[-1]
        node[leaf] = _ascending([(size, by_size[size]) for size in sorted(by_size)])
    for name in SCALARS:
        if name in out:
            out[name] = out[name][0][1]
    return out


def _ascending(rows: list[tuple[int, list[float]]]) -> list[list]:
    """[size, seconds] rows that never fall as the size grows, closest to the timings in
    absolute error: neighbouring rows out of order are pooled and each takes the median of
    the pool (isotonic median regression; a row of several timings, a dot level's shapes,
    starts as its own pool). On a shared machine a timing is now and then off either way
    (gloo waiting a scheduler tick, another job's burst; or one fast run of a larger size):
    the median discards one such timing, where clamping each row to the next larger one
    carried a single fast outlier down to every smaller size."""
    pools: list[tuple[int, list[float]]] = []  # (rows pooled, their timings)
    for _, timings in rows:
        pools.append((1, list(timings)))
        while len(pools) > 1 and statistics.median(pools[-2][1]) > \
                statistics.median(pools[-1][1]):
            (n, later), (m, earlier) = pools.pop(), pools.pop()
            pools.append((m + n, earlier + later))
    values = [statistics.median(timings) for n, timings in pools for _ in range(n)]
    return [[size, value] for (size, _), value in zip(rows, values)]


def fit_link(rows: list[list[float]]) -> dict[str, float]:
    """Latency and bandwidth of a send table: the smallest send's time, and the slope
    between the smallest and the largest."""
    (s0, t0), (s1, t1) = rows[0], rows[-1]
    bandwidth = (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else s1 / t1
    return {"bandwidth": bandwidth, "latency": t0}


def cluster_dict(opts: Options, n: int, k: int, points: list[Point], seconds: list[float],
                 info: dict) -> dict:
    """The cluster.yaml contents: summary figures from the tables, then the tables."""
    cal = tables(points, seconds)
    # the best dot row (a level's median shape: one shape's timing alone is noisier)
    flops = {t: max(size / s for size, s in rows) for t, rows in cal["dot"].items()}
    largest = cal["elementwise"][-1]
    fits = {link: fit_link(rows) for link, rows in cal.get("send", {}).items()}
    # one device per rank has no intra-node link to measure (nor uses one): the inter-node
    # figures stand in; one rank of one device has no link at all: its memory does
    links = {"intra_node": fits.get("intra_node", fits.get("inter_node")) or
             {"bandwidth": largest[0] / largest[1], "latency": cal["launch_s"]},
             **({"inter_node": fits["inter_node"]} if "inter_node" in fits else {})}
    when = time.strftime("%Y-%m-%d", time.gmtime())
    cal = {"source": f"alpac calibrate{' --quick' if opts.quick else ''}, {n} ranks x {k} "
                     f"devices, {info['platform']}, {info['host']}, {when}", **cal,
           **{name: info[name] for name in HOST_COUNTS if info.get(name)}}
    return {"name": opts.name or f"local-{info['platform']}-calibrated", "nodes": n,
            "devices_per_node": k,
            "device": {"name": info["name"], "memory": info["memory"], "flops": flops,
                       "memory_bandwidth": largest[0] / largest[1]},
            "links": links, "calibration": cal}


def render_yaml(data: dict, indent: int = 0) -> list[str]:
    """YAML lines, one table row per line (`[size, seconds]`); floats keep a decimal point
    (YAML 1.1 reads 1e-05 as a string)."""
    pad = " " * indent
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines += [f"{pad}{key}:", *render_yaml(value, indent + 2)]
        elif isinstance(value, list):
            lines += [f"{pad}{key}:"] + [f"{pad}  - [{size}, {sec:.4e}]" for size, sec in value]
        elif isinstance(value, str):
            lines.append(f"{pad}{key}: {json.dumps(value)}")
        else:
            lines.append(f"{pad}{key}: {value if isinstance(value, int) else f'{value:.4e}'}")
    return lines


def write_calibrated(opts: Options, n: int, k: int, points: list[Point], seconds: list[float],
                     info: dict, took: float) -> int:
    from rich.console import Console
    data = cluster_dict(opts, n, k, points, seconds, info)
    header = [
        f"# Measured by `alpac calibrate{' --quick' if opts.quick else ''} --devices-per-rank "
        f"{k} -o {Path(opts.output).name} -- np {n}` in {took:.0f} s",
        f"# on {info['host']} ({info['cpu']}), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "# Units: seconds, bytes, FLOPs. calibration: tables of [size, seconds] rows, each the",
        "# median of repeated timings, no row above a larger one (README, `alpac calibrate`).",
        "# device.flops: the best dot row per type; memory_bandwidth: the largest elementwise",
        "# chain; links: latency and bandwidth fitted to the send tables. concurrency: rows of",
        "# [devices working at once, seconds of one device's dot]; alone: the f32 dot,",
        "# elementwise and reduce tables on one device, every other idle. ranks_per_host,",
        "# host_cores: the ranks that ran on each host and the cores they shared.",
    ]
    out = Path(opts.output)
    write_replacing(out, "\n".join(header + render_yaml(data)) + "\n", "cluster file")
    dev, cal = data["device"], data["calibration"]
    Console(highlight=False).print(
        f"calibrated cluster written to {out} ({n} ranks x {k} devices, {took:.0f} s): dot "
        + ", ".join(f"{t} {f / 1e9:.3g} GFLOP/s" for t, f in dev["flops"].items())
        + f", elementwise {dev['memory_bandwidth'] / 1e9:.3g} GB/s, launch "
        f"{cal['launch_s'] * 1e6:.3g} µs" + _alone(cal), soft_wrap=True)
    return 0


def _alone(cal: dict) -> str:
    """How much faster one device works alone than with every device at once."""
    rows = cal.get("concurrency")
    if not rows or len(rows) < 2:
        return ""
    return f"; a device alone {rows[-1][1] / rows[0][1]:.2g}x as fast as with all {rows[-1][0]}"


# ---- --check -------------------------------------------------------------------------------

@dataclass
class Sample:
    """A recorded row and the points that measure it again."""
    table: tuple[str, ...]
    size: float
    seconds: float
    points: list[Point]


def _flat(cal: dict) -> list[tuple[tuple[str, ...], list]]:
    """(key path, rows) of every table of a calibration section."""
    out = [((name,), [[1, cal[name]]]) for name in SCALARS if name in cal]
    out += [(("dot", str(t)), rows) for t, rows in cal.get("dot", {}).items()]
    out += [((name,), cal[name]) for name in ("elementwise", "reduce") if name in cal]
    out += [(("collectives", link, kind, str(g)), rows)
            for link, kinds in cal.get("collectives", {}).items()
            for kind, groups in kinds.items() for g, rows in groups.items()]
    out += [(("send", link), rows) for link, rows in cal.get("send", {}).items()]
    out += [(("concurrency",), cal["concurrency"])] if "concurrency" in cal else []
    out += [(("alone", name), rows) for name, rows in cal.get("alone", {}).items()]
    return out


def _remeasure(table: tuple[str, ...], size: float, n: int, k: int) -> list[Point]:
    """The points that measure a recorded row again (none where this launch cannot)."""
    kind = table[-1] if table[0] == "alone" else table[0]
    if kind in SCALARS:
        return [Point(table, 1)]
    if kind == "dot":
        side = dot_side(size)
        return [Point(table, 2 * side ** 3, shape) for shape in dot_shapes(side)]
    if kind in ("elementwise", "reduce"):
        unit = 8 if kind == "elementwise" else 4
        return [Point(table, max(unit, int(size) // unit * unit))]
    if kind == "concurrency":
        return [Point(table, int(size))] if size <= n * k else []
    if kind == "send":
        present = k > 1 if table[1] == "intra_node" else n > 1
        return [Point(table, max(4, int(size) // 4 * 4))] if present else []
    g = int(table[3])
    if table[1] == "intra_node":
        group = (1, g) if g <= k else None
    elif table[1] == "inter_node_shared":
        group = (g, k) if g <= n and k > 1 else None
    else:
        group = (g, 1) if g <= n else (n, k) if k > 1 and g == n * k else None
    return [Point(table, collective_bytes(size, g), group, collective_phase(n))] \
        if group else []


def sample(cal: dict, n: int, k: int) -> list[Sample]:
    """A few rows of each table (the smallest, a middle one, the largest under the check's
    size limits) and their points."""
    out = []
    for table, rows in _flat(cal):
        cap = CHECK_MAX_FLOPS if "dot" in table else CHECK_MAX_BYTES
        small = [r for r in rows if r[0] <= cap] or rows[:1]
        for i in sorted({0, len(small) // 2, len(small) - 1}):
            size, seconds = small[i]
            points = _remeasure(table, size, n, k)
            if points:
                out.append(Sample(table, size, seconds, points))
    return out


def report_drift(samples: list[Sample], seconds: list[float], tolerance: float,
                 report: str | None = None) -> int:
    """Per table, measured / recorded (the median over its sampled rows, each scaled to the
    recorded size), shown and, with `report`, written as JSON; exit 1 if one is off by more
    than the tolerance either way."""
    from rich.console import Console
    from rich.table import Table
    ratios: dict[tuple, list[float]] = {}
    it = iter(seconds)
    for s in samples:
        measured = statistics.median(next(it) * s.size / p.size for p in s.points)
        ratios.setdefault(s.table, []).append(measured / s.seconds)
    view = Table(title=f"calibration check: measured / recorded (tolerance {tolerance:.0%})",
                 show_edge=False)
    for col in ("table", "rows", "drift", "range", ""):
        view.add_column(col, justify="left" if col in ("table", "") else "right")
    drifts = {}
    for table, rs in ratios.items():
        drift = statistics.median(rs)
        drifts[".".join(table)] = {"rows": len(rs), "drift": drift, "min": min(rs),
                                   "max": max(rs), "within_tolerance":
                                   1 / (1 + tolerance) <= drift <= 1 + tolerance}
    for name, d in drifts.items():
        view.add_row(name, str(d["rows"]), f"{d['drift']:.2f}", f"{d['min']:.2f}-{d['max']:.2f}",
                     "ok" if d["within_tolerance"] else "[red]over")
    over = [f"{name} {d['drift']:.2f}x" for name, d in drifts.items() if not d["within_tolerance"]]
    Console(highlight=False).print(view)
    if report:
        write_replacing(report, json.dumps({"tolerance": tolerance, "tables": drifts}) + "\n",
                        "drift report")
    if over:
        print(f"alpac: check failed: {len(over)} of {len(ratios)} tables drifted by more than "
              f"{tolerance:.0%}: {', '.join(over[:6])}{', ...' if len(over) > 6 else ''}",
              file=sys.stderr)
        return EXIT_CHECK
    print(f"calibration check passed: {len(ratios)} tables within {tolerance:.0%}")
    return 0


if __name__ == "__main__":
    main()
