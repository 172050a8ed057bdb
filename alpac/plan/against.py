"""`alpac explain PLAN --against report.json`: the plan's estimates next to what `alpa-run
--report` measured (per stage busy time, per module execution, the iteration), so the cost
model can be held against a clock; and per rank, where its iteration went (modules,
transfers, waiting for other ranks, the rest), so a gap shows whether the compute was priced
wrong or the ranks waited on each other more than the pipeline's formula says."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from alpac.errors import UserError
from alpac.hlo.limits import REPORT_BYTES_MAX, read_bounded
from alpac.plan.io import parse_json, plan_identity
from alpac.plan.trace import (fed_and_freed_seconds, module_estimates, stage_busy_estimate,
                              transfer_seconds)
from alpac.units import duration


@dataclass(frozen=True)
class Row:
    what: str
    per: str  # what one figure covers: an iteration or an execution
    estimated: float
    measured: float

    @property
    def ratio(self) -> float | None:
        """Measured over estimated (above 1: slower than the plan said)."""
        return self.measured / self.estimated if self.estimated > 0 else None


def load_report(path: Path, plan: dict) -> dict:
    """The report of a run of this plan (UserError if unreadable or of another plan)."""
    try:
        text = read_bounded(path, REPORT_BYTES_MAX, "report").decode()
    except OSError as e:
        raise UserError(f"cannot read the report: {e.strerror}", path=str(path)) from None
    except UnicodeDecodeError as e:
        raise UserError(f"corrupt report: {e}", path=str(path)) from None
    report = parse_json(text, path, "report")
    if not isinstance(report, dict) or "median_iteration_time_s" not in report:
        raise UserError("not an alpa-run --report file", path=str(path))
    mine = plan_identity(plan)
    for key, what in (("source_sha256", "source"), ("program_sha256", "program")):
        if report.get(key) != mine[key]:
            theirs = str(report.get(key) or "none")[:12]
            raise UserError(f"the report is of another plan (its {what} hash is {theirs}, this "
                            f"plan's {mine[key][:12]}); run alpa-run --report on this plan",
                            path=str(path))
    return report


def compare(plan: dict, report: dict) -> list[Row]:
    """The iteration, each mesh's busy time per iteration, each module's time per execution."""
    rows = [Row("iteration (median)", "iteration", plan["estimate"]["iteration_time_s"],
                measured_iteration(report))]
    by_index = {s["index"]: s for s in plan["stages"]}
    for mesh in report["stages"]:
        stages = [by_index[s] for s in mesh["stages"] if s in by_index]
        if mesh["busy_s"] and stages:
            label = ",".join(str(s["index"]) for s in stages)
            rows.append(Row(f"stage {label} busy (mesh {mesh['mesh']})", "iteration",
                            sum(stage_busy_estimate(plan, s) for s in stages),
                            statistics.median(mesh["busy_s"])))
    estimates = module_estimates(plan)
    for m in report.get("modules", []):
        if m["name"] in estimates:
            rows.append(Row(f"{m['name']} (x{m['executions_per_step']})", "execution",
                            estimates[m["name"]], m["median_s"]))
    return rows


@dataclass(frozen=True)
class RankRow:
    """Where the iteration of the ranks that hold the same meshes went: (estimated,
    measured) seconds per part, measured as the median over those ranks of each one's."""
    ranks: str  # "2" or "0-7"
    stages: str  # "mesh: stages; ..." of the meshes they hold devices of
    parts: dict[str, tuple[float, float]]


PARTS = {"modules": "modules_s", "transfers": "transfers_s", "waiting": "waiting_s",
         "other": "other_s"}


