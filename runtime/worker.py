"""One rank of `alpa-run` (`alpa-run PLAN --worker`, started by mpiexec).

Rank r owns the global devices [r*k, (r+1)*k) (k = `--devices-per-rank`; plan device d is
jax device d of `jax.devices()` sorted by id). The rank loads the plan, checks it against the
launch, initializes multi-process jax (jax.distributed, with mpi4py cluster detection; gloo
collectives on CPU, NCCL on GPUs), compiles the modules of the meshes that hold its devices,
runs `--iters` steps (outputs fed back into their aliased inputs), gathers the statistics (and
the outputs, for `--save` / `--check`) to rank 0, which checks, saves and reports.

Errors: see `alpac.runtime.comm` (one message naming the rank, MPI_Abort, exit codes 1/2/3).
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alpac.plan.program import Program
    from alpac.runtime.timeline import Timeline

TAG_SETUP = (1 << 28) + 1
TAG_STATS = (1 << 28) + 2
TAG_OUTPUTS = (1 << 28) + 3
TAG_STATUS = (1 << 28) + 4
TAG_CLOCK = (1 << 28) + 5
CLOCK_PINGS = 8


@dataclass
class Options:
    plan: str
    inputs: str | None = None
    seed: int = 0
    iters: int = 1
    save: str | None = None
    check: bool = False
    rtol: float = 1e-5
    report: str | None = None
    schedule: str | None = None
    devices_per_rank: int = 1
    timeout: float = 300.0
    platform: str = "auto"
    quiet: bool = False
    allgather_min_bytes: int = 1 << 20
    trace: str | None = None


class SetupError(Exception):
    """An error every rank meets alike (bad plan, bad inputs): rank 0 alone reports it."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def main(opts: Options) -> int:
    from alpac.runtime.comm import Comm, describe, fail
    from alpac.runtime.status import STATUS_ENV
    comm = Comm(opts.timeout)
    status = os.environ.get(STATUS_ENV)
    if status:  # lets the launcher name a rank that dies without a word
        try:
            (Path(status) / f"pid.rank{comm.rank}").write_text(str(os.getpid()))
        except OSError:
            pass
    try:  # devices after the ranks can talk: a rank without a GPU is reported like any error
        platform = configure_devices(opts.devices_per_rank, opts.platform, host_cpu=opts.check)
        if platform == "cpu" and comm.size > 1:
            _one_core(comm.rank)
        code = _run(comm, opts, platform)
        if status:  # finished normally: its end is no failure
            (Path(status) / f"done.rank{comm.rank}").write_text(str(code))
    except SetupError as e:
        message, code, detail = describe(e.cause)
        if comm.rank != 0:
            time.sleep(min(10.0, opts.timeout))  # rank 0 reports it and ends every rank
        fail(comm.rank, message, code, detail)
    except BaseException as e:  # noqa: BLE001 - a rank must never leave the others waiting
        message, code, detail = describe(e)
        fail(comm.rank, message, code, detail)
    return code


def configure_devices(k: int, platform: str, host_cpu: bool = False) -> str:
    """Environment for jax before it is imported: k devices for this process; with
    `host_cpu`, on GPUs the host's CPU too (--check's rounding floor runs there)."""
    platform = resolve_platform(platform)
    if platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                       os.environ.get("XLA_FLAGS", "")).strip()
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={k}".strip()
    else:
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, _rank_gpus(k)))
        os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu" if host_cpu else "cuda")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return platform


def _one_core(rank: int) -> None:
    """Bind this rank to one of its cores, before jax makes its CPU client. XLA's CPU runtime
    starts a module's independent collectives in program order but runs them on its thread
    pool, so with more than one thread two of them (a pair of all-to-alls, say) can reach gloo
    in different orders on different ranks, which pairs the wrong messages ("Received data
    size doesn't match expected size") or corrupts them. With one core the pool has one thread
    and the collectives run in program order on every rank."""
    cores = sorted(os.sched_getaffinity(0))
    local = int(os.environ.get("MPI_LOCALRANKID", rank))
    os.sched_setaffinity(0, {cores[local % len(cores)]})


