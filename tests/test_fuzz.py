"""Seeded mutation fuzzing of the loader: small test models with one random change each (an
opcode swapped, a number in a shape or attribute changed, a line deleted or duplicated) must
load and compile with exit 0 (still a valid module) or exit 2 (refused with one line), never
exit 1 or an uncaught exception.

Before the shape check at load (alpac/hlo/shapecheck.py), 72 of these 600 cases ended in exit 1
(a pass failing on a malformed module: IndexError, KeyError, AttributeError, invalid IR); none
do now. `python tests/test_fuzz.py [N]` runs the cases outside pytest and prints a summary;
`python tests/test_fuzz_inputs.py` runs them with the fuzzing of plans and cluster files and
writes benchmarks/results/fuzz.md.
"""

from __future__ import annotations

import random
import re
import sys
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SHARED, TESTDATA  # noqa: E402

MODELS = tuple(TESTDATA / "models" / f"{m}.hlo"
               for m in ("mlp_fwd", "mlp_train", "gpt_fwd", "bert_fwd", "wresnet_fwd", "moe_fwd"))
# Small modules from ../shared with the opcodes the test models lack (while, dynamic slices,
# scatter, pad, slices, variadic reduce, grouped convolution); skipped where it is absent.
SHARED_MODELS = tuple(SHARED / p for p in (
    "hlo-corpus/sharded_computation.hlo", "xla-cases/While.hlo", "xla-cases/DynamicSlice.hlo",
    "xla-cases/ScatterTest3D.hlo", "xla-cases/ConvolutionSplitDepthwiseTest.hlo",
    "xla-cases/TupleReduceTest.hlo", "xla-cases/SliceAliasTest.hlo",
    "xla-cases/GatherConvTest.hlo", "xla-cases/UserShardingTest.hlo"))
KINDS = ("opcode", "number", "delete", "duplicate")
CASES = 400  # over MODELS: 100 of each kind
SHARED_CASES = 200  # over SHARED_MODELS: 50 of each kind
# Opcodes a swap may bring in besides those of the module itself.
SWAP_OPCODES = (
    "add", "multiply", "negate", "exponential", "convert", "compare", "select", "clamp", "dot",
    "convolution", "reshape", "broadcast", "transpose", "reduce", "reduce-window", "slice",
    "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "gather", "scatter", "iota",
    "tuple", "get-tuple-element", "while", "call", "copy", "constant", "parameter")
SEED = 20240611
# The fastest whole compile: one stage on a 2-device mesh, short ILP solves.
COMPILE_ARGS = ("--mesh", "2", "--time-limit", "2", "--jobs", "1")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*")
_OPCODE = re.compile(r"(?<=[\]})\s])([a-z][a-z0-9\-]*)(?=\()")
_NUMBER = re.compile(r"(?<![\w.%\-])\d+(?![\w.])")
_LAYOUT = re.compile(r"(?<=\])\{[^}]*\}")  # layouts are not checked: leave them alone


@cache
def _lines(model: Path) -> tuple[str, ...]:
    return tuple(model.read_text().splitlines())


@cache
def _opcodes(model: Path) -> tuple[str, ...]:
    found = set(SWAP_OPCODES)
    for line in _lines(model):
        if _INSTR.match(line):
            m = _OPCODE.search(_head(line))
            if m:
                found.add(m.group(1))
    return tuple(sorted(found))


def _head(line: str) -> str:
    """The part of an instruction line before its metadata (numbers there are not shapes)."""
    for cut in (", metadata=", ", backend_config=", ", frontend_attributes="):
        i = line.find(cut)
        if i >= 0:
            line = line[:i]
    return line


def _instruction_lines(lines) -> list[int]:
    return [i for i, line in enumerate(lines) if _INSTR.match(line)]


def mutate(model: Path, kind: str, rng: random.Random) -> tuple[str, str]:
    """The mutated module text and a description of the change."""
    lines = list(_lines(model))
    where = rng.choice(_instruction_lines(lines))
    line = lines[where]
    if kind == "delete":
        del lines[where]
        return "\n".join(lines) + "\n", f"deleted line {where + 1}"
    if kind == "duplicate":
        lines.insert(where, line)
        return "\n".join(lines) + "\n", f"duplicated line {where + 1}"
    head = _head(line)
    if kind == "opcode":
        m = _OPCODE.search(head)
        if m:
            new = rng.choice([op for op in _opcodes(model) if op != m.group(1)])
            lines[where] = line[:m.start(1)] + new + line[m.end(1):]
            return "\n".join(lines) + "\n", f"line {where + 1}: {m.group(1)} -> {new}"
    at = _INSTR.match(head).end()
    rest = _LAYOUT.sub(lambda m: " " * len(m.group()), head[at:])
    numbers = list(_NUMBER.finditer(rest))
    if not numbers:
        return mutate(model, kind, rng)  # nothing to change on this line: pick another
    m = rng.choice(numbers)
    old = int(m.group())
    new = rng.choice([v for v in (0, 1, 2, old - 1, old + 1, old * 2, old + 7) if v != old
                      and v >= 0])
    lines[where] = line[:at + m.start()] + str(new) + line[at + m.end():]
    return "\n".join(lines) + "\n", f"line {where + 1}: {old} -> {new} in {head.strip()[:60]}"


def case(index: int) -> tuple[Path, str, int]:
    """Cases 0..CASES-1 mutate MODELS, the next SHARED_CASES mutate SHARED_MODELS."""
    models, i = (MODELS, index) if index < CASES else (SHARED_MODELS, index - CASES)
    model = models[i % len(models)]
    kind = KINDS[(i // len(models)) % len(KINDS)]
    return model, kind, SEED + index


def run_case(index: int, tmp: Path):
    """(exit code, exception or None, description, stderr) of one case."""
    from click.testing import CliRunner

    from alpac.cli import main

    model, kind, seed = case(index)
    text, what = mutate(model, kind, random.Random(seed))
    path = tmp / f"{model.stem}_{index}.hlo"
    path.write_text(text)
    result = CliRunner().invoke(main, ["compile", str(path), "-o", str(tmp / f"plan{index}"),
                                       *COMPILE_ARGS])
    exc = result.exception if not isinstance(result.exception, SystemExit) else None
    return result.exit_code, exc, f"{model.name} {kind}: {what}", result.output


@pytest.mark.parametrize("index", range(CASES + SHARED_CASES))
def test_mutant_loads_or_is_refused(index, tmp_path):
    if not case(index)[0].exists():
        pytest.skip(f"{case(index)[0]} is not here")
    code, exc, what, output = run_case(index, tmp_path)
    assert exc is None, f"{what}: uncaught {type(exc).__name__}: {exc}"
    assert code in (0, 2), f"{what}: exit {code}: {output.strip()[-400:]}"
    if code == 2:
        lines = [ln for ln in output.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in output, f"{what}: {output}"


if __name__ == "__main__":
    import collections
    import tempfile
    import time

    n = int(sys.argv[1]) if len(sys.argv) > 1 else CASES + SHARED_CASES
    counts: collections.Counter = collections.Counter()
    start = time.time()
    with tempfile.TemporaryDirectory() as d:
        for i in range(n):
            t = time.time()
            code, exc, what, output = run_case(i, Path(d))
            tag = "crash" if exc is not None else f"exit {code}"
            counts[tag] += 1
            if exc is not None or code not in (0, 2):
                detail = f"{type(exc).__name__}: {exc}" if exc else output.strip()[-300:]
                print(f"[{i}] {tag} ({time.time() - t:.1f}s) {what}\n    {detail}", flush=True)
    print(dict(counts), f"{time.time() - start:.1f}s")
