"""Bounds on what the HLO reader accepts, far above any real model: a small hostile file must
be refused in one line, not recurse past Python's stack (or XLA's) or allocate without end.
The largest models seen nest tuples 1 deep and calls 8 deep, have rank 5 and 42,000
instructions. `too_deep_at` measures the nesting of text before a recursive parser reads it
(StableHLO here, JSON in alpac.plan.io)."""

from __future__ import annotations

import re
from itertools import accumulate

TUPLE_DEPTH_MAX = 64  # tuple shapes inside tuple shapes
CALL_DEPTH_MAX = 64  # computations calling computations (while bodies, to_apply, branches)
RANK_MAX = 64  # dimensions of one array shape
ELEMENTS_MAX = 2**63 - 1  # elements of one dimension and of one array: XLA's int64
INSTRUCTIONS_MAX = 10_000_000  # in one module
PARAMETERS_MAX = 1_000_000  # parameter numbers of one computation are below this
# brackets nested in StableHLO text, which XLA's MLIR parser reads recursively in C++: a tuple
# type 5,000 deep overflows its stack (a segfault); 2,000 still reads
MLIR_DEPTH_MAX = 256


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
