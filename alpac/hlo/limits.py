"""Bounds on what the HLO reader accepts, far above any real model: a small hostile file must
be refused in one line, not recurse past Python's stack (or XLA's) or allocate without end.
The largest models seen nest tuples 1 deep and calls 8 deep, have rank 5 and 42,000
instructions. `too_deep_at` measures the nesting of text before a recursive parser reads it
(StableHLO here, JSON in alpac.plan.io). `read_bounded` reads a file a user names (a model,
a report) within its size bound, checked before the file is read."""

from __future__ import annotations

import os
import re
import stat
from itertools import accumulate
from pathlib import Path

from alpac.errors import UserError

TUPLE_DEPTH_MAX = 64  # tuple shapes inside tuple shapes
CALL_DEPTH_MAX = 64  # computations calling computations (while bodies, to_apply, branches)
RANK_MAX = 64  # dimensions of one array shape
ELEMENTS_MAX = 2**63 - 1  # elements of one dimension and of one array: XLA's int64
INSTRUCTIONS_MAX = 10_000_000  # in one module
PARAMETERS_MAX = 1_000_000  # parameter numbers of one computation are below this
# brackets nested in StableHLO text, which XLA's MLIR parser reads recursively in C++: a tuple
# type 5,000 deep overflows its stack (a segfault); 2,000 still reads
MLIR_DEPTH_MAX = 256
# bytes of a model file (HLO text, an HloModuleProto, StableHLO): the largest module in
# testdata is 0.9 MB of text, a GPT-3-sized step some tens of MB; 4 GiB leaves room for weights
# printed as constants (a protobuf message stops at 2 GiB), and is what a plan's source may be
MODEL_BYTES_MAX = 4 << 30
# bytes of an `alpa-run --report` file read by `explain --against`: a report of a 64-stage
# plan is under 1 MB; parsed, JSON takes about 10 times its size in memory
REPORT_BYTES_MAX = 256 << 20
_KINDS = {stat.S_IFDIR: "directory", stat.S_IFCHR: "character device",
          stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket"}


def within(digits: str, limit: int) -> bool:
    """Whether the decimal `digits` are a number up to `limit`, judged without converting
    thousands of digits (which Python refuses)."""
    return len(digits.lstrip("0")) <= len(str(limit)) and int(digits) <= limit


def clipped(text: str, most: int = 40) -> str:
    """`text` as an error message quotes it: cut after `most` characters."""
    return text if len(text) <= most else text[:most] + "..."


def too_deep_at(text: str, brackets: str, skip: str, limit: int) -> int | None:
    """The offset where `text` first nests more than `limit` deep in `brackets` (pairs of
    opener and closer: "[]{}"), leaving out what the regex `skip` matches (strings, comments);
    None where it never does. Counted at C speed, about as fast as parsing; walked one by one
    only where it goes too deep, to find the place."""
    level = {c: 1 if i % 2 == 0 else -1 for i, c in enumerate(brackets)}
    outside = re.sub(skip, "", text)
    kept = re.sub(f"[^{re.escape(brackets)}]+", "", outside)
    if max(accumulate(map(level.__getitem__, kept)), default=0) <= limit:
        return None
    depth = 0
    for m in re.finditer(f"{skip}|[{re.escape(brackets)}]", text):
        depth += level.get(m.group(), 0)
        if depth > limit:
            return m.start()
    return None


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of the file at `path` (a `what`: "model file"), refused in one line
    (UserError) past `limit` bytes: a regular file by its size, before it is read (so a huge
    or sparse file costs nothing); a pipe while it is read. A device, directory or socket is
    refused (its reading never ends, or fails), and a FIFO no one writes reads as empty
    instead of blocking. OSError goes to the caller."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO does not wait for a writer
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        kind = stat.S_IFMT(info.st_mode)
        if kind in _KINDS:
            raise UserError(f"is a {_KINDS[kind]}; expected a {what}", path=str(path))
        if kind == stat.S_IFREG and info.st_size > limit:
            raise UserError(f"is {info.st_size} bytes ({info.st_size / 2**30:.1f} GiB); a "
                            f"{what} may be at most {_size(limit)}", path=str(path))
        os.set_blocking(fd, True)
        if kind == stat.S_IFREG:
            return f.read()
        chunks, total = [], 0  # a pipe: what its writer sends, up to the bound
        while chunk := f.read1(1 << 20):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise UserError(f"is more than {_size(limit)}; a {what} may be at most "
                                f"{_size(limit)}", path=str(path))
        return b"".join(chunks)


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"
