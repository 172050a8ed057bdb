"""Where a one-device module's priced compute goes wrong, kernel by kernel: the kernels XLA
runs (timed by jax's profiler, one device in this process) against the kernels alpac prices
(the plan's ILP, each instruction at its chosen strategy), by class: dots, elementwise
kernels (loop fusions, copies, transposes), reductions. Also the module's wall time against
the sum of its kernels (XLA's per-kernel dispatch, and kernels it runs side by side).
`python bench_kernel_profile.py` (from benchmarks/).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

from bench_kernels import fed_anew, one_device_arguments  # noqa: E402
from common import ROOT, write_results  # noqa: E402

CLASSES = ("dot", "elementwise", "reduce")
ROUNDS = 30  # profiled executions


def priced_kernels(model: str, cluster: Path, out: Path) -> dict[str, list[float]]:
    """class -> the priced seconds of each kernel of the one-device plan (a dot, or the
    instructions of one fused kernel summed), as its ILP priced them."""
    from alpac.driver import build_pipeline, compile_model
    from alpac.hlo.opcodes import CONTRACTIONS
    from alpac.interop.stage import ShardedStages
    from alpac.intraop.builder import strategy_seconds
    from alpac.plan.cluster import load_cluster
    pipeline = build_pipeline(None, (), {"stage-construction": {"mesh": "1"}})
    ctx, _ = compile_model(ROOT / "testdata" / "models" / f"{model}.hlo",
                           load_cluster(cluster), pipeline, out)
    result = ctx.get(ShardedStages).stages[0].sharding
    sg, choice = result.graph, result.solution.choice
    kernels: dict[tuple[str, str], float] = defaultdict(float)
    for instr, plan in sg.plans.items():
        if not plan.strategies:
            continue
        seconds = plan.multiplier * strategy_seconds(sg, instr, plan.strategy(choice))
        share = sg.kernel_share(instr)
        if instr.opcode in CONTRACTIONS:
            kernels["dot", instr.name] += seconds
        elif share is not None and seconds:
            kernels[share.kind, share.root.name] += seconds
    by_class: dict[str, list[float]] = {c: [] for c in CLASSES}
    for (kind, _), seconds in kernels.items():
        by_class[kind].append(seconds)
    return by_class


def kernel_classes(compiled: str) -> dict[str, str]:
    """Each kernel of the compiled module's entry -> its class, by what it computes."""
    bodies = dict(re.findall(r"\n%(\S+) \([^\n]*\{\n(.*?)\n\}", compiled, re.S))
    entry = compiled[compiled.index("\nENTRY"):]
    out = {}
    for name, opcode, rest in re.findall(r"\n\s*(?:ROOT )?%(\S+) = .*? ([a-z-]+)\((.*)", entry):
        if opcode in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
            continue
        called = re.search(r"calls=%(\S+?)[,\s]", rest)
        body = bodies.get(called.group(1), "") if called else ""
        text = f" {opcode}(" + body
        out[name] = "dot" if re.search(r" (dot|convolution)\(", text) else \
            "reduce" if re.search(r" reduce(-window)?\(", text) else "elementwise"
    return out


def measured_kernels(module: str) -> tuple[dict[str, list[float]], float]:
    """class -> the median seconds of each kernel of the module (jax's profiler over
    ROUNDS executions, arguments fed anew and donated as alpa-run feeds them); and the
    module's median wall seconds without the profiler."""
    import jax

    from alpac.xla.bridge import compile_hlo
    device = jax.devices()[0]
    exe = compile_hlo(module, [device])
    classes = kernel_classes(exe.compiled_text())
    run = fed_anew(exe, device)
    wall = statistics.median([run() for _ in range(3 * ROUNDS)][ROUNDS:])
    with tempfile.TemporaryDirectory() as trace:
        jax.profiler.start_trace(trace, create_perfetto_trace=True)
        for _ in range(ROUNDS):
            run()
        jax.profiler.stop_trace()
        events = json.load(gzip.open(next(Path(trace).rglob("*.trace.json.gz"))))
    times: dict[str, list[float]] = defaultdict(list)
    for e in events["traceEvents"]:
        if e.get("ph") == "X" and e.get("name") in classes:
            times[e["name"]].append(e["dur"] * 1e-6)
    by_class: dict[str, list[float]] = {c: [] for c in CLASSES}
    for name, seconds in times.items():
        by_class[classes[name]].append(statistics.median(seconds))
    return by_class, wall


def rows_of(model: str, cluster: Path) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        priced = priced_kernels(model, cluster, Path(tmp) / "plan")
        plan = json.loads((Path(tmp) / "plan" / "plan.json").read_text())
        measured, wall = measured_kernels((Path(tmp) / "plan" / "stage0.hlo").read_text())
    rows = []
    for c in CLASSES:
        p, m = sum(priced[c]), sum(measured[c])
        rows.append({"model": model, "class": c,
                     "kernels priced / run": f"{len(priced[c])} / {len(measured[c])}",
                     "priced ms": round(p * 1e3, 3), "measured ms": round(m * 1e3, 3),
                     "measured / priced": round(m / p, 2) if p else "-",
                     "priced µs per kernel": round(p / max(len(priced[c]), 1) * 1e6, 1),
                     "measured µs per kernel": round(m / max(len(measured[c]), 1) * 1e6, 1)})
    stage = plan["stages"][0]["estimate"]
    total = sum(sum(v) for v in measured.values())
    rows.append({"model": model, "class": "module",
                 "kernels priced / run": f"{sum(map(len, priced.values()))} / "
                                         f"{sum(map(len, measured.values()))}",
                 "priced ms": round((stage["compute_s"] + stage["launch_s"]["per_step"]) * 1e3,
                                    3),
                 "measured ms": round(wall * 1e3, 3),
                 "measured / priced": round(wall / (stage["compute_s"] +
                                                    stage["launch_s"]["per_step"]), 2),
                 "priced µs per kernel": "-",
                 "measured µs per kernel": f"wall - kernels: {(wall - total) * 1e3:.3f} ms"})
    return rows


def main() -> None:
    args = one_device_arguments(__doc__)
    rows = [r for m in args.models.split(",") for r in rows_of(m, args.cluster)]
    write_results("kernel_profile", "One-device modules kernel by kernel: priced against "
                  "the profiler", rows, f"Cluster file {args.cluster.name} (the one-device "
                  "plan prices with its tables of one device alone); kernels XLA ran, timed "
                  f"by jax's profiler (median of {ROUNDS} executions each), classed by what "
                  "they compute; `module`: the plan's compute and launch against the "
                  "module's wall time, and that time less the sum of its kernels (XLA's "
                  "dispatch of each, less kernels it ran side by side). "
                  "`python bench_kernel_profile.py` (from benchmarks/).")


if __name__ == "__main__":
    main()
