"""The trip count of a while loop, for the costs (`alpac.analysis.costs`).

From `known_trip_count` in the backend config when XLA wrote one; otherwise from the usual
counter pattern: a tuple element initialised to a constant, compared with a loop-invariant
constant in the condition, stepped by a constant in the body. When only the limit is known the
counter is assumed to start at 0 and step by 1; when not even that, the loop counts once. Both
are estimates.
"""

from __future__ import annotations

import math
import re

from alpac.hlo.ir import Computation, Instruction
from alpac.hlo.opcodes import RESHAPES, VALUE_COPIES

_KNOWN_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "EQ": "EQ", "NE": "NE"}
# ops that keep a scalar counter's value: the loop pattern is read through them
_THROUGH = VALUE_COPIES | RESHAPES


def while_trip_count(loop: Instruction) -> tuple[int, bool]:
    """(trip count, whether it is an estimate) of a while instruction."""
    known = _KNOWN_TRIP_COUNT.search(str(loop.attrs.get("backend_config", "")))
    if known:
        return int(known.group(1)), False
    cond, body = loop.called("condition"), loop.called("body")
    compare = through(cond.root)
    if compare.opcode != "compare" or len(compare.operands) != 2:
        return 1, True
    direction = str(compare.attrs.get("direction", ""))
    lhs, rhs = compare.operands
    index = _param_index(lhs, cond)
    if index is None:
        lhs, rhs, direction = rhs, lhs, _FLIP.get(direction, "")
        index = _param_index(lhs, cond)
    limit = _invariant_value(rhs, cond, loop)
    if index is None or limit is None:
        return 1, True
    start = _element_value(loop.operands[0], index)
    step = _counter_step(body, index)
    if start is None or step is None:
        return max(0, math.ceil(limit)), True
    n = _iterations(start, limit, step, direction)
    return (1, True) if n is None else (n, False)


def loop_counter(loop: Instruction) -> tuple[int, float, float] | None:
    """(state index, start, step) of the loop's counter: the element its condition compares,
    starting at a constant and stepped by a constant in the body."""
    compare = through(loop.called("condition").root)
    if compare.opcode != "compare" or len(compare.operands) != 2:
        return None
    for operand in compare.operands:
        index = _param_index(operand, loop.called("condition"))
        if index is not None:
            start = _element_value(loop.operands[0], index)
            step = _counter_step(loop.called("body"), index)
            return None if start is None or step is None else (index, start, step)
    return None


def through(instr: Instruction) -> Instruction:
    """The value `instr` copies or reshapes (itself if it does neither): loop patterns are
    read through such ops."""
    while instr.opcode in _THROUGH and instr.operands:
        instr = instr.operands[0]
    return instr


def _param_index(instr: Instruction, comp: Computation) -> int | None:
    """k when `instr` is element k of `comp`'s tuple parameter."""
    instr = through(instr)
    if (instr.opcode == "get-tuple-element" and instr.operands[0].opcode == "parameter"
            and instr.operands[0].parent is comp):
        return instr.tuple_index
    return None


def _element_value(init: Instruction, index: int) -> float | None:
    """The constant the loop tuple's element `index` starts with, if it is one."""
    init = through(init)
    if init.opcode != "tuple" or index >= len(init.operands):
        return None
    return through(init.operands[index]).scalar_constant()


def _invariant_value(instr: Instruction, cond: Computation, loop: Instruction) -> float | None:
    """A constant, or a tuple element the body passes through unchanged from a constant."""
    value = through(instr).scalar_constant()
    if value is not None:
        return value
    index = _param_index(instr, cond)
    body = loop.called("body")
    if index is None or body.root.opcode != "tuple":
        return None
    if _param_index(body.root.operands[index], body) != index:
        return None
    return _element_value(loop.operands[0], index)


def _counter_step(body: Computation, index: int) -> float | None:
    root = body.root
    if root.opcode != "tuple" or index >= len(root.operands):
        return None
    update = through(root.operands[index])
    if update.opcode not in ("add", "subtract") or len(update.operands) != 2:
        return None
    a, b = update.operands
    if _param_index(a, body) == index:
        step = through(b).scalar_constant()
    elif update.opcode == "add" and _param_index(b, body) == index:
        step = through(a).scalar_constant()
    else:
        return None
    if step is None:
        return None
    return -step if update.opcode == "subtract" else step


def _iterations(start: float, limit: float, step: float, direction: str) -> int | None:
    if step > 0 and direction in ("LT", "LE"):
        span = limit - start + (step if direction == "LE" else 0)
        return max(0, math.ceil(span / step) if direction == "LT" else math.floor(span / step))
    if step < 0 and direction in ("GT", "GE"):
        span = start - limit + (-step if direction == "GE" else 0)
        return max(0, math.ceil(span / -step) if direction == "GT"
                   else math.floor(span / -step))
    if direction == "NE" and step and (limit - start) / step >= 0:
        n = (limit - start) / step
        return int(n) if n == int(n) else None
    return None