def breakdown(plan: dict, report: dict) -> list[RankRow]:
    """Per group of ranks holding the same meshes: the median over them of each rank's
    median seconds per part (the first iteration excluded); estimated from their stages'
    figures: the modules' busy time, the receives and sends, the feeding of inputs (other),
    and the rest of the estimated iteration as waiting (the pipeline's bubble, the slowest
    update)."""
    by_index = {s["index"]: s for s in plan["stages"]}
    stages_of = {m["mesh"]: [by_index[s] for s in m["stages"] if s in by_index]
                 for m in report["stages"]}
    groups: dict[tuple, list[dict]] = {}
    for rank in report.get("per_rank", []):
        if any(stages_of.get(mesh) for mesh in rank["meshes"]):
            groups.setdefault(tuple(rank["meshes"]), []).append(rank)
    rows = []
    for meshes, ranks in groups.items():
        held = [s for m in meshes for s in stages_of.get(m, [])]
        estimated = _estimated_parts(plan, held)
        label = "; ".join(f"{m}: {','.join(str(s['index']) for s in stages_of[m])}"
                          for m in meshes if stages_of.get(m))
        parts = {part: (estimated[part], statistics.median(_median(r[key]) for r in ranks))
                 for part, key in PARTS.items()}
        cpu = _cpu_parts(held, ranks)
        rows.append(RankRow(_ranks(r["rank"] for r in ranks), label, {**parts, **cpu}))
    return rows


CPU_PARTS = ("alpa-run CPU", "XLA CPU")


def _cpu_parts(stages: list[dict], ranks: list[dict]) -> dict[str, tuple[float, float]]:
    """The CPU a rank used per iteration, alpa-run's own threads (its host work) and the rest
    (XLA's threads: compute, collectives), against the stages' `cpu_per_rank_s` (priced
    where ranks share a host's cores: a calibrated file); none where either is missing."""
    priced = [s["estimate"].get("cpu_per_rank_s") for s in stages]
    if not priced or None in priced or any("own_cpu_s" not in r for r in ranks):
        return {}
    own = statistics.median(_median(r["own_cpu_s"]) for r in ranks)
    rest = statistics.median(_median([c - o for c, o in zip(r["cpu_s"], r["own_cpu_s"])])
                             for r in ranks)
    return {CPU_PARTS[0]: (sum(p["host"] for p in priced), own),
            CPU_PARTS[1]: (sum(p["compute"] for p in priced), rest)}


def _estimated_parts(plan: dict, stages: list[dict]) -> dict[str, float]:
    """`breakdown`'s estimated seconds per part for ranks that hold these stages."""
    B = plan.get("num_micro_batches", 1)
    modules = sum(stage_busy_estimate(plan, s) for s in stages)
    transfers, fed = (sum(B * mb + step for mb, step in (seconds(s["estimate"])
                                                         for s in stages))
                      for seconds in (transfer_seconds, fed_and_freed_seconds))
    rest = plan["estimate"]["iteration_time_s"] - modules - transfers - fed
    return {"modules": modules, "transfers": transfers, "waiting": max(rest, 0.0),
            "other": fed}


@dataclass(frozen=True)
class HostRow:
    """A host's ranks' CPU time per iteration (the median, the first excluded) against its
    cores: `least` seconds is what the iteration needed at the least with every core busy."""
    host: str
    ranks: int
    cores: int
    cpu: float

    @property
    def least(self) -> float:
        return self.cpu / self.cores


def host_rows(report: dict) -> list[HostRow]:
    return [HostRow(h["host"], len(h["ranks"]), h["cores"], _median(h["cpu_s"]))
            for h in report.get("hosts", []) if h["cpu_s"] and h["cores"]]


SATURATED = 0.8  # a host whose cores were busy this share of the iteration set its time


def render_hosts(rows: list[HostRow], measured: float, console: Console) -> None:
    """One line per host: its ranks' CPU time, and the share of the measured iteration its
    cores needed for it. Near all of it (ranks outnumbering cores, as simulated devices do),
    the ranks waited for cores: the estimate prices compute as measured with every device
    working, but work it misses or prices low then adds to the iteration in full."""
    for h in rows:
        share = h.least / measured if measured > 0 else 0.0
        line = (f"host {h.host}: {h.ranks} rank(s) on {h.cores} core(s) used "
                f"{duration(h.cpu)} of CPU per iteration, at least {duration(h.least)} of its "
                f"cores' time: {share:.0%} of the measured iteration")
        if share >= SATURATED:
            line += ("; its cores were busy nearly throughout: the ranks competed for them, "
                     "and host work the estimate misses lengthened the iteration")
        console.print(line)


