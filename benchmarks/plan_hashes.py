"""Hash the plan directories alpac writes, so that two commits can be compared file by file.

A behaviour-preserving change (a restructure, a rename) must leave every plan byte-identical:
`plan.json` and every emitted module. This compiles every testdata model on the default
cluster and on a 2x4 mesh, and GPT-2.6B of the suite (batch 64, 32 blocks) on 64 V100s of
p3.16xlarge nodes, through the `alpac` command line (so it runs any commit's code), and writes
one SHA-256 per file (`compile-stats.json`, which holds timings, is left out).

    python benchmarks/plan_hashes.py -o before.json            # on one commit
    python benchmarks/plan_hashes.py -o after.json             # on the other
    python benchmarks/plan_hashes.py --compare before.json after.json

To hash an older checkout with this environment: `git worktree add /tmp/old COMMIT`, link its
passes/ and runtime/ into its alpac/ (`ln -s /tmp/old/passes /tmp/old/alpac/passes`, the
same for runtime: the editable install maps alpac.passes and alpac.runtime to this checkout's),
then `PYTHONPATH=/tmp/old python benchmarks/plan_hashes.py -o before.json` (the checkout's
code is imported ahead of the installed one; each compile runs in a scratch directory, so the
current directory's code does not come first). Plans depend on ILP solves under time limits;
run on an otherwise idle machine, or a solve cut short by load may pick another optimum.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "testdata" / "models"
CLUSTERS = ROOT / "testdata" / "clusters"
LEFT_OUT = {"compile-stats.json"}
CLI = "import sys; from alpac.cli import main; sys.exit(main())"


def cases(cache: Path) -> dict[str, list[str]]:
    """Case name -> `alpac compile` arguments (the model first)."""
    out = {}
    for model in sorted(MODELS.glob("*.hlo")):
        out[f"{model.stem}/default"] = [str(model)]
        out[f"{model.stem}/mesh-2x4"] = [str(model), "--mesh", "2x4"]
    gpt = cache / "gpt-2.6B-b64-32.hlo"
    if not gpt.exists():
        sys.path.insert(0, str(ROOT))
        from testdata.generate import gpt_suite_hlo
        gpt.write_text(gpt_suite_hlo("2.6B", batch_size=64, num_layers=32))
    cluster = cache / "p3-x8.yaml"
    cluster.write_text((CLUSTERS / "aws-p3.16xlarge-x8.yaml").read_text())
    out["gpt-2.6B@64/p3"] = [str(gpt), "--cluster", str(cluster)]
    return out


def hash_plan(plan_dir: Path) -> dict[str, str]:
    return {str(f.relative_to(plan_dir)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(plan_dir.rglob("*")) if f.is_file() and f.name not in LEFT_OUT}


def run(only: list[str], out: Path, cache: Path) -> None:
    results = {}
    todo = cases(cache)
    for name, args in todo.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            plan = Path(tmp) / "plan"
            done = subprocess.run([sys.executable, "-c", CLI, "compile", *args, "-o", str(plan)],
                                  capture_output=True, text=True, env=os.environ, cwd=tmp)
            if done.returncode:
                results[name] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
            else:
                results[name] = hash_plan(plan)
        print(f"{name}: {len(results[name])} files" if "error" not in results[name]
              else f"{name}: {results[name]['error']}", flush=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def compare(a: Path, b: Path) -> int:
    """Print every case whose plans differ; exit status 1 if any does."""
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    differ = 0
    for name in sorted(set(left) | set(right)):
        x, y = left.get(name), right.get(name)
        if x == y:
            continue
        differ += 1
        if x is None or y is None:
            print(f"{name}: only in {a if y is None else b}")
            continue
        files = sorted(f for f in set(x) | set(y) if x.get(f) != y.get(f))
        print(f"{name}: differs in {', '.join(files)}")
    same = len(set(left) & set(right)) - differ
    print(f"{same} cases identical, {differ} differ")
    return 1 if differ else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, default=Path("plan-hashes.json"))
    parser.add_argument("--only", nargs="*", default=[], help="case name prefixes")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) /
                        "alpac-plan-hashes", help="where the generated GPT model is kept")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    args.cache.mkdir(parents=True, exist_ok=True)
    run(args.only, args.out, args.cache)


if __name__ == "__main__":
    main()
