"""The plan directory: `plan.json` (one versioned schema), the sharded HLO modules, and
`compile-stats.json` (timings, which differ run to run and so stay out of plan.json).

A plan directory is written atomically: everything goes into a sibling temporary directory
that replaces the target in one rename, so a reader sees the old plan or the new one, never a
mix, and a failed compile leaves the old plan untouched. The temporary directories are named
after the process that made them, so that the next compile to the same target removes those
of a killed compile (`_remove_leftovers`). Every other file alpac and alpa-run
write (outputs, reports, traces, cluster files) replaces its target the same way, one file at
a time (`replacing`).

A plan is read as untrusted input: each file it names, and the fixed ones, must be a regular
file inside the plan directory (a symlink only to one) within a size bound (`plan_file`),
checked before anything opens it, so that a plan cannot make alpac or alpa-run read outside
its directory, nor block on a FIFO or read a device without end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterator

from alpac import __version__
from alpac.errors import UserError
from alpac.hlo.limits import too_deep_at
from alpac.procs import started

SCHEMA = "alpac.plan/1"
PLAN_FILE = "plan.json"
STATS_FILE = "compile-stats.json"
SOURCE_FILE = "source.hlo"
# size bounds of a plan's files: HLO text with large constants, and JSON (plan.json, a stage's
# per-instruction decisions, the stats); far above what alpac writes, far below a device's flood
MODULE_BYTES_MAX = 8 << 30
JSON_BYTES_MAX = 1 << 30
# bounds on what a plan's JSON may hold, far above what alpac writes (plan.json nests 8 deep;
# Megatron's largest runs have 64 stages of 1,536 microbatches): a tampered plan is refused in
# one line instead of recursing past Python's stack or making a reader allocate without end
JSON_DEPTH_MAX = 64
MICRO_BATCHES_MAX = 1 << 16
PIPELINE_TASKS_MAX = 1 << 22  # stages x microbatches: the tasks a schedule lists
_KINDS = {stat.S_IFDIR: "directory", stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device",
          stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket"}


def dumps(obj) -> str:
    """The one JSON form of plan files: sorted keys, fixed indent, trailing newline."""
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n"


# ---- writing -------------------------------------------------------------------------------

def write_plan_dir(out_dir: str | Path, plan: dict, artifacts: dict[str, str],
                   stats: dict | None = None) -> Path:
    out = Path(out_dir).resolve()
    _remove_leftovers(out)
    if out.exists() and not out.is_dir():
        raise UserError("exists and is not a directory; expected a plan directory",
                        path=str(out_dir))
    if out.is_dir() and any(out.iterdir()) and not (out / PLAN_FILE).exists():
        raise UserError("is a non-empty directory that holds no plan; refusing to replace it",
                        path=str(out_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{_creator()}-", dir=out.parent))
    try:
        files = {**artifacts, PLAN_FILE: dumps({"schema": SCHEMA, **plan})}
        if stats is not None:
            files[STATS_FILE] = dumps(stats)
        for rel, text in sorted(files.items()):
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                f.write(text.encode())
                _sync_file(f)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{_creator()}"
            os.rename(out, old)
        os.rename(tmp, out)
        _sync_directory(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _creator() -> str:
    """What names this process in the names of its temporary directories: this host, its pid
    and its start time (which tells it from a later process given the same pid)."""
    host = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
    return f"{host}-{os.getpid()}-{started(os.getpid())}"


def _remove_leftovers(out: Path) -> None:
    """Remove what compiles to `out` that were killed left beside it (`.NAME.tmp-CREATOR-*`,
    a plan half written; `.NAME.old-CREATOR`, the plan it replaced), never what a compile still
    running on this host has there. A previous plan hidden by a compile killed between its two
    renames, with nothing at `out` since, is put back in place instead."""
    pattern = re.compile(re.escape(f".{out.name}.")
                         + r"(tmp|old)-([0-9a-f]{8})-(\d+)-(\d+)(-.*)?")
    host = _creator().split("-", 1)[0]
    try:
        names = sorted(e.name for e in os.scandir(out.parent))
    except OSError:
        return
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or m[2] != host or started(int(m[3])) == m[4]:
            continue  # not a leftover, another host's, or its compile is running
        path = out.parent / name
        if m[1] == "old" and not os.path.lexists(out):
            try:
                os.rename(path, out)
                continue
            except OSError:
                pass
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def replacing(path: str | Path, what: str) -> Iterator[BinaryIO]:
    """A binary file whose content replaces `path` whole when the block ends: written to a
    temporary file beside it, synced, renamed over it, so that a reader sees the old file or
    the new one, never a torn one. On an error the temporary file goes and the old file
    stays; an OSError becomes a UserError naming `what` (e.g. "report") and the path."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_umask())  # as a plain open would make it
        with os.fdopen(fd, "wb") as f:
            yield f
            _sync_file(f)
        os.replace(tmp, path)
        tmp = None
        _sync_directory(path.parent)
    except OSError as e:
        raise UserError(f"cannot write the {what}: {e.strerror or e}", path=str(path)) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def write_replacing(path: str | Path, text: str, what: str) -> None:
    """`text` as the new content of `path` (see `replacing`)."""
    with replacing(path, what) as f:
        f.write(text.encode())


