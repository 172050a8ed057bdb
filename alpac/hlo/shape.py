"""HLO shapes: arrays (element type, dims, optional layout) and tuples of shapes.

The layout is kept as the exact text XLA printed (tiling, memory space and all), so that a
module prints back the way it came in; `minor_to_major` reads the part passes need.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from alpac.hlo.limits import ELEMENTS_MAX, RANK_MAX, TUPLE_DEPTH_MAX, clipped, within

# Bits per element; sub-byte types are packed when counting bytes.
ELEMENT_BITS = {
    "pred": 8, "s2": 2, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u2": 2, "u4": 4, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f8e5m2": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3fnuz": 8,
    "f8e4m3": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
    "token": 0, "opaque": 0,
}
FLOAT_TYPES = frozenset(t for t in ELEMENT_BITS if t.startswith(("f", "bf", "c")))


@dataclass(frozen=True)
class Shape:
    """An array shape when `tuple_shapes` is None, otherwise a tuple of shapes."""

    dtype: str = "tuple"
    dims: tuple[int, ...] = ()
    layout: str | None = None  # text between the braces after the dims, verbatim
    tuple_shapes: tuple["Shape", ...] | None = None
    dynamic_dims: tuple[bool, ...] = ()  # True where XLA printed `<=N` (bounded dynamic)

    @staticmethod
    def array(dtype: str, dims, layout: str | None = None) -> "Shape":
        return Shape(dtype, tuple(int(d) for d in dims), layout)

    @staticmethod
    def tuple_of(shapes) -> "Shape":
        return Shape("tuple", (), None, tuple(shapes))

    @property
    def is_tuple(self) -> bool:
        return self.tuple_shapes is not None

    @property
    def nesting(self) -> int:
        """Tuples around the deepest array (0 for an array), bounded by TUPLE_DEPTH_MAX."""
        return 1 + max((s.nesting for s in self.tuple_shapes), default=0) if self.is_tuple else 0

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def element_bits(self) -> int:
        return ELEMENT_BITS.get(self.dtype, 32)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_TYPES

    @property
    def byte_size(self) -> int:
        """Bytes of the whole value; a tuple counts its leaves (not its pointer table)."""
        if self.is_tuple:
            return sum(s.byte_size for s in self.tuple_shapes)
        return (self.num_elements * self.element_bits + 7) // 8

    def leaves(self) -> list[tuple[tuple[int, ...], "Shape"]]:
        """(shape index, array shape) for every array inside, in order."""
        if not self.is_tuple:
            return [((), self)]
        out = []
        for i, s in enumerate(self.tuple_shapes):
            out.extend(((i,) + idx, leaf) for idx, leaf in s.leaves())
        return out

    def subshape(self, index) -> "Shape":
        s = self
        for i in index:
            s = s.tuple_shapes[i]
        return s

    @property
    def minor_to_major(self) -> tuple[int, ...] | None:
        if self.layout is None:
            return None
        head = self.layout.split(":", 1)[0].strip()
        return tuple(int(x) for x in head.split(",") if x.strip()) if head else ()

    def with_dims(self, dims) -> "Shape":
        """Same element type, new dims; the layout is kept only if it still fits."""
        dims = tuple(int(d) for d in dims)
        layout = self.layout if len(dims) == len(self.dims) else None
        return Shape(self.dtype, dims, layout)

    def without_layout(self) -> "Shape":
        if self.is_tuple:
            return Shape.tuple_of(s.without_layout() for s in self.tuple_shapes)
        return Shape(self.dtype, self.dims)

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(s) for s in self.tuple_shapes) + ")"
        dims = ",".join(("<=" if dyn else "") + str(d)
                        for d, dyn in zip(self.dims, self.dynamic_dims or (False,) * self.rank))
        text = f"{self.dtype}[{dims}]"
        if self.layout is not None:
            text += "{" + self.layout + "}"
        return text


_ARRAY = re.compile(r"\s*([a-z][a-z0-9]*)\[([^\]]*)\]")
_INDEX_COMMENT = re.compile(r"/\*.*?\*/", re.S)


class ShapeSyntaxError(ValueError):
    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


def parse_shape(text: str, pos: int = 0) -> tuple[Shape, int]:
    """Parse one shape starting at `pos`; return it and the position after it."""
    return _parse_shape(text, pos, 0)


def _parse_shape(text: str, pos: int, depth: int) -> tuple[Shape, int]:
    """A shape `depth` tuples deep (refused past TUPLE_DEPTH_MAX, before Python's stack)."""
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t":
            pos += 1
        if not text.startswith("/*", pos):
            break
        end = text.find("*/", pos)
        if end < 0:
            raise ShapeSyntaxError("unterminated comment in shape", pos)
        pos = end + 2
    if pos < n and text[pos] == "(":
        if depth == TUPLE_DEPTH_MAX:
            raise ShapeSyntaxError(f"tuple shape nested more than {TUPLE_DEPTH_MAX} deep", pos)
        pos += 1
        elems = []
        while True:
            while pos < n and text[pos] in " \t\n":
                pos += 1
            if text.startswith("/*", pos):
                pos = text.find("*/", pos) + 2
                continue
            if pos < n and text[pos] == ")":
                return Shape.tuple_of(elems), pos + 1
            shape, pos = _parse_shape(text, pos, depth + 1)
            elems.append(shape)
            while pos < n and text[pos] in " \t\n":
                pos += 1
            if pos < n and text[pos] == ",":
                pos += 1
            elif pos >= n or text[pos] != ")":
                raise ShapeSyntaxError("expected ',' or ')' in tuple shape", pos)
    m = _ARRAY.match(text, pos)
    if not m:
        if text.startswith("token[]", pos) or text.startswith("token", pos):
            return Shape("token"), pos + (7 if text.startswith("token[]", pos) else 5)
        raise ShapeSyntaxError("expected a shape like f32[8,16] or a tuple (...)", pos)
    dtype, dims_text = m.group(1), m.group(2)
    if dtype not in ELEMENT_BITS:
        raise ShapeSyntaxError(f"unknown element type '{dtype}'", m.start(1))
    dims, dyn = _dims(dims_text, m.start(2))
    pos = m.end()
    layout = None
    if pos < n and text[pos] == "{":
        end = _matching_brace(text, pos)
        if end < 0:
            raise ShapeSyntaxError("unterminated layout", pos)
        layout = text[pos + 1:end]
        pos = end + 1
    return Shape(dtype, tuple(dims), layout, None, tuple(dyn) if any(dyn) else ()), pos


def _dims(text: str, offset: int) -> tuple[list[int], list[bool]]:
    """The dimensions between an array shape's brackets and which are bounded dynamic (`<=N`),
    within XLA's bounds: RANK_MAX of them, each and their product up to ELEMENTS_MAX."""
    dims, dyn = [], []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        is_dyn = part.startswith("<=")
        num = part[2:] if is_dyn else part
        if num == "?":
            raise ShapeSyntaxError("unbounded dynamic dimensions are not supported", offset)
        if not (num.isascii() and num.isdigit()):
            raise ShapeSyntaxError(f"malformed dimension '{clipped(part)}' in shape",
                                   offset)
        if not within(num, ELEMENTS_MAX):
            raise ShapeSyntaxError(f"dimension {clipped(num)} is larger than XLA's limit "
                                   f"{ELEMENTS_MAX} (2^63 - 1)", offset)
        dims.append(int(num))
        dyn.append(is_dyn)
    if len(dims) > RANK_MAX:
        raise ShapeSyntaxError(f"array shape has {len(dims)} dimensions; at most {RANK_MAX} "
                               f"are accepted", offset)
    if math.prod(dims) > ELEMENTS_MAX:
        raise ShapeSyntaxError(f"array shape has more elements than XLA's limit {ELEMENTS_MAX} "
                               f"(2^63 - 1)", offset)
    return dims, dyn


def _matching_brace(text: str, pos: int) -> int:
    depth = 0
    for i in range(pos, min(len(text), pos + 4096)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def shape_from_string(text: str) -> Shape:
    shape, end = parse_shape(text)
    if text[end:].strip():
        raise ShapeSyntaxError("unexpected text after shape", end)
    return shape