def _ranks(numbers) -> str:
    """A group's ranks as a label: 3; 0-7 for a contiguous run; else 0,2,5."""
    n = sorted(numbers)
    if len(n) > 2 and n[-1] - n[0] == len(n) - 1:
        return f"{n[0]}-{n[-1]}"
    return ",".join(map(str, n))


def _median(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def measured_iteration(report: dict) -> float:
    """The median iteration time, the first iteration (compiling, warming caches) excluded
    when there are others."""
    times = report.get("iteration_time_s") or []
    return statistics.median(times[1:]) if len(times) > 1 else report["median_iteration_time_s"]


def render(rows: list[Row], report: dict, console: Console, calibrated: bool = True) -> None:
    """One line for the iteration (and, for a plan made for a cluster without measured tables,
    what its estimates are worth), then the table."""
    it = rows[0]
    console.print(f"predicted against measured: iteration estimated {duration(it.estimated)}, "
                  f"measured {duration(it.measured)} (median of {_counted(report)}), "
                  f"measured/estimated {_ratio(it.ratio)}")
    if not calibrated:
        console.print("the plan's cluster has no calibration: its estimates price nominal "
                      "figures (peak FLOP/s, link bandwidth), not what this machine gives "
                      "programs; `alpac calibrate` measures it, and a plan compiled with that "
                      "file is priced from the measurements")
    table = Table(show_edge=False)
    for col in ("what", "per", "estimated", "measured", "measured/estimated"):
        table.add_column(col, justify="left" if col in ("what", "per") else "right")
    for r in rows:
        table.add_row(r.what, r.per, duration(r.estimated), duration(r.measured),
                      _ratio(r.ratio))
    console.print(table)


def render_breakdown(rows: list[RankRow], console: Console) -> None:
    """Per group of ranks, two lines: the estimated and the measured seconds of each part."""
    if not rows:
        return
    console.print("where each rank's iteration went (medians, over the ranks holding the same "
                  "meshes too; estimated waiting: the rest of the estimated iteration; other: "
                  "feeding inputs, zeroing, moving outputs to the next step, freeing, "
                  "bookkeeping, of which the plan prices the feeding and the freeing)")
    table = Table(show_edge=False)
    for col in ("ranks", "meshes: stages", "", *PARTS):
        table.add_column(col, justify="right" if col in PARTS else "left")
    for r in rows:
        table.add_row(r.ranks, r.stages, "estimated", *(duration(r.parts[p][0]) for p in PARTS))
        table.add_row("", "", "measured", *(duration(r.parts[p][1]) for p in PARTS))
    console.print(table)
    cpu = [r for r in rows if CPU_PARTS[0] in r.parts]
    if not cpu:
        return
    console.print("the CPU time each rank used per iteration: alpa-run's own threads (the host "
                  "work above) and the rest of its process (XLA's threads: the modules' compute "
                  "and their waking for a launch after a wait, as priced where devices share "
                  "the host's cores; and collectives, which are priced as time only; XLA may "
                  "run a one-device module on alpa-run's calling thread)")
    table = Table(show_edge=False)
    for col in ("ranks", "", *CPU_PARTS):
        table.add_column(col, justify="right" if col in CPU_PARTS else "left")
    for r in cpu:
        (host, own), (compute, rest) = (r.parts[p] for p in CPU_PARTS)
        table.add_row(r.ranks, "estimated", duration(host), duration(compute))
        table.add_row("", "measured", duration(own), duration(rest))
    console.print(table)


def _counted(report: dict) -> str:
    n = report["iterations"]
    return f"{n - 1}, the first excluded" if n > 1 else str(n)


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3g}x"
