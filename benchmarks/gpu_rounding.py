"""The rounding floor of `alpa-run --check` on a GPU: the original module run the same number of
steps on the GPU and on the host's CPU, from the inputs alpa-run's --check uses (--seed), and
compared with the check's own measure (max|gpu - cpu| / max|cpu| per output). Both are correct
executions of one program, so a plan whose error against the GPU reference is of this size
differs by rounding, not by a wrong rewrite.

    python benchmarks/gpu_rounding.py testdata/models/gpt_train.hlo --iters 1 11
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def step_aliases(text: str) -> list[tuple[int, int]]:
    """(flattened output position, parameter) pairs fed back between steps, as --check does."""
    from alpac.hlo import parse_hlo
    aliases = parse_hlo(text).input_output_alias
    if any(len(a.output_index) != 1 or a.parameter_index for a in aliases):
        raise SystemExit("nested tuple aliases are not supported here")
    return [(a.output_index[0], a.parameter_number) for a in aliases]


def floor(path: Path, iterations: list[int], seed: int) -> list[dict]:
    """Per step count: the worst output's error of the GPU run against the CPU run."""
    import jax
    from alpac.runtime.data import entry_parameters, load_inputs, reference, relative_errors
    text = path.read_text()
    params = entry_parameters(text, str(path))
    inputs = load_inputs(None, seed, params, {p.number for p in params})
    args = [inputs[p.number] for p in params]
    aliases = step_aliases(text)
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    rows = []
    for n in iterations:
        errs = relative_errors(reference(text, args, aliases, n, gpu),
                               reference(text, args, aliases, n, cpu))
        worst = max(range(len(errs)), key=errs.__getitem__)
        rows.append({"module": path.stem, "iterations": n, "device": str(gpu),
                     "max_rel_error": errs[worst], "at": f"out{worst}"})
        print(f"{path.stem}: {n} step(s), {gpu} against {cpu}: max relative error "
              f"{errs[worst]:.3g} (at out{worst})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", type=Path, nargs="+", help="HLO text files")
    ap.add_argument("--iters", type=int, nargs="+", default=[1, 11])
    ap.add_argument("--seed", type=int, default=0, help="alpa-run's --seed")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    rows = [r for m in args.modules for r in floor(m, args.iters, args.seed)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
