"""Compile and run every zoo program the way a user would, and compare with its reference.

    python testdata/zoo/run.py                  # every program x every configuration -> table
    python testdata/zoo/run.py hf_gpt2_train    # some programs
    python testdata/zoo/run.py --configs 2x2    # some configurations

Each (program, configuration) runs `alpac compile` and then `alpa-run --inputs <npz> --save`
as separate processes, exactly as the README shows, and ends in one of:

- `exact`: alpa-run's outputs match the front end's reference within `RTOL`, measured
  norm-wise per output (max |out - ref| / max |ref|): the error of a sum is bounded relative
  to the size of what is summed, not to each element, so reordered reductions (microbatch
  sums, partitioned dots) stay inside it while a wrong value does not. An output over `RTOL`
  is reduction noise, not a wrong value, only if XLA's own SPMD partitioning of the same
  program (batch split 8 ways) is within a factor `NOISE_FACTOR` of it: Adam divides each
  gradient by its own root mean square, so a parameter whose gradient is mostly cancellation
  (a class token, a layer scale near zero) inherits the last bits of the batch sum's order;
  a wrong value (a semantic bug, a corrupted collective) is orders of magnitude further. An
  output over both is still noise where alpa-run's result is about as near the program run
  in float64 as the front end's float32 reference is (`f64_errors`);
- `refused`: compile or alpa-run exited 2 with one line saying why (a plan that refuses
  microbatching, e.g. for batch-norm statistics, still compiles and is `exact` with B = 1;
  its reason is in the plan column);
- `FAIL`: anything else (exit 1, a traceback, a mismatch).

The corpus modules of ../shared/hlo-corpus that are given before partitioning have no
reference: they are compiled for the DGX cluster only, with time and peak memory measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "testdata" / "zoo"
CORPUS = ROOT.parent / "shared" / "hlo-corpus"
CLUSTERS = ROOT / "testdata" / "clusters"
BIN = Path(sys.executable).parent
RTOL = 1e-5

#: name -> (compile flags, alpa-run flags); "{two}" is the 2-node x 2-device cluster
CONFIGS = {
    "default": ([], ["--devices-per-rank", "2", "--", "np", "4"]),
    "2x2": (["--cluster", "{two}"], ["--", "np", "4"]),
    "2x2-mb4": (["--cluster", "{two}", "--micro-batches", "4"], ["--", "np", "4"]),
    "2x2-pp2": (["--cluster", "{two}", "--layers", "2", "--stages", "0-0,1-1",
                 "--micro-batches", "4"], ["--", "np", "4"]),
    "2x2-pp2-remat": (["--cluster", "{two}", "--layers", "2", "--stages", "0-0,1-1",
                       "--micro-batches", "4", "--remat", "full"], ["--", "np", "4"]),
}
CORPUS_MODULES = ("mobilenet_v2", "sharded_computation",
                  "nv_maxtext_1n1g_jit_train_step_before_optimization",
                  "nv_maxtext_deepseek_1n4g_jit_train_step_before_optimization")
TWO_BY_TWO = """\
name: two-by-two
nodes: 2
devices_per_node: 2
device: {name: cpu, memory: 3GiB, flops: {f32: 20e9}}
links:
  intra_node: {bandwidth: 10GB/s, latency: 2us}
  inter_node: {bandwidth: 1GB/s, latency: 20us}
