"""alpac's peak-memory estimate against XLA's buffer assignment (issue 47, point 3: the
estimate of a planned module at least XLA's and within 1.15× of it).

Per program (the testdata models and the zoo's programs), one stage on a 2x4 mesh of the
default cluster (`alpac compile --mesh 2x4`), the stage's sharded module compiled by XLA for 8
virtual CPU devices: XLA's peak per device is arguments + outputs - aliased + temporaries
(`alpac explain --verify` prints the same); alpac's is the plan's `peak_memory_bytes`.

    python benchmarks/bench_memory.py [--programs gpt_train,hf_bert_mlm_train]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from common import ROOT, write_results  # noqa: E402

from alpac.driver import build_pipeline, compile_model  # noqa: E402
from alpac.errors import UserError  # noqa: E402
from alpac.plan.cluster import default_cluster  # noqa: E402
from alpac.xla.bridge import compile_hlo, cpu_devices  # noqa: E402

PROGRAMS = sorted([*(ROOT / "testdata" / "models").glob("*.hlo"),
                   *(ROOT / "testdata" / "zoo" / "programs").glob("*.hlo")])


def measure(path: Path, out: Path) -> dict:
    """The plan's estimate and XLA's buffer assignment of its one stage, per device."""
    pipeline = build_pipeline(None, (), {"stage-construction": {"mesh": "2x4"}})
    try:
        compile_model(path, default_cluster(), pipeline, out)
    except UserError as e:
        return {"program": path.stem, "refused": str(e)}
    plan = json.loads((out / "plan.json").read_text())
    (stage,) = plan["stages"]
    exe = compile_hlo((out / stage["module"]).read_text(), cpu_devices(8))
    xla = exe.peak_bytes()
    estimate = stage["estimate"]["peak_memory_bytes"]
    return {"program": path.stem, "estimate_bytes": estimate, "xla_bytes": xla,
            "xla_temp_bytes": exe.memory_stats()["temp_bytes"], "ratio": estimate / xla}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", help="comma-separated stems (default: all)")
    args = parser.parse_args()
    wanted = set(args.programs.split(",")) if args.programs else None
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in PROGRAMS:
            if wanted is None or path.stem in wanted:
                results.append(measure(path, Path(tmp) / path.stem))
                print(json.dumps(results[-1]), flush=True)
    ratios = [r["ratio"] for r in results if "ratio" in r]
    inside = sum(1.0 <= x <= 1.15 for x in ratios)
    write_results("memory_vs_xla", "Peak memory per device: alpac's estimate against XLA's",
                  [{"program": r["program"],
                    "estimate MB": f"{r['estimate_bytes'] / 1e6:.2f}" if "ratio" in r else "-",
                    "XLA MB": f"{r['xla_bytes'] / 1e6:.2f}" if "ratio" in r else "-",
                    "XLA temporaries MB": f"{r['xla_temp_bytes'] / 1e6:.2f}"
                    if "ratio" in r else "-",
                    "estimate / XLA": f"{r['ratio']:.3f}" if "ratio" in r
                    else f"refused: {r['refused']}"} for r in results],
                  f"One stage on 2x4 (`alpac compile --mesh 2x4`, the default cluster); XLA: "
                  f"arguments + outputs - aliased + temporaries of the stage's sharded module "
                  f"on 8 virtual CPU devices. {len(ratios)} programs: estimate / XLA "
                  f"{min(ratios, default=0):.2f}-{max(ratios, default=0):.2f}, median "
                  f"{statistics.median(ratios) if ratios else 0:.2f}; {inside} within "
                  f"1.00-1.15 (issue 47's target: all). `python benchmarks/bench_memory.py`.")


if __name__ == "__main__":
    main()
