"""The batch classes of a value, and how they combine.

Every array value of a step is one of:

- `INDEP`  — does not depend on the batch (weights, optimizer state, constants, iota);
- `ZERO`   — independent of the batch and known to be zero (a zero constant or its
  broadcast); it is both INDEP and a (trivial) sum over examples;
- `split(d, inner)` — computed example by example along dim `d`: the dim holds the batch
  (N examples) as its major part, `inner` elements per example (a reshape that merges the
  batch with the sequence gives inner = sequence length); a slice of examples gives the
  same slice of this value;
- `PSUM`   — a sum over examples: the value for the whole batch is the sum of the values of
  any split of the batch into microbatches (the loss, gradients, metrics);
- `FULL`   — needs the whole batch at once (non-linear in a sum, a max over examples, a
  value that mixes examples).

A tuple-shaped value has a tuple of classes (nested like its shape).
"""

from __future__ import annotations


class Cls:
    """One batch class; compare with `is` for the singletons, or `==` (by value)."""

    __slots__ = ("kind", "dim", "inner")

    def __init__(self, kind: str, dim: int = -1, inner: int = 1):
        self.kind = kind  # 'I' | 'Z' | 'S' | 'P' | 'F'
        self.dim = dim
        self.inner = inner

    def __eq__(self, other) -> bool:
        return (isinstance(other, Cls) and self.kind == other.kind and self.dim == other.dim
                and self.inner == other.inner)

    def __hash__(self) -> int:
        return hash((self.kind, self.dim, self.inner))

    def __repr__(self) -> str:
        if self.kind == "S":
            return f"split({self.dim})" if self.inner == 1 else f"split({self.dim}x{self.inner})"
        return {"I": "indep", "Z": "zero", "P": "psum", "F": "full"}[self.kind]

    @property
    def is_indep(self) -> bool:  # INDEP or ZERO
        return self.kind in "IZ"

    @property
    def is_split(self) -> bool:
        return self.kind == "S"

    @property
    def is_psum(self) -> bool:
        return self.kind == "P"

    @property
    def is_full(self) -> bool:
        return self.kind == "F"

    @property
    def is_sum_like(self) -> bool:  # PSUM or ZERO: adding these is linear
        return self.kind in "PZ"


INDEP = Cls("I")
ZERO = Cls("Z")
PSUM = Cls("P")
FULL = Cls("F")
_SPLITS: dict[tuple[int, int], Cls] = {}


def split(dim: int, inner: int = 1) -> Cls:
    key = (dim, inner)
    c = _SPLITS.get(key)
    if c is None:
        c = _SPLITS[key] = Cls("S", dim, inner)
    return c


def leaves(c) -> list[Cls]:
    """The array classes inside a (possibly tuple) class, in order."""
    if isinstance(c, Cls):
        return [c]
    out = []
    for x in c:
        out.extend(leaves(x))
    return out


def all_indep(c) -> bool:
    if isinstance(c, Cls):
        return c.kind in "IZ"
    return all(all_indep(x) for x in c)


def like_shape(shape, c: Cls):
    """`c` for every leaf of `shape` (a tuple class for a tuple shape)."""
    if shape.is_tuple:
        return tuple(like_shape(s, c) for s in shape.tuple_shapes)
    return c


def join(a, b):
    """The least class covering both (loop-carried values, conditional branches)."""
    if not isinstance(a, Cls) or not isinstance(b, Cls):
        if isinstance(a, Cls) or isinstance(b, Cls) or len(a) != len(b):
            return FULL
        return tuple(join(x, y) for x, y in zip(a, b))
    if a == b:
        return a
    ka, kb = a.kind, b.kind
    if "F" in (ka, kb):
        return FULL
    if {ka, kb} == {"I", "Z"}:
        return INDEP
    if {ka, kb} == {"P", "Z"}:
        return PSUM
    if ka == "S" and kb in "IZ":
        return a
    if kb == "S" and ka in "IZ":
        return b
    return FULL  # split vs psum, splits on different dims, indep + psum (affine)


def to_json(c):
    if isinstance(c, Cls):
        return repr(c)
    return [to_json(x) for x in c]
