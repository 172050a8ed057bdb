"""Golden tests, one per pass: a small input under tests/golden/, `alpac compile --passes <the
recipe up to that pass>` (command line only) and the IR dump or plan decisions it gives, compared
with tests/golden/<case>/expected*; a mismatch fails with a unified diff. After an intended
change, `ALPAC_UPDATE_GOLDEN=1 pytest tests/test_pass_golden.py` rewrites them: review the diff."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from conftest import ROOT, TESTDATA

GOLDEN = ROOT / "tests" / "golden"
UPDATE = os.environ.get("ALPAC_UPDATE_GOLDEN", "") not in ("", "0")
# The cluster is always given: the default one depends on this machine's memory.
CLUSTER = TESTDATA / "clusters" / "local-cpu.yaml"  # 8 devices, 3 GiB each
TRAIN = GOLDEN / "inputs" / "train_step.hlo"  # 2-layer MLP step, SGD + momentum, batch 32
BATCH_NORM = GOLDEN / "inputs" / "batch_norm_step.hlo"  # a batch statistic used per example

RECIPE = ("load", "inline-calls", "flatten-params", "cost-analysis", "batch-analysis",
          "step-split", "unroll-layer-loops", "stage-construction", "intra-op-sharding",
          "reduce-scatter", "emit")
SCANNED = GOLDEN / "unroll-layer-loops" / "input.hlo"  # 3 layers by lax.scan, momentum SGD
SCANNED_4 = GOLDEN / "unroll-layer-loops-per-stage" / "input.hlo"  # the same with 4 layers
# Run-dependent figures, dropped wherever they appear: pass times, ILP solve statistics (solve
# time, gap, graph sizes, rounds, status) and the stage DP's call counts.
RUN_DEPENDENT = {"pass_seconds", "ilp", "ilp_solve_time_s", "dp"}


def upto(name: str) -> str:
    return ",".join(RECIPE[:RECIPE.index(name) + 1])


def alpac(*args) -> str:
    result = subprocess.run([sys.executable, "-m", "alpac.cli", *map(str, args)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, f"alpac {' '.join(map(str, args))}\n{result.stderr}"
    return result.stdout


def normalize(value):
    """Drop run-dependent keys; round fractional floats to 6 significant digits (estimates are
    sums whose last bits may move with the order of evaluation)."""
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items() if k not in RUN_DEPENDENT}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, float) and not value.is_integer():
        return float(f"{value:.6g}")
    return value


def as_json(value) -> str:
    """Sorted-keys JSON, one line per entry, an entry on one line where it fits in 100."""
    def fmt(v, indent: str) -> str:
        flat = json.dumps(v, sort_keys=True)
        if not isinstance(v, (dict, list)) or not v or len(indent) + len(flat) <= 100:
            return flat
        inner = indent + " "
        if isinstance(v, dict):
            items = [f"{inner}{json.dumps(k)}: {fmt(v[k], inner)}" for k in sorted(v)]
            return "{\n" + ",\n".join(items) + f"\n{indent}}}"
        return "[\n" + ",\n".join(inner + fmt(x, inner) for x in v) + f"\n{indent}]"
    return fmt(normalize(value), "") + "\n"


@dataclass
class Run:
    """One compile's outputs: the plan directory and its dump directory."""
    plan_dir: Path

    @property
    def plan(self) -> dict:
        return json.loads((self.plan_dir / "plan.json").read_text())

    @property
    def stats(self) -> dict:
        return json.loads((self.plan_dir / "compile-stats.json").read_text())

    def dump(self, name: str) -> str:
        return (self.plan_dir.with_name(self.plan_dir.name + ".dump")
                / f"after-{name}.hlo").read_text()


# ---- what each case compares ---------------------------------------------------------------

def ir_after(name: str, *stat_keys: str) -> Callable[[Run], dict[str, str]]:
    """The --dump-after text, and the pass's counts from compile-stats.json."""
    def collect(run: Run) -> dict[str, str]:
        out = {"expected.hlo": run.dump(name)}
        if stat_keys:
            out["expected.json"] = as_json({k: run.stats.get(k) for k in stat_keys})
        return out
    return collect