"""


@dataclass
class Outcome:
    program: str
    config: str
    status: str  # exact | refused | FAIL
    reason: str = ""
    compile_s: float = 0.0
    compile_peak_mb: float = 0.0
    plan: str = ""
    max_error: float | None = None
    instructions: int = 0
    front_end: str = ""
    worst: dict = field(default_factory=dict)


def manifest() -> dict:
    """Every zoo program: name -> its manifest entry, with `dir` where its files are (the
    front-end programs, and the opcode programs that complete the opcode coverage)."""
    out = {}
    for folder, listing in ((ZOO / "programs", ZOO / "manifest.json"),
                            (ZOO / "opcodes", ZOO / "opcodes" / "manifest.json")):
        if listing.exists():
            for name, info in json.loads(listing.read_text())["programs"].items():
                out[name] = {**info, "dir": str(folder)}
    return out


def timed(cmd: list[str], timeout: float) -> tuple[int, str, float, float]:
    """Run `cmd`; (exit code, output, seconds, peak resident MB of its process). The peak is
    read by a small Python process that starts `cmd` and waits for it (`_PEAK`): Linux counts
    a child's peak from the memory of the process that forked it, which for a test runner is
    gigabytes, for this starter about 10 MB."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        peak_file, log_file = Path(tmp) / "peak", Path(tmp) / "log"
        with open(log_file, "wb") as log:
            p = subprocess.Popen([sys.executable, "-c", _PEAK, str(peak_file), *cmd],
                                 stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                 start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                code = p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
                return 124, f"timed out after {timeout:.0f} s", timeout, 0.0
        out = log_file.read_text(errors="replace")
        peak_kb = float(peak_file.read_text()) if peak_file.exists() else 0.0
    return code, out, time.perf_counter() - start, peak_kb / 1024


_PEAK = """import os, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(p.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def plan_summary(plan_dir: Path) -> str:
    plan = json.loads((plan_dir / "plan.json").read_text())
    meshes = "+".join("x".join(map(str, s["mesh"]["logical_shape"])) for s in plan["stages"])
    text = f"{len(plan['stages'])} stage(s) [{meshes}], B={plan['num_micro_batches']}"
    for what in ("pipelining", "microbatching"):
        if (plan.get(what) or {}).get("refused"):
            text += f"; {what} refused"
    return text


def run_one(name: str, config: str, work: Path, timeout: float = 900) -> Outcome:
    """Compile `name` in `config`, run it under alpa-run and compare with its reference."""
    info = manifest()[name]
    hlo, npz = Path(info["dir"]) / f"{name}.hlo", Path(info["dir"]) / f"{name}.npz"
    out = Outcome(name, config, "FAIL", front_end=info.get("frontend", ""),
                  instructions=_instructions(hlo))
    flags, run_flags = CONFIGS[config]
    two = work / "two-by-two.yaml"
    two.write_text(TWO_BY_TWO)
    flags = [f.replace("{two}", str(two)) for f in flags]
    plan = work / f"{name}.{config}.plan"
    code, text, out.compile_s, out.compile_peak_mb = timed(
        [str(BIN / "alpac"), "compile", str(hlo), "-o", str(plan), *flags], timeout)
    if code != 0:
        out.status = "refused" if code == 2 and _one_line(text) else "FAIL"
        out.reason = last_line(text)
        return out
    out.plan = plan_summary(plan)
    saved = work / f"{name}.{config}.out.npz"
    code, text, _, _ = timed([str(BIN / "alpa-run"), str(plan), "--inputs", str(npz),
                              "--save", str(saved), "--quiet", *run_flags], timeout)
    if code != 0:  # a plan alpac wrote must run: refusing is the compiler's job
        out.reason = last_line(text)
        return out
    errors = compare(saved, npz)
    out.max_error = max(errors.values(), default=0.0)
    out.worst = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:3])
    over = {k: e for k, e in errors.items() if e > RTOL}
    if over:
        floor = xla_noise(name, info, hlo, npz, work)
        out.worst = {k: (e, floor[k]) for k, e in sorted(over.items(), key=lambda kv: -kv[1])[:3]}
        over = {k: e for k, e in over.items() if e > NOISE_FACTOR * floor[k]}
    truth = f64_errors(name, hlo, npz, saved, work) if over else {}
    truth = {k: truth[k] for k in over if k in truth}
    over = {k: e for k, e in over.items() if k not in truth or
            truth[k][0] > TRUTH_FACTOR * truth[k][1]}
    out.status = "FAIL" if over else "exact"
    if over:
        worst = max(over, key=over.get)
        out.reason = (f"max error {over[worst]:.3g} at {worst} > rtol {RTOL:g} and > "
                      f"{NOISE_FACTOR:g}x XLA's own data-parallel error {floor[worst]:.3g}")
    elif truth:
        out.reason = ("over rtol and XLA's own partitioning, but within "
                      f"{TRUTH_FACTOR:g}x the reference's own distance from the float64 result "
                      "(reduction noise): " + ", ".join(
                          f"{k} {ours:.3g} against {ref:.3g}" for k, (ours, ref) in truth.items()))
    elif out.max_error > RTOL:
        out.reason = "over rtol only where XLA's own partitioning is as far (reduction noise)"
    return out


def f64_errors(name: str, hlo: Path, npz: Path, saved: Path, work: Path
               ) -> dict[str, tuple[float, float]]:
    """Per output, alpa-run's error and the reference's own, both against the program run in
    float64 on one device (every f32 of it made f64): an output that alpa-run computes about
    as near that as the front end's float32 reference is (within `TRUTH_FACTOR` of its
    distance) is reduction noise, however far the two float32 results are apart (BEiT's
    class token, unused by its mean pooling: its gradient is all cancellation, and Adam
    scales it to a full step). Empty where the program does not run so (a worker of its
    own: it needs 64-bit jax)."""
    code, _, done = _in_worker("--f64-truth", work / f"{name}.f64.json",
                               {"hlo": str(hlo), "npz": str(npz), "saved": str(saved)})
    return {k: tuple(v) for k, v in done.get("errors", {}).items()} if code == 0 else {}


def _in_worker(flag: str, path: Path, spec: dict) -> tuple[int, str, dict]:
    """This script run again as a worker process (`flag`) on `spec`, written to `path`: its
    exit code, output, and the spec it wrote back."""
    path.write_text(json.dumps(spec))
    code, text, _, _ = timed([sys.executable, __file__, flag, str(path)], 900)
    return code, text, json.loads(path.read_text()) if code == 0 else {}


def _reference_arguments(ref) -> list:
    """The program's arguments in a reference .npz (`arg0`, `arg1`, ...)."""
    return [ref[f"arg{k}"] for k in range(sum(1 for f in ref.files if f.startswith("arg")))]