def _rank_gpus(k: int) -> list[int]:
    """The node's GPUs of this rank: the k after those of the ranks before it on the node."""
    from alpac.errors import UserError
    local = int(os.environ.get("MPI_LOCALRANKID", os.environ.get("PMI_RANK", "0")))
    present = len([f for f in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", f)])
    wanted = list(range(local * k, (local + 1) * k))
    if present and wanted[-1] >= present:
        raise UserError(f"this rank needs GPU {wanted[-1]} of its node, which has "
                        f"{present}: launch at most {present // k} rank(s) per node with "
                        f"--devices-per-rank {k}, or set CUDA_VISIBLE_DEVICES to share GPUs")
    return wanted


def resolve_platform(platform: str) -> str:
    """"auto" is "gpu" where jax's CUDA plugin and an NVIDIA driver are both present."""
    if platform == "auto":
        return "gpu" if _gpus_present() else "cpu"
    return platform


def _gpus_present() -> bool:
    from importlib.util import find_spec
    has_plugin = any(find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return has_plugin and os.path.exists("/dev/nvidiactl")


@dataclass
class _Setup:
    """What every rank reads and checks before jax starts (see `_setup`)."""
    plan_dir: Path
    program: Program
    tl: Timeline
    source_text: str | None
    params: list  # the program's parameters
    host_inputs: dict  # by program parameter
    layout: object  # data.Layout when the program's inputs are pieces of the source's
    source_params: list  # the source module's parameters (the program's, without a layout)
    source_inputs: dict  # by source parameter: what --check runs the source module on
    batch_size: int | None
    identity: dict  # the plan's source and program hashes, for the report


def _run(comm, opts: Options, platform: str) -> int:
    """Set up, run the steps, gather to rank 0 (which checks and reports): the exit code."""
    try:
        setup = _setup(comm, opts)
    except Exception as e:
        raise SetupError(e) from e

    k = opts.devices_per_rank
    # Multi-process jax only when a mesh spans ranks: otherwise every module runs inside one
    # process (XLA's in-process collectives, not gloo's TCP) and MPI moves the rest.
    distributed = comm.size > 1 and any(len({d // k for d in m.devices}) > 1
                                        for m in setup.program.meshes)
    jax = _init_jax(comm, opts, platform, distributed)
    from alpac.runtime.executor import Executor
    devices = _plan_devices(comm, jax, k, distributed)
    executor = Executor(setup.tl, setup.plan_dir, comm, devices, k, opts.timeout,
                        opts.allgather_min_bytes)
    comm.barrier("every rank to compile its modules")

    gather = opts.save is not None or opts.check
    placement = rank_placement(comm)
    clocks = _clock_offsets(comm, [host for host, _ in placement]) if opts.trace else None
    steps = _run_steps(comm, executor, opts, setup.host_inputs, collect=gather)
    pieces = _gather_outputs(comm, executor) if gather else None
    per_rank = comm.gather_obj(steps, TAG_STATS, "statistics")
    code = 0
    if comm.rank == 0:
        code = _conclude(comm, opts, jax, setup, pieces, per_rank, clocks, placement)
    code = comm.bcast_obj(code, TAG_STATUS, "the final status")
    comm.barrier("the other ranks to finish")
    sys.stdout.flush()
    if distributed:
        jax.distributed.shutdown()
    return code


def rank_placement(comm) -> list[tuple[str, list[int]]]:
    """On every rank, per rank: its host's name and the host's cores it may run on (all of
    them where the OS cannot say)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    return comm.bcast_obj(comm.gather_obj((socket.gethostname(), cores), TAG_CLOCK,
                                          "host names and cores"), TAG_CLOCK,
                          "the host names and cores")


def _plan_devices(comm, jax, k: int, distributed: bool) -> list:
    """Plan device d -> its jax device (in one-process jax, None for other ranks' devices)."""
    if distributed:
        from alpac.xla.bridge import global_devices
        devices = global_devices()
        if len(devices) != comm.size * k:
            raise RuntimeError(f"jax sees {len(devices)} devices, expected {comm.size} x {k}")
        for d, dev in enumerate(devices):
            if dev.process_index != d // k:
                raise RuntimeError(f"device {d} belongs to process {dev.process_index}, "
                                   f"expected {d // k}")
        return devices
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    if len(local) != k:
        raise RuntimeError(f"jax sees {len(local)} devices in this process, expected {k}")
    return [local[d - comm.rank * k] if d // k == comm.rank else None
            for d in range(comm.size * k)]


def _run_steps(comm, executor, opts: Options, host_inputs: dict, collect: bool) -> list:
    """`--iters` timed steps, outputs carried into their aliased inputs between steps; the
    last step collects its outputs when `collect`."""
    carried: dict = {}
    steps = []
    for it in range(opts.iters):
        comm.barrier(f"the other ranks to start iteration {it}")
        own0, cpu0, t0 = comm.own_cpu(), time.process_time(), time.perf_counter()
        stats = executor.run_step(host_inputs, carried, collect=collect and it == opts.iters - 1)
        if it < opts.iters - 1:
            carried, stats.carry_bytes = executor.carry()
        stats.seconds = time.perf_counter() - t0  # the step and moving its carried outputs
        stats.cpu_seconds = time.process_time() - cpu0
        stats.own_cpu_seconds = comm.own_cpu() - own0
        steps.append(stats)
    return steps


def _clock_offsets(comm, hosts: list[str]) -> list[float] | None:
    """On rank 0, per rank: what to add to its perf_counter to read rank 0's (None on the
    others), so that the trace puts every rank's events on one time axis. The ranks of one
    host (`hosts`: per rank) share its monotonic clock (0); another host's offset is estimated
    from ping-pongs with rank 0, the one with the shortest round trip (wrong by at most half
    of it)."""
    offsets = [0.0] * comm.size
    for r in (r for r in range(1, comm.size) if hosts[r] != hosts[0]):
        if comm.rank == 0:
            best = (math.inf, 0.0)
            for _ in range(CLOCK_PINGS):
                sent = time.perf_counter()
                comm.send_obj(None, r, TAG_CLOCK)
                theirs = comm.recv_obj(r, TAG_CLOCK, "a clock reading")
                back = time.perf_counter()
                best = min(best, (back - sent, (sent + back) / 2 - theirs))
            offsets[r] = best[1]
        elif comm.rank == r:
            for _ in range(CLOCK_PINGS):
                comm.recv_obj(0, TAG_CLOCK, "a clock reading")
                comm.send_obj(time.perf_counter(), 0, TAG_CLOCK)
    comm.flush("rank 0 to take the clock readings")
    return offsets if comm.rank == 0 else None


def _gather_outputs(comm, executor) -> list | None:
    """Every rank's host pieces of the last step's outputs, on rank 0 (None elsewhere)."""
    from alpac.runtime.executor import host_pieces
    mine = list(executor.host_out)
    for pos, array in executor.step_outputs().items():
        mine += host_pieces(array, pos, None)
    return comm.gather_obj(mine, TAG_OUTPUTS, "outputs")


def _conclude(comm, opts: Options, jax, setup: _Setup, pieces, per_rank,
              clocks: list[float] | None, placement: list[tuple[str, list[int]]]) -> int:
    """Rank 0: assemble, save and check the outputs, then report; EXIT_CHECK if the check
    failed, else 0."""
    from alpac.runtime import report as rep
    from alpac.runtime.comm import EXIT_CHECK
    from alpac.runtime.data import assemble, save
    outputs = None
    if pieces is not None:
        outputs = assemble([p for part in pieces for p in part], setup.tl.outputs,
                           setup.program.num_micro_batches)
        if setup.layout is not None:
            outputs = setup.layout.join(outputs)
    if opts.save is not None:
        save(Path(opts.save), outputs)
    check = _check(opts, jax, setup, outputs) if opts.check else None
    report = rep.build(plan_dir=str(opts.plan), identity=setup.identity, timeline=setup.tl,
                       ranks=comm.size, devices_per_rank=opts.devices_per_rank,
                       per_rank=per_rank, placement=placement, batch_size=setup.batch_size,
                       check=check)
    if opts.report:
        rep.write(report, Path(opts.report))
    if opts.trace:
        from alpac.plan.trace import write_trace
        from alpac.runtime.trace import measured_trace
        write_trace(measured_trace(str(opts.plan), setup.tl, per_rank, clocks),
                    Path(opts.trace))
    if not opts.quiet:
        rep.render(report, _console())
        if opts.trace:
            print(f"timeline written to {opts.trace} (open it in ui.perfetto.dev or "
                  f"chrome://tracing)")
    if check is None or check["passed"]:
        return 0
    _say_check_failed(check, opts.rtol)
    return EXIT_CHECK


def _check(opts: Options, jax, setup: _Setup, outputs: list) -> dict:
    """The outputs against the original module run `--iters` times on one local device.
    Where that device is an accelerator and the error is over `rtol`, the module also runs
    on the host's CPU: what two correct executions of one program differ by (f32 dots run as
    TF32 on NVIDIA GPUs) is the rounding floor, and an error within it passes."""
    from alpac.runtime.data import reference, relative_errors
    args = [setup.source_inputs[p.number] for p in setup.source_params]
    positions = {tuple(s.spec.index): s.position for s in setup.tl.outputs}
    aliases = [(positions[tuple(o)], p) for o, p in setup.program.aliases
               if tuple(o) in positions] if setup.layout is None else setup.layout.aliases
    device = jax.local_devices()[0]
    refs = reference(setup.source_text, args, aliases, opts.iters, device)
    if len(refs) != len(outputs):
        raise RuntimeError(f"the original module has {len(refs)} outputs, the "
                           f"program {len(outputs)}")
    errs = relative_errors(outputs, refs)
    overall = max(errs, default=0.0)
    floor = None
    if device.platform != "cpu" and overall > opts.rtol:
        host = reference(setup.source_text, args, aliases, opts.iters, jax.devices("cpu")[0])
        floor = {"devices": f"{device.platform}:{device.id} and cpu:0",
                 "max_rel_error": max(relative_errors(host, refs), default=0.0)}
    tolerance = max(opts.rtol, floor["max_rel_error"] if floor else 0.0)
    return {"rtol": opts.rtol, "rounding_floor": floor,
            "max_rel_error": {**{f"out{k}": e for k, e in enumerate(errs)},
                              "overall": overall},
            "passed": bool(overall <= tolerance)}


def _say_check_failed(check: dict, rtol: float) -> None:
    worst = max((kv for kv in check["max_rel_error"].items() if kv[0] != "overall"),
                key=lambda kv: kv[1])
    floor = check.get("rounding_floor")
    sys.stdout.flush()
    sys.stderr.write(f"alpa-run: check failed: max relative error "
                     f"{check['max_rel_error']['overall']:.3g} (at {worst[0]}) is over "
                     f"rtol {rtol:g}" + (f" and the rounding floor {floor['max_rel_error']:.3g}"
                                         if floor else "") + "\n")
    sys.stderr.flush()


def _setup(comm, opts: Options) -> _Setup:
    from alpac.errors import UserError
    from alpac.plan.io import SOURCE_FILE, plan_identity, read_plan_text
    from alpac.plan.program import load_program
    from alpac.runtime.data import Layout, entry_parameters, load_inputs, program_parameters
    from alpac.runtime.timeline import build

    plan_dir = Path(opts.plan)
    plan, stats, program, where = load_program(plan_dir)
    tl = build(program, opts.schedule, where)
    needed_devices = max(d for m in program.meshes for d in m.devices) + 1
    launched = comm.size * opts.devices_per_rank
    if needed_devices != launched:
        raise UserError(f"the plan runs on {needed_devices} devices, but {comm.size} ranks x "
                        f"{opts.devices_per_rank} devices per rank = {launched} were launched",
                        path=where)
    source_path = plan_dir / SOURCE_FILE  # load_program checked every file the plan names
    source_text = (read_plan_text(plan_dir, SOURCE_FILE, "source module")
                   if os.path.lexists(source_path) else None)
    if opts.check and source_text is None:
        raise UserError("--check needs the original module source.hlo in the plan",
                        path=str(plan_dir))
    source = entry_parameters(source_text, str(source_path)) if source_text else None
    layout = Layout.of(program)
    if layout is not None and source is None:
        raise UserError("the plan's layer loops were unrolled, and its inputs are pieces of "
                        "source.hlo's parameters: source.hlo is missing", path=str(plan_dir))
    params = layout.program_parameters(source) if layout else program_parameters(program, source)
    by_number = {p.number: p for p in params}
    for i in program.inputs:
        p = by_number.get(i.parameter)
        v = program.values[i.value]
        shape = list(v.shape)
        if i.batch_dim is not None:
            shape[i.batch_dim] *= program.num_micro_batches
        if p is None or (p.shape != shape and i.value != program.microbatch_index):
            raise UserError(f"input {i.value} is parameter {i.parameter} of shape {shape}, but "
                            f"the original module's parameter is "
                            f"{p.shape if p else 'missing'}", path=where)
    needed = {i.parameter for i in program.inputs}
    source_params = source if layout else params
    wanted = layout.sources(needed) if layout else set(needed)
    if opts.check and comm.rank == 0:
        wanted |= {p.number for p in source_params}
    source_inputs = load_inputs(Path(opts.inputs) if opts.inputs else None, opts.seed,
                                source_params, wanted)
    host_inputs = layout.cut(source_inputs, needed) if layout else source_inputs
    batch_size = next((program.values[i.value].shape[i.batch_dim] * program.num_micro_batches
                       for i in program.inputs if i.batch_dim is not None), None)
    if batch_size is None:
        batch_size = (stats.get("batch") or {}).get("size")
    return _Setup(plan_dir, program, tl, source_text, params, host_inputs, layout,
                  source_params, source_inputs, batch_size, plan_identity(plan))


def _init_jax(comm, opts: Options, platform: str, distributed: bool):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import jax
    if distributed and platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if distributed:
        host = socket.gethostname()
        hosts = comm.gather_obj(host, TAG_SETUP, "host names")
        address = None
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            address = f"{'127.0.0.1' if len(set(hosts)) == 1 else host}:{port}"
        address = comm.bcast_obj(address, TAG_SETUP, "the coordinator address")
        timeout = max(int(opts.timeout), 10)
        jax.distributed.initialize(coordinator_address=address,
                                   cluster_detection_method="mpi4py",
                                   local_device_ids=list(range(opts.devices_per_rank)),
                                   initialization_timeout=timeout,
                                   shutdown_timeout_seconds=timeout)
    return jax


def _console():
    from rich.console import Console
    width = os.environ.get("ALPAC_RUN_WIDTH")
    color = os.environ.get("ALPAC_RUN_COLOR")
    kwargs = {"highlight": False}
    if width:
        kwargs["width"] = int(width)
    if color is not None:
        kwargs["force_terminal"] = color == "1"
        kwargs["no_color"] = color != "1"
    return Console(**kwargs)