def unrolled(run: Run) -> dict[str, str]:
    """The IR with its layer loops cut, and how its parameters and outputs are pieces of the
    source's."""
    return {"expected.hlo": run.dump("unroll-layer-loops"),
            "expected.json": as_json({"layer_loops": run.plan["layer_loops"],
                                      "unrolled": run.stats["unrolled"]})}


def stats_entries(*keys: str) -> Callable[[Run], dict[str, str]]:
    return lambda run: {"expected.json": as_json({k: run.stats.get(k) for k in keys})}


ENVELOPE = ("cluster", "compiler", "source", "schema")  # the plan's header, not a decision


def plan_entries(run: Run) -> dict[str, str]:
    """Every decision plan.json holds (the header left out)."""
    return {"expected.json": as_json({k: v for k, v in run.plan.items() if k not in ENVELOPE})}


def shardings(run: Run) -> dict[str, str]:
    """The ILP's choice for every instruction of every stage (one line each), and each stage's
    mesh, collectives and estimate."""
    plan = run.plan
    lines = []
    for stage in plan["stages"]:
        lines.append(f"stage {stage['index']} on logical mesh {stage['mesh']['logical_shape']}"
                     f" (devices {stage['mesh']['devices']})")
        for d in json.loads((run.plan_dir / stage["decisions"]).read_text()):
            line = (f"  %{d['instruction']} = {d['opcode']} {d['shape']}: {d['strategy']}"
                    f" -> {d['xla']}")
            for c in d["collectives"]:
                line += f"  [{c['kind']} over mesh axes {c['axes']}, {c['bytes']} B]"
            lines.append(line)
    stages = [{k: s.get(k) for k in ("index", "mesh", "collectives", "estimate")}
              for s in plan["stages"]]
    return {"expected.txt": "\n".join(lines) + "\n",
            "expected.json": as_json({"memory_budget_bytes": plan["memory_budget_bytes"],
                                      "stages": stages})}


def emitted(run: Run) -> dict[str, str]:
    """The plan's stages, estimate and program (values' shardings left to the module texts),
    and the text of every module alpa-run executes."""
    plan = run.plan
    program = {k: v for k, v in plan["program"].items() if k != "values"}
    out = {"expected.json": as_json({"num_micro_batches": plan["num_micro_batches"],
                                     "estimate": plan["estimate"], "stages": plan["stages"],
                                     "program": program})}
    for module in plan["program"]["modules"]:
        out[f"expected.{module['file']}"] = (run.plan_dir / module["file"]).read_text()
    return out


# ---- the cases -----------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    model: Path
    passes: str | None  # None: not a compile (see `command`)
    collect: Callable[[Run], dict[str, str]]
    flags: tuple[str, ...] = ()
    dump: tuple[str, ...] = ()
    command: Callable[[Case], dict[str, str]] | None = field(default=None, repr=False)


def inspect_cost(case: Case) -> dict[str, str]:
    """`compile` keeps the cost table to itself (no plan.json or compile-stats.json entry, and
    the IR it dumps is unchanged), so its figures are read where the CLI prints them:
    `alpac inspect --json`, which runs load, inline-calls, cost-analysis, batch-analysis and
    step-split."""
    summary = json.loads(alpac("inspect", case.model, "--json"))
    return {"expected.json": as_json({"cost": summary["cost"]})}


# a two-stage pipeline (the stage DP alone keeps the small step whole on this cluster, once
# what stages send each other is priced)
PIPELINED = ("--layers", "2", "--stages", "0-0,1-1", "--micro-batches", "16")