def _f64_worker(spec_path: Path) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    sys.path.insert(0, str(ROOT))
    import jax
    jax.config.update("jax_enable_x64", True)
    from alpac.runtime.data import relative_errors
    from alpac.xla.bridge import run_hlo_single_device
    spec = json.loads(spec_path.read_text())
    ref, got = np.load(spec["npz"]), np.load(spec["saved"])
    truth = run_hlo_single_device(re.sub(r"\bf32\b", "f64", Path(spec["hlo"]).read_text()),
                                  [a.astype(np.float64) if a.dtype == np.float32 else a
                                   for a in _reference_arguments(ref)])
    keys = [f"out{k}" for k in range(len(truth))]
    theirs = relative_errors([ref[k] for k in keys], truth)
    ours = relative_errors([got[k] for k in keys], truth)
    spec_path.write_text(json.dumps({**spec, "errors": {
        k: (o, r) for k, o, r in zip(keys, ours, theirs) if ref[k].dtype == np.float32}}))


def xla_noise(name: str, info: dict, hlo: Path, npz: Path, work: Path) -> dict[str, float]:
    """Per output, the error of XLA's own SPMD partitioning of the same program (batch inputs
    split over `NOISE_WAYS` devices, as finely as alpac's most microbatches on a batch of 8,
    everything else replicated) against the reference: the reduction noise of a partitioned
    run, e.g. Adam amplifying the last bits of gradients that are nearly zero. Run in a
    process of its own (it needs its own virtual devices)."""
    batch = {int(b["arg"]): int(b["batch_dim"]) for b in info.get("batch_inputs", {}).values()}
    code, text, done = _in_worker("--xla-noise", work / f"{name}.noise.json",
                                  {"hlo": str(hlo), "npz": str(npz), "batch": batch})
    if code != 0:
        raise RuntimeError(f"XLA's partitioning of {name} failed: {last_line(text)}")
    return done["errors"]


