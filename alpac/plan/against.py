"""`alpac explain PLAN --against report.json`: the plan's estimates next to what `alpa-run
--report` measured (per stage busy time, per module execution, the iteration), so the cost
model can be held against a clock."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from alpac.errors import UserError
from alpac.plan.io import plan_identity
from alpac.plan.trace import module_estimates, stage_busy_estimate
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
        report = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"cannot read the report: {e.strerror}", path=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"corrupt report: {e}", path=str(path)) from None
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


def _counted(report: dict) -> str:
    n = report["iterations"]
    return f"{n - 1}, the first excluded" if n > 1 else str(n)


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3g}x"
