"""Shared by the benchmark scripts: where results go and how they are written."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def median_time(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_results(name: str, title: str, table: list[dict], notes: str = "") -> None:
    """benchmarks/results/<name>.json (figures) and .md (the table a person reads)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"title": title, "machine": machine(), "rows": table}, indent=1) + "\n")
    cols = list(table[0]) if table else []
    lines = [f"# {title}", "", f"Machine: {machine()}. {notes}".strip(), "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |" for r in table]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def compile_plan(model: Path, cluster, out: Path, options: dict | None = None,
                 skip: tuple[str, ...] = (), memory_budget: float | None = None
                 ) -> tuple[dict, dict, float]:
    """Compile with per-pass `options` ({pass: {option: value}}); the plan, the compile
    statistics and the wall-clock seconds of the whole compile."""
    from alpac.driver import build_pipeline, compile_model

    pipeline = build_pipeline(None, skip, {p: {k: str(v) for k, v in o.items()}
                                           for p, o in (options or {}).items()})
    start = time.perf_counter()
    compile_model(model, cluster, pipeline, out, memory_budget=memory_budget)
    seconds = time.perf_counter() - start
    return (json.loads((out / "plan.json").read_text()),
            json.loads((out / "compile-stats.json").read_text()), seconds)


def p3_cluster(devices: int):
    """The paper's p3.16xlarge cluster cut to `devices` (whole nodes of 8, or part of one)."""
    from alpac.plan.cluster import load_cluster
    return load_cluster(ROOT / "testdata" / "clusters" / "aws-p3.16xlarge-x8.yaml").cut(devices)


def megatron_grid(devices: int, per_node: int, blocks: int):
    """Megatron-style (dp, tp, pp): tp inside a node, pp dividing the blocks (equal blocks per
    stage), dp the rest."""
    for tp in (t for t in (1, 2, 4, 8) if t <= per_node and devices % t == 0):
        for pp in (p for p in range(1, devices // tp + 1) if (devices // tp) % p == 0):
            if blocks % pp == 0:
                yield devices // tp // pp, tp, pp