def _xla_noise_worker(spec_path: Path) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NOISE_WAYS}"
    sys.path.insert(0, str(ROOT))
    from alpac.xla.bridge import compile_hlo, cpu_devices
    spec = json.loads(spec_path.read_text())
    text = Path(spec["hlo"]).read_text()
    batch = {int(k): v for k, v in spec["batch"].items()}
    ref = np.load(spec["npz"])
    args = _reference_arguments(ref)
    outs = compile_hlo(data_parallel(text, batch, [a.shape for a in args], NOISE_WAYS),
                       cpu_devices(NOISE_WAYS)).run(args)
    keys = [f"out{k}" for k in range(len(outs))]
    from alpac.runtime.data import relative_errors
    errors = relative_errors(outs, [ref[k] for k in keys])
    spec_path.write_text(json.dumps({**spec, "errors": dict(zip(keys, errors))}))


def data_parallel(text: str, batch: dict[int, int], shapes: list, n: int) -> str:
    """The module with its batch inputs split `n` ways along their batch dimension and its
    other parameters replicated (XLA's sharding propagation does the rest)."""
    entry = text.index("\nENTRY")
    head, body = text[:entry], text[entry:]

    def annotate(m: re.Match) -> str:
        k = int(m.group(2))
        if k in batch and shapes[k][batch[k]] % n == 0:
            tiles = [1] * len(shapes[k])
            tiles[batch[k]] = n
            return f"{m.group(1)}parameter({k}), sharding={{devices=[{','.join(map(str, tiles))}]<=[{n}]}}"
        return f"{m.group(1)}parameter({k}), sharding={{replicated}}"

    return head + _PARAMETER.sub(annotate, body.split("\n}", 1)[0], count=0) + "\n}" + \
        body.split("\n}", 1)[1]


_PARAMETER = re.compile(r"(=\s*[^=\n]*?)parameter\((\d+)\)(?:,\s*sharding=\{[^}]*\})?")
NOISE_FACTOR = 10.0
NOISE_WAYS = 8
# an output is noise within this factor of the float32 reference's own error against float64
TRUTH_FACTOR = 2.0
VERIFY = "verify-2x4"  # not a run: `alpac explain --verify` on --mesh 2x4


def verify_one(name: str, work: Path, timeout: float = 900) -> Outcome:
    """`alpac explain --verify` on the program compiled with `--mesh 2x4`: the collectives
    XLA inserts must be the ones alpac predicted."""
    info = manifest()[name]
    hlo = Path(info["dir"]) / f"{name}.hlo"
    out = Outcome(name, VERIFY, "FAIL", front_end=info.get("frontend", ""),
                  instructions=_instructions(hlo))
    plan = work / f"{name}.verify.plan"
    code, text, out.compile_s, out.compile_peak_mb = timed(
        [str(BIN / "alpac"), "compile", str(hlo), "-o", str(plan), "--mesh", "2x4"], timeout)
    if code != 0:
        out.status = "refused" if code == 2 and _one_line(text) else "FAIL"
        out.reason = last_line(text)
        return out
    out.plan = plan_summary(plan)
    code, text, _, _ = timed([str(BIN / "alpac"), "explain", str(plan), "--verify",
                              "--limit", "0"], timeout)
    out.status = "agrees" if code == 0 else "FAIL"
    if code != 0:
        rows = [[c.strip() for c in ln.split("│")] for ln in text.splitlines() if "DIFFERS" in ln]
        out.reason = "predicted vs XLA: " + "; ".join(
            f"{r[0]} {r[1]} vs {r[2]}" for r in rows if len(r) >= 3)
    return out


def compare(saved: Path, reference: Path) -> dict[str, float]:
    """Norm-wise relative error per output: max |out - ref| / max |ref|."""
    sys.path.insert(0, str(ROOT))
    from alpac.runtime.data import relative_errors
    got, ref = np.load(saved), np.load(reference)
    keys = sorted((k for k in ref.files if k.startswith("out")), key=lambda k: int(k[3:]))
    errs = relative_errors([got[k] for k in keys], [ref[k] for k in keys])
    return dict(zip(keys, errs))


