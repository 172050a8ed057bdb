"""How gloo's collectives across ranks cost in the forms a plan's module runs them, against
the form `alpac calibrate` times (one after a dot each, one group at a time).

Under mpiexec (`--ranks R`, `--devices-per-rank K`), with multi-process jax as alpa-run runs:
- an all-reduce over all R·K devices after a dot each (`alpac calibrate`'s `_in_modules`), 8
  in a row with no work between, and one all-reduce of 8 operands (as XLA's combiner merges a
  step's independent gradient all-reduces: the CPU runtime still runs each operand as a
  collective of its own);
- an all-reduce over R ranks, one device each, with the rank's other devices idle (the
  calibrated `inter_node` tables), against K such groups at once (data parallelism across
  ranks beside tensor parallelism inside them), which the cost model prices as one group
  carrying K times the bytes.

Writes results/collective_forms_<R>x<K>.{md,json}. `python bench_collective_forms.py` (from
benchmarks/; under a minute at 4 ranks x 2 devices on this machine)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, write_results

SIZES = (4096, 65536, 1 << 20)
OPERANDS = 8


def measure(k: int, rounds: int) -> list[dict] | None:
    """One rank's part (under mpiexec): rows on rank 0, None elsewhere."""
    import numpy as np

    from alpac.runtime.comm import Comm
    from alpac.runtime.probe_programs import collective_step
    from alpac.runtime.probes import Rank
    from alpac.runtime.timing import per_op
    from alpac.runtime.worker import Options, _init_jax, configure_devices
    comm = Comm(120)
    jax = _init_jax(comm, Options("", devices_per_rank=k, timeout=120),
                    configure_devices(k, "cpu"), True)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    rank, ranks = Rank(comm, jax, k, distributed=True), comm.size
    devices = sorted(jax.devices(), key=lambda d: d.id)
    spec = P(("o", "i"))

    def filled(mesh, nbytes):
        local = nbytes // 4
        return jax.make_array_from_callback((mesh.size * local,), NamedSharding(mesh, spec),
                                            lambda index: np.ones(local, np.float32))

    def operands_of(nbytes: int, combined: bool) -> float:
        """Per all-reduce over every device: OPERANDS in a row, or one of OPERANDS operands."""
        mesh = Mesh(np.array(devices).reshape(1, -1), ("o", "i"))
        xs = [filled(mesh, nbytes) for _ in range(OPERANDS)]

        def body(*ys):
            if combined:
                return tuple(jax.lax.psum(ys, "i"))
            out, y = [], ys[0]
            for x in ys:  # each waits for the one before
                y = jax.lax.psum(y + x * 0, "i") * (1.0 / len(devices))
                out.append(y)
            return tuple(out)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * OPERANDS,
                                  out_specs=(spec,) * OPERANDS, check_vma=False))

        def run(r):
            for _ in range(r):
                for o in f(*xs):
                    o.block_until_ready()
        return per_op(run, rank._agree(ranks)) / OPERANDS

    def groups_at_once(nbytes: int) -> float:
        """An all-reduce over the R ranks, every device of each rank in a group of its own."""
        grid = np.array([[d for d in devices if d.process_index == r] for r in range(ranks)])
        mesh = Mesh(grid.T, ("o", "i"))
        return rank._in_modules(mesh, collective_step("all-reduce", ranks),
                                filled(mesh, nbytes), 8,
                                lambda run: per_op(run, rank._agree(ranks)))

    rows = []
    for _ in range(rounds):
        for nbytes in SIZES:
            row = {"bytes": nbytes,
                   "after a dot each": rank.collective("all-reduce", nbytes, ranks, k, True),
                   "in a row": operands_of(nbytes, False),
                   "combined": operands_of(nbytes, True),
                   "one group of R": rank.collective("all-reduce", nbytes, ranks, 1, True),
                   "K groups at once": groups_at_once(nbytes),
                   "one group, K x bytes": rank.collective("all-reduce", k * nbytes, ranks, 1,
                                                           True)}
            rows.append(row)
    comm.barrier()
    jax.distributed.shutdown()
    return rows if comm.rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--devices-per-rank", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        rows = measure(args.devices_per_rank, args.rounds)
        if rows is not None:
            Path(args.worker).write_text(json.dumps(rows))
        return
    from alpac.runtime.launcher import find_mpiexec
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([find_mpiexec(), "-n", str(args.ranks), sys.executable, __file__,
                        "--devices-per-rank", str(args.devices_per_rank), "--rounds",
                        str(args.rounds), "--worker", str(out)], check=True, env=env,
                       capture_output=True)
        rows = json.loads(out.read_text())
    table = [{"bytes per device": f"{r['bytes']:,}",
              **{name: f"{r[name] * 1e3:.2f}" for name in list(r)[1:]}} for r in rows]
    r, k = args.ranks, args.devices_per_rank
    write_results(f"collective_forms_{r}x{k}",
                  f"All-reduce across {r} ranks x {k} devices, ms per collective, by form",
                  table,
                  f"Multi-process jax with gloo, as alpa-run runs. Columns: over all {r * k} "
                  f"devices, after a dot each (the form `alpac calibrate` times), {OPERANDS} in "
                  f"a row, and one all-reduce of {OPERANDS} operands (XLA's combiner), per "
                  f"operand; over the {r} ranks one device each, the rank's other devices idle "
                  f"(the calibrated inter_node table), {k} such groups at once (data "
                  f"parallelism across ranks beside tensor parallelism inside), and one group "
                  f"carrying {k}x the bytes (how the cost model prices the {k} at once). "
                  f"{args.rounds} rounds. `python bench_collective_forms.py --ranks {r} "
                  f"--devices-per-rank {k}` (from benchmarks/).")


if __name__ == "__main__":
    main()