def _sync_file(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def _sync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (where the file system allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """This process's umask, read without setting it (another thread may be creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def plan_identity(plan: dict) -> dict:
    """What ties a run's report to the plan it ran: the hashes of the source and the program."""
    program = dumps(plan.get("program")).encode()
    return {"source_sha256": (plan.get("source") or {}).get("sha256"),
            "program_sha256": hashlib.sha256(program).hexdigest()}


# ---- reading -------------------------------------------------------------------------------

def _written_by(plan) -> str:
    compiler = plan.get("compiler") if isinstance(plan, dict) else None
    version = compiler.get("version") if isinstance(compiler, dict) else None
    return f" (written by alpac {version})" if isinstance(version, str) else ""


def load_plan(plan_dir: str | Path) -> tuple[dict, dict]:
    """(plan, stats) from a plan directory; UserError if it is missing or not a plan, or if a
    file it names, or its source.hlo, is not a regular file inside it (`plan_file`)."""
    d = Path(plan_dir)
    if not d.is_dir():
        raise UserError("no such plan directory" if not d.exists() else
                        "is not a directory; expected a plan directory", path=str(plan_dir))
    if not os.path.lexists(d / PLAN_FILE):
        raise UserError(f"not a plan directory (no {PLAN_FILE})", path=str(plan_dir))
    path = d / PLAN_FILE
    plan = parse_json(read_plan_text(d, PLAN_FILE, PLAN_FILE), path, "plan file")
    if not isinstance(plan, dict) or plan.get("schema") != SCHEMA:
        found = plan.get("schema") if isinstance(plan, dict) else type(plan).__name__
        raise UserError(f"plan schema is {found!r}{_written_by(plan)}; this alpac "
                        f"({__version__}) reads {SCHEMA!r}: compile the plan again",
                        path=str(path))
    for what, name in named_files(plan, path):
        plan_file(d, name, what)
    _check_counts(plan, path)
    if os.path.lexists(d / SOURCE_FILE):
        plan_file(d, SOURCE_FILE, "source module")
    stats = {}
    if os.path.lexists(d / STATS_FILE):
        text = read_plan_text(d, STATS_FILE, STATS_FILE)
        try:
            stats = parse_json(text, d / STATS_FILE, STATS_FILE)
        except UserError:  # timings only: a plan without them still reads
            stats = {}
    return plan, stats


_JSON_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'  # (its brackets nest nothing)


def parse_json(text: str, path: str | Path, what: str):
    """`text` (of the file `path`, a `what`: "report") as JSON; UserError naming the file and
    the line if it is not JSON or nests deeper than JSON_DEPTH_MAX (measured before parsing,
    as Python's parser recurses per level)."""
    offset = too_deep_at(text, "[]{}", _JSON_STRING, JSON_DEPTH_MAX)
    if offset is not None:
        raise UserError(f"the {what} nests deeper than {JSON_DEPTH_MAX} levels, more than "
                        f"alpac reads", path=str(path), line=text.count("\n", 0, offset) + 1)
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError with its place, or a number of 5,000 digits
        raise UserError(f"corrupt {what}: {e}", path=str(path), line=getattr(e, "lineno", None),
                        col=getattr(e, "colno", None)) from None


def _check_counts(plan: dict, where: Path) -> None:
    """UserError unless the plan's microbatches, and its pipeline's tasks, are within their
    bounds: a tampered count must not make a reader allocate without end."""
    program = plan.get("program") or {}
    stages = max(len(plan.get("stages") or []), len(program.get("modules") or []), 1)
    for key, holder in (("num_micro_batches", plan), ("program.num_micro_batches", program)):
        count = holder.get("num_micro_batches", 1)
        if isinstance(count, bool) or not isinstance(count, int) or \
                not 1 <= count <= MICRO_BATCHES_MAX:
            raise UserError(f"{key} is {str(count)[:40]}; expected a whole number from 1 to "
                            f"{MICRO_BATCHES_MAX:,}", path=str(where))
        if count * stages > PIPELINE_TASKS_MAX:
            raise UserError(f"{key} is {count} over {stages} stages or modules, more than the "
                            f"{PIPELINE_TASKS_MAX:,} tasks of a pipeline alpac reads",
                            path=str(where))


def named_files(plan: dict, where: Path) -> list[tuple[str, str]]:
    """(what, name) of each file plan.json names: the stages' modules and decisions, the
    program's modules."""
    try:
        named = []
        for stage in plan.get("stages") or []:
            named += [(f"{key} file", stage[key]) for key in ("module", "decisions")
                      if key in stage]
            named += [("module file", name) for name in (stage.get("modules") or {}).values()]
        program = plan.get("program") or {}
        named += [("module file", m["file"]) for m in program.get("modules", [])]
    except (AttributeError, KeyError, TypeError) as e:
        raise UserError(f"the plan's stages or program are malformed: {type(e).__name__}: {e}",
                        path=str(where)) from None
    return named


def plan_file(plan_dir: str | Path, name, what: str) -> Path:
    """The resolved path of the file `name` of the plan in `plan_dir`, checked before anything
    opens it: UserError unless `name` is relative without '..', and it is (or is a symlink to)
    a regular file inside the directory within its size bound. `what` names it in errors
    ("module file")."""
    where = str(Path(plan_dir) / PLAN_FILE)
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or parts[0] == "/" or ".." in parts or "\0" in name:
        raise UserError(f"names the {what} {name!r}; expected a file name inside the plan "
                        f"directory (relative, without '..')", path=where)
    path = Path(plan_dir) / name
    if not os.path.lexists(path):
        raise UserError(f"the plan's {what} {name} is missing", path=where)
    try:
        target = path.resolve(strict=True)
        info = os.stat(target)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise UserError(f"cannot read the plan's {what}: {getattr(e, 'strerror', e)}",
                        path=str(path)) from None
    if not target.is_relative_to(Path(plan_dir).resolve()):
        raise UserError(f"is a symlink to {target}, outside the plan directory; expected the "
                        f"plan's {what} inside it", path=str(path))
    _check_regular(info, path, what)
    return target


def read_plan_text(plan_dir: str | Path, name: str, what: str) -> str:
    """The text of the plan's file `name`, checked by `plan_file` (UserError otherwise)."""
    path = Path(plan_dir) / name
    try:
        checked = plan_file(plan_dir, name, what)
        fd = os.open(checked, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO never blocks
        with os.fdopen(fd, "rb") as f:
            _check_regular(os.fstat(f.fileno()), path, what)  # the file checked is the one read
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read the plan's {what}: {e.strerror}",
                        path=str(path)) from None
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise UserError(f"the plan's {what} is not UTF-8 text (byte {e.start})",
                        path=str(path)) from None


def _check_regular(info: os.stat_result, path: Path, what: str) -> None:
    kind = stat.S_IFMT(info.st_mode)
    if kind != stat.S_IFREG:
        raise UserError(f"is a {_KINDS.get(kind, 'special file')}; expected a regular "
                        f"file, the plan's {what}", path=str(path))
    bound = JSON_BYTES_MAX if path.name.endswith(".json") else MODULE_BYTES_MAX
    if info.st_size > bound:
        raise UserError(f"is {info.st_size} bytes; the plan's {what} may be at most "
                        f"{bound >> 30} GiB", path=str(path))