def compile_corpus(name: str, work: Path, timeout: float = 600,
                   flags: tuple[str, ...] = ()) -> Outcome:
    """A corpus module (no reference) compiled for the DGX cluster (with `flags`): time and
    peak memory."""
    hlo = CORPUS / f"{name}.hlo"
    out = Outcome(name, "dgx-a100-x4", "FAIL", front_end="corpus",
                  instructions=_instructions(hlo))
    plan = work / f"{name}.plan"
    code, text, out.compile_s, out.compile_peak_mb = timed(
        [str(BIN / "alpac"), "compile", str(hlo), "-o", str(plan), "--cluster",
         str(CLUSTERS / "dgx-a100-x4.yaml"), *flags], timeout)
    if code == 0:
        out.status, out.plan = "compiled", plan_summary(plan)
    else:
        out.status = "refused" if code == 2 and _one_line(text) else "FAIL"
        out.reason = last_line(text)
    return out


def _one_line(text: str) -> bool:
    return "Traceback" not in text and len([ln for ln in text.splitlines() if ln.strip()]) <= 2


def _instructions(path: Path) -> int:
    return sum(1 for ln in path.read_text().splitlines() if " = " in ln and
               not ln.lstrip().startswith(("HloModule", "//")))


def table(outcomes: list[Outcome]) -> str:
    rows = ["| program | front end | instructions | configuration | compile s | compile peak MB "
            "| plan | max error | result |", "|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        err = "" if o.max_error is None else f"{o.max_error:.2e}"
        result = o.status + (f": {o.reason}" if o.reason else "")
        rows.append(f"| {o.program} | {o.front_end} | {o.instructions} | {o.config} | "
                    f"{o.compile_s:.1f} | {o.compile_peak_mb:.0f} | {o.plan} | {err} | "
                    f"{result.replace('|', '/')} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("programs", nargs="*")
    ap.add_argument("--configs", default=",".join([*CONFIGS, VERIFY]))
    ap.add_argument("--no-corpus", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "zoo.md")
    ap.add_argument("--xla-noise", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--f64-truth", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.f64_truth:
        _f64_worker(args.f64_truth)
        return 0
    if args.xla_noise:
        _xla_noise_worker(args.xla_noise)
        return 0
    names = args.programs or sorted(manifest())
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="alpac-zoo-") as tmp:
        for name in names:
            for config in args.configs.split(","):
                o = verify_one(name, Path(tmp)) if config == VERIFY else \
                    run_one(name, config, Path(tmp))
                print(f"{name:40s} {config:9s} {o.status:8s} {o.compile_s:6.1f}s "
                      f"{o.max_error if o.max_error is not None else '':} {o.reason}",
                      flush=True)
                outcomes.append(o)
                write_results(outcomes, args.out)  # a partial table survives an interrupt
        if not args.no_corpus and not args.programs:
            for name in CORPUS_MODULES:
                o = compile_corpus(name, Path(tmp))
                print(f"{name:40s} dgx       {o.status:8s} {o.compile_s:6.1f}s "
                      f"{o.compile_peak_mb:.0f} MB {o.reason}", flush=True)
                outcomes.append(o)
    write_results(outcomes, args.out)
    return 0 if all(o.status != "FAIL" for o in outcomes) else 1


def write_results(outcomes: list[Outcome], path: Path) -> None:
    head = ("# The zoo: programs from real front ends, compiled and run by alpac\n\n"
            "`make zoo` (`python testdata/zoo/run.py`) on this repository's 2-core machine: "
            "every program in `testdata/zoo/` in every configuration, then the corpus "
            "modules of `../shared/hlo-corpus` given before partitioning, compiled for "
            "`testdata/clusters/dgx-a100-x4.yaml`. Max error: norm-wise relative "
            f"(max |out - ref| / max |ref| per output, worst output), tolerance {RTOL:g}. "
            "Compile peak MB: the compile process's maximum resident set.\n\n")
    path.write_text(head + table(outcomes) + "\n")
    path.with_suffix(".json").write_text(json.dumps([asdict(o) for o in outcomes], indent=1)
                                         + "\n")


if __name__ == "__main__":
    sys.exit(main())
