"""Check the zoo's reference data against alpac's own XLA (the .venv's jax/jaxlib, on CPU).

    .venv/bin/python testdata/zoo/check_refs.py [NAME ...] [--rtol 1e-5] [--atol 1e-6]

For each program in testdata/zoo/manifest.json (or the names given): compile
`programs/<name>.hlo` the way alpac's runtime does (alpac.xla.bridge.run_hlo_single_device:
HLO text -> StableHLO -> one CPU device), feed arg0..argN from `<name>.npz` and compare the
outputs with out0..outM. Prints, per program, the largest relative error over all outputs
(|got - want| / max(|want|, atol / rtol), elementwise) and whether every output is within
`rtol`/`atol` (np.allclose). Exit status 1 if any program fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import jax  # noqa: E402

# TensorFlow's step counter and PyTorch/XLA's token ids and scalars are s64/f64 parameters:
# without x64, jax would hand them to XLA as s32/f32 arrays, which the executable rejects.
jax.config.update("jax_enable_x64", True)

from alpac.xla.bridge import run_hlo_single_device  # noqa: E402


def check(name: str, rtol: float, atol: float) -> tuple[bool, float, str]:
    text = (HERE / "programs" / f"{name}.hlo").read_text()
    with np.load(HERE / "programs" / f"{name}.npz") as z:
        args = [z[f"arg{i}"] for i in range(sum(k.startswith("arg") for k in z.files))]
        want = [z[f"out{i}"] for i in range(sum(k.startswith("out") for k in z.files))]
    got = run_hlo_single_device(text, args)
    if len(got) != len(want):
        return False, float("inf"), f"{len(got)} outputs, the npz has {len(want)}"
    worst, where, ok = 0.0, "", True
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        if g.shape != w.shape or g.dtype != w.dtype:
            return False, float("inf"), \
                f"out{i}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
        if not np.issubdtype(w.dtype, np.floating):
            if not np.array_equal(g, w):
                ok, worst, where = False, float("inf"), f"out{i} (integer) differs"
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        rel = np.abs(g64 - w64) / np.maximum(np.abs(w64), atol / rtol)
        r = float(np.max(rel)) if rel.size else 0.0
        if not np.all(np.isfinite(g64) == np.isfinite(w64)):
            r = float("inf")
        if r > worst:
            worst, where = r, f"out{i}"
        ok &= bool(np.allclose(g64, w64, rtol=rtol, atol=atol, equal_nan=True))
    return ok, worst, where


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--atol", type=float, default=1e-6)
    a = ap.parse_args(argv)
    manifest = json.loads((HERE / "manifest.json").read_text())["programs"]
    names = a.names or sorted(manifest)
    bad = 0
    for name in names:
        t0 = time.time()
        try:
            ok, worst, where = check(name, a.rtol, a.atol)
        except Exception as e:  # a program XLA cannot compile is a failure, not a crash
            ok, worst, where = False, float("inf"), f"{type(e).__name__}: {e}"
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:40s} max rel err {worst:.3g} {where} "
              f"({time.time() - t0:.1f} s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
