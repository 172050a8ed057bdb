"""What one elementwise kernel costs inside a module on this host, and how one-device modules
compare with their priced compute: the measurements behind the calibration's kernel rows.

Part 1: a module of 16 kernels (a chain of four elementwise ops each, on an f32 array of its
own), run through the XLA bridge as alpa-run runs a module, per kernel after taking off a
module that returns 16 arrays and runs nothing: once with each result in new memory (as
`alpac calibrate` times its `elementwise` rows), once with each result written in place of
its argument, donated (as a training step's parameters and optimizer state are).
Part 2: the one-device plan of each testdata training step, compiled on `--cluster`: the
stage's priced compute and launch against its module's measured execution (one device in
this process, every argument fed anew and donated, as alpa-run does).
`python bench_kernels.py` (from benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

from bench_fidelity import MODELS, compile_plan, strategies  # noqa: E402
from common import ROOT, write_results  # noqa: E402

KERNELS = 16


def _seconds(exe, fresh_args, donated: bool, reps: int) -> float:
    """Median seconds of one execution, waited for; `fresh_args()` makes the arguments."""
    from alpac.xla.bridge import execute_unchecked
    held, times = fresh_args(), []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = execute_unchecked(exe, held)
        for a in out:
            a.block_until_ready()
        times.append(time.perf_counter() - t0)
        held = out if donated else held
    return statistics.median(times[reps // 10:])


def _kernels_module(rows: int, in_place: bool, work: bool) -> str:
    array = f"f32[{rows},1024]"
    params = "".join(f"  p{i} = {array} parameter({i})\n" for i in range(KERNELS))
    consts = "".join(f"  {c} = f32[] constant({v})\n  {c}s = {array} broadcast({c}), "
                     "dimensions={}\n" for c, v in (("h", 0.5), ("q", 0.25), ("l", -1),
                                                     ("r", 1.5)))
    body = "".join(f"  m{i} = {array} multiply(p{i}, hs)\n  a{i} = {array} add(m{i}, qs)\n"
                   f"  x{i} = {array} maximum(a{i}, ls)\n  r{i} = {array} multiply(x{i}, rs)\n"
                   for i in range(KERNELS)) if work else ""
    alias = ", ".join(f"{{{i}}}: ({i}, {{}}, may-alias)" for i in range(KERNELS))
    header = f"HloModule k, input_output_alias={{ {alias} }}" if in_place or not work else \
        "HloModule k"
    results = ", ".join(f"{'r' if work else 'p'}{i}" for i in range(KERNELS))
    return (f"{header}\nENTRY e {{\n{params}{consts if work else ''}{body}  ROOT t = "
            f"({', '.join([array] * KERNELS)}) tuple({results})\n}}\n")


def per_kernel() -> list[dict]:
    import jax
    import numpy as np

    from alpac.xla.bridge import compile_hlo
    device = jax.devices()[0]
    rows = []
    for nbytes in (8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20):
        n = nbytes // 8 // 1024 or 1
        reps = 200 if nbytes <= 512 << 10 else 40

        def make():
            return [jax.device_put(np.full((n, 1024), i + 1, np.float32), device)
                    for i in range(KERNELS)]
        empty = _seconds(compile_hlo(_kernels_module(n, True, False), [device]), make, True,
                         reps)
        fresh = _seconds(compile_hlo(_kernels_module(n, False, True), [device]), make, False,
                         reps)
        placed = _seconds(compile_hlo(_kernels_module(n, True, True), [device]), make, True,
                          reps)
        rows.append({"bytes read + written": 8 * n * 1024,
                     "new memory µs": round((fresh - empty) / KERNELS * 1e6, 2),
                     "in place µs": round((placed - empty) / KERNELS * 1e6, 2),
                     "ratio": round((fresh - empty) / max(placed - empty, 1e-9), 2)})
    return rows


def fed_anew(exe, device):
    """`run()`: one execution of the one-device module with every argument fed anew (and
    donated), as alpa-run feeds a step; its seconds, waited for, the feeding left out."""
    import jax
    import numpy as np

    from alpac.xla.bridge import execute_unchecked
    host = [np.full(s, 0.01, d) if np.dtype(d).kind == "f" else np.zeros(s, d)
            for s, d in exe.parameter_types]

    def run() -> float:
        args = [jax.device_put(a, device) for a in host]
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        for o in execute_unchecked(exe, args):
            o.block_until_ready()
        return time.perf_counter() - t0
    return run


def one_device(cluster: Path, models: list[str]) -> list[dict]:
    import jax

    from alpac.xla.bridge import compile_hlo
    device = jax.devices()[0]
    rows = []
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            plan = Path(tmp) / "plan"
            compile_plan(model, strategies(1, 1)["one device"], cluster, plan)
            stage = json.loads((plan / "plan.json").read_text())["stages"][0]
            exe = compile_hlo((plan / stage["module"]).read_text(), [device])
        run = fed_anew(exe, device)
        measured = statistics.median([run() for _ in range(100)][10:])
        est = stage["estimate"]
        priced = est["compute_s"] + est["launch_s"]["per_step"]
        rows.append({"model": model, "priced compute + launch ms": round(priced * 1e3, 2),
                     "measured module ms": round(measured * 1e3, 2),
                     "measured / priced": round(measured / priced, 2)})
    return rows


def one_device_arguments(doc: str) -> argparse.Namespace:
    """`--cluster` (the 2-rank file of this machine) and `--models` of a one-device bench."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--cluster", type=Path, default=ROOT / "testdata" / "clusters" /
                        "local-cpu-calibrated-np2.yaml")
    parser.add_argument("--models", default=MODELS)
    return parser.parse_args()


def main() -> None:
    args = one_device_arguments(__doc__)
    kernels = per_kernel()
    write_results("kernels", "One elementwise kernel in a module: results in new memory or "
                  "in place", kernels, "16 kernels per module through the XLA bridge, one "
                  "device in the process, less a module returning 16 arrays without work; "
                  "medians. `python bench_kernels.py` (from benchmarks/).")
    modules = one_device(args.cluster, args.models.split(","))
    write_results("kernels_modules", "One-device modules: priced compute against the "
                  "module's execution", modules, f"Cluster file {args.cluster.name}; the "
                  "plan of `alpac compile --mesh 1`, its stage's compute and launch against "
                  "its module run through the XLA bridge with one device in the process, "
                  "arguments fed anew and donated (median of the last 90 of 100 executions). "
                  "`python bench_kernels.py` (from benchmarks/).")


if __name__ == "__main__":
    main()
