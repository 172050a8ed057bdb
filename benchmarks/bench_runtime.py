"""alpa-run's overhead: a one-stage plan on 4 devices run by `alpa-run` against the same
sharded module executed directly by jax (target: within 1.2x, medians of repeated runs).

Both sides run the same training loop: the batch inputs put on the devices every step, the
module executed, its aliased outputs fed back as the next step's inputs. The direct side is
the plan's stage0.hlo compiled with `alpac.xla.bridge.compile_hlo` and executed with
`execute_unchecked` (the call alpa-run makes) in a plain loop, in one process (1 rank x 4
devices) or, for the 2 x 2 row, in two processes started by mpiexec with jax.distributed and
gloo, as alpa-run does. The alpa-run side is `alpa-run PLAN --devices-per-rank K --iters N
-- np R`, timed by its own report. Per run: the median iteration time after WARMUP
iterations; per row: the median over REPEATS runs, alternating the two sides.

`python benchmarks/bench_runtime.py` writes benchmarks/results/runtime.{md,json}.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, write_results

ITERS = 40
WARMUP = 5
REPEATS = 5
MODELS = ("mlp_train", "gpt_train")
LAYOUTS = ((1, 4), (2, 2))  # (ranks, devices per rank)
BIN = Path(sys.executable).parent


def compile_plan(model: str, out: Path) -> Path:
    subprocess.run([str(BIN / "alpac"), "compile", str(ROOT / "testdata" / "models" /
                                                       f"{model}.hlo"), "--mesh", "4",
                    "-o", str(out)], check=True, capture_output=True)
    return out


def run_alpa(plan: Path, ranks: int, k: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([str(BIN / "alpa-run"), str(plan), "--devices-per-rank", str(k),
                        "--iters", str(ITERS), "--report", str(report), "--quiet",
                        "--", "np", str(ranks)], check=True, cwd=tmp)
        times = json.loads(report.read_text())["iteration_time_s"]
    return statistics.median(times[WARMUP:])


def run_direct(plan: Path, ranks: int, k: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "direct.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--direct", str(plan), str(k),
               str(out)]
        if ranks > 1:
            from alpac.runtime.launcher import find_mpiexec
            cmd = [find_mpiexec(), "-n", str(ranks)] + cmd
        subprocess.run(cmd, check=True, cwd=tmp, capture_output=True)
        return json.loads(out.read_text())["median_s"]


def direct(plan: Path, k: int, out: Path) -> None:
    """The module executed directly in a loop (run in its own process, or per rank)."""
    from alpac.runtime.worker import configure_devices
    configure_devices(k, "cpu")
    import numpy as np
    from alpac.runtime.comm import Comm
    from alpac.runtime.worker import Options, _init_jax
    comm = Comm(120)
    jax = _init_jax(comm, Options(str(plan), devices_per_rank=k), "cpu", comm.size > 1)
    from alpac.plan.program import Program
    from alpac.runtime.data import entry_parameters, random_input
    from alpac.xla.bridge import compile_hlo, execute_unchecked, global_devices, \
        jax_parameter_shardings
    data = json.loads((plan / "plan.json").read_text())
    program = Program.from_dict(data["program"])
    params = entry_parameters((plan / "source.hlo").read_text())
    host = [random_input(0, p) for p in params]
    exe = compile_hlo((plan / program.modules[0].file).read_text(), global_devices())
    shardings = jax_parameter_shardings(exe)

    def put(k):
        return jax.make_array_from_callback(host[k].shape, shardings[k],
                                            lambda i, a=host[k]: np.array(a[i], copy=True))

    aliased = {p: o[0] for o, p in program.aliases}
    args = [put(i) for i in range(len(host))]
    times = []
    for _ in range(ITERS):
        comm.barrier()
        t0 = time.perf_counter()
        for i in range(len(host)):
            if i not in aliased:
                args[i] = put(i)
        outs = execute_unchecked(exe, args)
        for o in outs:
            o.block_until_ready()
        for p, o in aliased.items():
            args[p] = outs[o]
        times.append(time.perf_counter() - t0)
    slowest = comm.gather_obj(times, (1 << 28) + 100, "times")
    if comm.rank == 0:
        per_iter = [max(t[i] for t in slowest) for i in range(ITERS)]
        out.write_text(json.dumps({"median_s": statistics.median(per_iter[WARMUP:])}))
    comm.barrier()
    if comm.size > 1:
        jax.distributed.shutdown()


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in MODELS:
            plan = compile_plan(model, Path(tmp) / model)
            for ranks, k in LAYOUTS:
                alpa, base = [], []
                for _ in range(REPEATS):
                    base.append(run_direct(plan, ranks, k))
                    alpa.append(run_alpa(plan, ranks, k))
                a, b = statistics.median(alpa), statistics.median(base)
                rows.append({
                    "model (1 stage, mesh 4)": model, "ranks x devices": f"{ranks} x {k}",
                    "direct jax ms": f"{b * 1e3:.2f}", "alpa-run ms": f"{a * 1e3:.2f}",
                    "ratio": f"{a / b:.3f}",
                    "within 1.2x": "yes" if a <= 1.2 * b else "NO",
                    "runs (alpa-run ms)": " ".join(f"{x * 1e3:.1f}" for x in alpa),
                    "runs (direct ms)": " ".join(f"{x * 1e3:.1f}" for x in base),
                })
                print(rows[-1], flush=True)
    write_results("runtime", "alpa-run overhead: one-stage plans on 4 CPU devices", rows,
                  f"Iteration time, median of iterations {WARMUP + 1}-{ITERS} per run, then "
                  f"median of {REPEATS} runs per side (sides alternated). The acceptance row "
                  f"is 1 x 4 (one process, as direct jax); 2 x 2 compares with the module "
                  f"executed directly in two processes over gloo.")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--direct":
        direct(Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    else:
        main()