CASES = [
    # IR-rewriting passes: the --dump-after text.
    Case("load", GOLDEN / "load" / "input.hlo", upto("load"), ir_after("load"), dump=("load",)),
    Case("load-stablehlo", GOLDEN / "load-stablehlo" / "input.mlir", upto("load"),
         ir_after("load"), dump=("load",)),
    Case("inline-calls", GOLDEN / "inline-calls" / "input.hlo", upto("inline-calls"),
         ir_after("inline-calls", "inlined_calls", "dead_instructions"), dump=("inline-calls",)),
    Case("flatten-params", GOLDEN / "flatten-params" / "input.hlo", upto("flatten-params"),
         ir_after("flatten-params", "flattened_params"), dump=("flatten-params",)),
    Case("unroll-layer-loops", SCANNED, upto("unroll-layer-loops"), unrolled,
         dump=("unroll-layer-loops",)),
    Case("unroll-layer-loops-per-stage", SCANNED_4, upto("unroll-layer-loops"), unrolled,
         flags=("--strategy", "megatron:dp=2,tp=2,pp=2"), dump=("unroll-layer-loops",)),
    # Analyses: what they found.
    Case("cost-analysis", GOLDEN / "cost-analysis" / "input.hlo", None, None,
         command=inspect_cost),
    Case("batch-analysis", TRAIN, upto("batch-analysis"), stats_entries("batch")),
    Case("batch-analysis-none", GOLDEN / "cost-analysis" / "input.hlo", upto("batch-analysis"),
         stats_entries("batch")),
    Case("step-split", TRAIN, upto("step-split"), stats_entries("step")),
    Case("step-split-refusal", BATCH_NORM, upto("step-split"), stats_entries("batch", "step")),
    # Decisions: stages and micro-batches, shardings, weight-update sharding, the emitted plan.
    Case("stage-construction", TRAIN, upto("stage-construction"), plan_entries),
    Case("stage-construction-megatron", TRAIN, upto("stage-construction"), plan_entries,
         flags=("--strategy", "megatron:dp=2,tp=2,pp=2")),
    Case("stage-construction-refusal", BATCH_NORM, upto("stage-construction"), plan_entries),
    # intra-op-sharding's choices reach the outputs only through emit (plan.json holds just the
    # memory budget before it): one stage on a 2x4 mesh, reduce-scatter left out.
    Case("intra-op-sharding", TRAIN, upto("intra-op-sharding") + ",emit", shardings,
         flags=("--mesh", "2x4")),
    Case("reduce-scatter", TRAIN, upto("reduce-scatter"), plan_entries, flags=PIPELINED),
    Case("reduce-scatter-zero3", TRAIN, upto("reduce-scatter"), plan_entries,
         flags=("--zero", "3", *PIPELINED)),
    Case("emit", TRAIN, upto("emit"), emitted, flags=PIPELINED),
]


def produce(case: Case, tmp_path: Path) -> dict[str, str]:
    if case.command is not None:
        return case.command(case)
    plan_dir = tmp_path / "plan"
    args = ["compile", case.model, "-o", plan_dir, "--cluster", CLUSTER, "--passes", case.passes,
            *case.flags]
    for name in case.dump:
        args += ["--dump-after", name]
    alpac(*args)
    return case.collect(Run(plan_dir))


def test_every_pass_has_a_case():
    ids = {c.id for c in CASES}
    assert set(RECIPE) <= ids, sorted(set(RECIPE) - ids)
    listed = alpac("passes")
    for name in RECIPE:
        assert name in listed, name


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_pass_golden(case: Case, tmp_path: Path):
    produced = produce(case, tmp_path)
    directory = GOLDEN / case.id
    stale = sorted(p.name for p in directory.glob("expected*") if p.name not in produced)
    if UPDATE:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in produced.items():
            (directory / name).write_text(text)
        for name in stale:
            (directory / name).unlink()
        return
    problems = []
    for name, text in sorted(produced.items()):
        path = directory / name
        if not path.exists():
            problems.append(f"{path.relative_to(ROOT)} is missing")
            continue
        expected = path.read_text()
        if text != expected:
            rel = str(path.relative_to(ROOT))
            problems.append("".join(difflib.unified_diff(
                expected.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{rel} (expected)", tofile=f"{rel} (produced)")))
    problems += [f"{(directory / n).relative_to(ROOT)} is no longer produced" for n in stale]
    if problems:
        pytest.fail(f"golden mismatch for pass case '{case.id}' (ALPAC_UPDATE_GOLDEN=1 rewrites "
                    f"the expected files):\n" + "\n".join(problems), pytrace=False)
