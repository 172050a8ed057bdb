"""The plan directory: `plan.json` (one versioned schema), the sharded HLO modules, and
`compile-stats.json` (timings, which differ run to run and so stay out of plan.json).

A plan directory is written atomically: everything goes into a sibling temporary directory
that replaces the target in one rename, so a reader sees the old plan or the new one, never a
mix, and a failed compile leaves the old plan untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from alpac.errors import UserError

SCHEMA = "alpac.plan/1"
PLAN_FILE = "plan.json"
STATS_FILE = "compile-stats.json"


def dumps(obj) -> str:
    """The one JSON form of plan files: sorted keys, fixed indent, trailing newline."""
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n"


def write_plan_dir(out_dir: str | Path, plan: dict, artifacts: dict[str, str],
                   stats: dict | None = None) -> Path:
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise UserError("exists and is not a directory; expected a plan directory",
                        path=str(out_dir))
    if out.is_dir() and any(out.iterdir()) and not (out / PLAN_FILE).exists():
        raise UserError("is a non-empty directory that holds no plan; refusing to replace it",
                        path=str(out_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for rel, text in sorted(artifacts.items()):
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        (tmp / PLAN_FILE).write_text(dumps({"schema": SCHEMA, **plan}))
        if stats is not None:
            (tmp / STATS_FILE).write_text(dumps(stats))
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def plan_identity(plan: dict) -> dict:
    """What ties a run's report to the plan it ran: the hashes of the source and the program."""
    program = dumps(plan.get("program")).encode()
    return {"source_sha256": (plan.get("source") or {}).get("sha256"),
            "program_sha256": hashlib.sha256(program).hexdigest()}


def load_plan(plan_dir: str | Path) -> tuple[dict, dict]:
    """(plan, stats) from a plan directory; UserError if it is missing or not a plan."""
    d = Path(plan_dir)
    path = d / PLAN_FILE
    if not d.exists():
        raise UserError("no such plan directory", path=str(plan_dir))
    if not path.exists():
        raise UserError(f"not a plan directory (no {PLAN_FILE})", path=str(plan_dir))
    try:
        plan = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"corrupt plan file: {e}", path=str(path),
                        line=getattr(e, "lineno", None), col=getattr(e, "colno", None)) from None
    if not isinstance(plan, dict) or plan.get("schema") != SCHEMA:
        found = plan.get("schema") if isinstance(plan, dict) else type(plan).__name__
        raise UserError(f"plan schema is {found!r}; this alpac reads {SCHEMA!r}", path=str(path))
    stats = {}
    if (d / STATS_FILE).exists():
        try:
            stats = json.loads((d / STATS_FILE).read_text())
        except json.JSONDecodeError:
            stats = {}
    return plan, stats
