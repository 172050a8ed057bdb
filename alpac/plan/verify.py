"""What XLA actually did: collectives in a compiled (SPMD-partitioned) module."""

from __future__ import annotations

from collections import defaultdict

from alpac.hlo import parse_hlo
from alpac.hlo.opcodes import ASYNC_COLLECTIVES, PLANNED_COLLECTIVES

# opcode -> the collective it performs (an asynchronous start counts as its collective)
_KINDS = {**{op: op for op in sorted(PLANNED_COLLECTIVES)},
          **{op + "-start": op for op in sorted(ASYNC_COLLECTIVES)}}


def compiled_collectives(text: str) -> dict[str, dict]:
    """kind -> {count, bytes}: every collective in the module once (loop bodies once), bytes of
    its result on one device. A collective XLA combined from several (a tuple-shaped
    all-reduce) counts once per operand."""
    out: dict[str, dict] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for instr in parse_hlo(text, "<compiled>").instructions():
        kind = _KINDS.get(instr.opcode)
        if kind is None:
            continue
        shape = instr.shape
        if instr.opcode.endswith("-start") and shape.is_tuple:
            shape = shape.tuple_shapes[-1]  # (operands, results, ...) of an async start
        # a combined all-reduce counts per operand; an all-to-all is one exchange however
        # many parts XLA writes it in
        out[kind]["count"] += 1 if kind == "all-to-all" else len(shape.leaves())
        out[kind]["bytes"] += shape.byte_size
    return dict(sorted(out.items()))
