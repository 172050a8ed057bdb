"""Many parameters against a long chain (issue 54): `alpac inspect` and `alpac compile` (default
cluster) of a module with N parameters, each negated and returned in one tuple, against a
chain of N negates on one parameter, through the command line (a process per run, so import
and start-up time is in both). Target: the N-parameter module within 2x of the chain at
N = 20,000 (it was quadratic: 101 s to inspect at 20,000 parameters).

The parameter module holds 2N+1 instructions (and N inputs and outputs the plan lists), the
chain N+2: linear work alone puts the ratio near 2.

    python benchmarks/bench_parameters.py [--sizes 5000,10000,20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import write_results

from testdata.wide import chain_hlo, many_parameters_hlo

BIN = Path(sys.executable).parent
TARGET = 2.0  # the parameter module within 2x of the chain
SHAPES = {"param": many_parameters_hlo, "chain": chain_hlo}


def run_seconds(args: list[str]) -> float:
    """Wall-clock seconds of one `alpac` command."""
    start = time.perf_counter()
    subprocess.run([str(BIN / "alpac"), *args], check=True, capture_output=True)
    return time.perf_counter() - start


def time_size(count: int, rounds: int, tmp: Path) -> dict:
    """Median seconds of inspect and compile of both shapes at `count`, the shapes taking
    turns in each round so that a change in the machine's load falls on both."""
    times = {(shape, cmd): [] for shape in SHAPES for cmd in ("inspect", "compile")}
    files = {}
    for shape, generate in SHAPES.items():
        files[shape] = tmp / f"{shape}_{count}.hlo"
        files[shape].write_text(generate(count))
    for _ in range(rounds):
        for shape, path in files.items():
            times[(shape, "inspect")].append(run_seconds(["inspect", str(path)]))
            times[(shape, "compile")].append(
                run_seconds(["compile", str(path), "-o", str(tmp / f"plan_{shape}")]))
    return {key: statistics.median(values) for key, values in times.items()}


def row(count: int, seconds: dict) -> dict:
    out = {"N": f"{count:,}", "instructions (param / chain)": f"{2 * count + 1:,} / "
                                                             f"{count + 2:,}"}
    for cmd in ("inspect", "compile"):
        ratio = seconds[("param", cmd)] / seconds[("chain", cmd)]
        out[f"{cmd} param s"] = f"{seconds[('param', cmd)]:.2f}"
        out[f"{cmd} chain s"] = f"{seconds[('chain', cmd)]:.2f}"
        out[f"{cmd} ratio"] = f"{ratio:.2f}"
        out[f"{cmd} within {TARGET:g}x"] = "yes" if ratio <= TARGET else "NO"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="5000,10000,20000")
    parser.add_argument("--rounds", type=int, default=3, help="runs per median")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in (int(n) for n in args.sizes.split(",")):
            rows.append(row(count, time_size(count, args.rounds, Path(tmp))))
            print(rows[-1], flush=True)
    write_results("parameters", "Many parameters against a chain of instructions", rows,
                  f"Median of {args.rounds} runs of the `alpac` command (a process each, start-up "
                  f"included), the two shapes taking turns; compile on the default cluster. "
                  f"param: N parameters f32[4], each negated, all returned in one tuple; chain: "
                  f"N negates in a row on one parameter. ratio = param / chain seconds.")


if __name__ == "__main__":
    main()
