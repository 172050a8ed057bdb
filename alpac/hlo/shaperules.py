"""The shape rules of the load-time check (`shapecheck`) for array ops, one per opcode family.

Each rule takes an instruction and returns the shape its operands and attributes give (None:
nothing to compare), or raises `_Bad` saying what is wrong with it; `ARRAY_RULES` maps opcodes
to rules. The rules of the module's structure (tuples, calls, loops, constants) and the check
itself are in `shapecheck`.
"""

from __future__ import annotations

import re

from alpac.hlo.ir import Instruction
from alpac.hlo.opcodes import ELEMENTWISE_BINARY, ELEMENTWISE_UNARY
from alpac.hlo.shape import ELEMENT_BITS, Shape


class _Bad(Exception):
    """The instruction is wrong: the text follows `'name' ` in the message."""


# ---- helpers ----------------------------------------------------------------------------------

def same_shape(a: Shape, b: Shape) -> bool:
    """Equal up to layout (and dynamic-dimension markers)."""
    if a.is_tuple or b.is_tuple:
        return (a.is_tuple and b.is_tuple and len(a.tuple_shapes) == len(b.tuple_shapes)
                and all(same_shape(x, y) for x, y in zip(a.tuple_shapes, b.tuple_shapes)))
    return a.dtype == b.dtype and a.dims == b.dims


def _fmt(shape: Shape) -> str:
    return str(shape.without_layout())


def _operands(instr: Instruction, n: int | None = None, at_least: int | None = None):
    ops = instr.operands
    if n is not None and len(ops) != n:
        raise _Bad(f"has {len(ops)} operands but {instr.opcode} takes {n}")
    if at_least is not None and len(ops) < at_least:
        raise _Bad(f"has {len(ops)} operands but {instr.opcode} takes at least {at_least}")
    return ops


def _arrays(instr: Instruction, n: int | None = None, at_least: int | None = None):
    ops = _operands(instr, n, at_least)
    for op in ops:
        if op.shape.is_tuple or op.shape.dtype in ("token", "opaque"):
            raise _Bad(f"has operand '{op.name}' of shape {_fmt(op.shape)} where {instr.opcode} "
                       f"takes an array")
    return [op.shape for op in ops]


def _declared_array(instr: Instruction) -> Shape:
    if instr.shape.is_tuple:
        raise _Bad(f"declares the tuple {_fmt(instr.shape)} but {instr.opcode} gives an array")
    return instr.shape


_INT_LIST = re.compile(r"\{\s*(-?\d+\s*(,\s*-?\d+\s*)*)?\}")


def _ints(instr: Instruction, key: str, default: tuple[int, ...] | None = ()) -> tuple[int, ...]:
    """An integer-list attribute `{0,1}`; `default` when absent (None: required)."""
    value = instr.attrs.get(key)
    if value is None:
        if default is None:
            raise _Bad(f"has no {key}= attribute, which {instr.opcode} needs")
        return default
    if not _INT_LIST.fullmatch(str(value).strip()):
        raise _Bad(f"has malformed {key}={value}")
    return instr.dims(key)


def _int(instr: Instruction, key: str, default: int | None = None) -> int:
    value = instr.attrs.get(key)
    if value is None:
        if default is None:
            raise _Bad(f"has no {key}= attribute, which {instr.opcode} needs")
        return default
    if not re.fullmatch(r"-?\d+", str(value).strip()):
        raise _Bad(f"has malformed {key}={value}")
    return int(str(value))


def _dims_in_range(instr: Instruction, dims, rank: int, key: str) -> None:
    for d in dims:
        if not 0 <= d < rank:
            raise _Bad(f"has {key} naming dimension {d}, out of range for rank {rank}")
    if len(set(dims)) != len(dims):
        raise _Bad(f"has {key} naming a dimension twice")


def _same_dtype(instr: Instruction, shapes) -> str:
    dtypes = [s.dtype for s in shapes]
    if len(set(dtypes)) > 1:
        raise _Bad(f"mixes element types {', '.join(dtypes)} in its operands")
    return dtypes[0]


def _callee(instr: Instruction, key: str):
    comp = instr.called(key)
    if comp is None or comp.root is None:
        raise _Bad(f"has no {key}= computation, which {instr.opcode} needs")
    return comp


# ---- elementwise ------------------------------------------------------------------------------

# Unary ops whose result type is not the operand's: fixed, or "complex->real".
_UNARY_RESULT = {"is-finite": "pred", "abs": "real", "real": "real", "imag": "real"}
_COMPLEX_PART = {"c64": "f32", "c128": "f64"}
_REAL_TO_COMPLEX = {"f32": "c64", "f64": "c128"}


def _unary(instr: Instruction) -> Shape | None:
    if instr.opcode == "copy" and len(instr.operands) == 1:
        return instr.operands[0].shape.without_layout()  # copy may copy a tuple
    (x,) = _arrays(instr, 1)
    rule = _UNARY_RESULT.get(instr.opcode)
    if instr.opcode == "convert":
        dtype = instr.shape.dtype
    elif rule == "real":
        dtype = _COMPLEX_PART.get(x.dtype, x.dtype)
    else:
        dtype = rule or x.dtype
    return Shape.array(dtype, x.dims)


def _bitcast_convert(instr: Instruction) -> Shape | None:
    (x,) = _arrays(instr, 1)
    out = _declared_array(instr)
    a, b = ELEMENT_BITS.get(x.dtype, 0), ELEMENT_BITS.get(out.dtype, 0)
    if a == b:
        return Shape.array(out.dtype, x.dims)
    if not a or not b or "pred" in (x.dtype, out.dtype):
        return None
    if a > b:
        return Shape.array(out.dtype, x.dims + (a // b,))
    if not x.dims or x.dims[-1] * a != b:
        raise _Bad(f"bitcasts {_fmt(x)} to {out.dtype}, which needs a last dimension of "
                   f"{b // a}")
    return Shape.array(out.dtype, x.dims[:-1])


def _binary(instr: Instruction) -> Shape:
    a, b = _arrays(instr, 2)
    if a.dims != b.dims:
        raise _Bad(f"has operands of shapes {_fmt(a)} and {_fmt(b)}, which {instr.opcode} "
                   f"cannot combine")
    dtype = _same_dtype(instr, (a, b))
    if instr.opcode == "compare":
        dtype = "pred"
    elif instr.opcode == "complex":
        if dtype not in _REAL_TO_COMPLEX:
            raise _Bad(f"builds a complex number from {dtype}, which needs f32 or f64")
        dtype = _REAL_TO_COMPLEX[dtype]
    return Shape.array(dtype, a.dims)


def _select(instr: Instruction) -> Shape | None:
    ops = _operands(instr, 3)
    pred, on_true, on_false = (op.shape for op in ops)
    if pred.is_tuple or pred.dtype != "pred":
        raise _Bad(f"selects on {_fmt(pred)}, which must be a pred array")
    if not same_shape(on_true.without_layout(), on_false.without_layout()):
        raise _Bad(f"selects between {_fmt(on_true)} and {_fmt(on_false)}, which differ")
    if not on_true.is_tuple and pred.rank and pred.dims != on_true.dims:
        raise _Bad(f"selects on {_fmt(pred)} between {_fmt(on_true)} values")
    return on_true.without_layout()


def _clamp(instr: Instruction) -> Shape:
    lo, x, hi = _arrays(instr, 3)
    for bound in (lo, hi):
        if bound.rank and bound.dims != x.dims:
            raise _Bad(f"clamps {_fmt(x)} to a bound of shape {_fmt(bound)}")
    return Shape.array(_same_dtype(instr, (lo, x, hi)), x.dims)


# ---- dot and convolution ----------------------------------------------------------------------

def _dot(instr: Instruction) -> Shape | None:
    if "sparsity" in instr.attrs:
        return None  # sparse dots carry metadata operands
    lhs, rhs = _arrays(instr, 2)
    lb, rb = _ints(instr, "lhs_batch_dims"), _ints(instr, "rhs_batch_dims")
    lc, rc = _ints(instr, "lhs_contracting_dims"), _ints(instr, "rhs_contracting_dims")
    _dims_in_range(instr, lb + lc, lhs.rank, "lhs_batch_dims/lhs_contracting_dims")
    _dims_in_range(instr, rb + rc, rhs.rank, "rhs_batch_dims/rhs_contracting_dims")
    for what, ls, rs in (("batch", lb, rb), ("contracting", lc, rc)):
        if len(ls) != len(rs):
            raise _Bad(f"has {len(ls)} lhs but {len(rs)} rhs {what} dimensions")
        for l, r in zip(ls, rs):
            if lhs.dims[l] != rhs.dims[r]:
                raise _Bad(f"pairs {what} dimension {l} of {_fmt(lhs)} with dimension {r} of "
                           f"{_fmt(rhs)}, whose sizes differ")
    dims = ([lhs.dims[d] for d in lb]
            + [n for d, n in enumerate(lhs.dims) if d not in lb + lc]
            + [n for d, n in enumerate(rhs.dims) if d not in rb + rc])
    return Shape.array(_declared_array(instr).dtype, dims)  # the result type is chosen


_LABELS = re.compile(r"([a-z0-9]+)_([a-z0-9]+)->([a-z0-9]+)")


def _labels(instr: Instruction, ranks) -> tuple[str, str, str, int]:
    m = _LABELS.fullmatch(str(instr.attrs.get("dim_labels", "")).strip())
    if m is None:
        raise _Bad(f"has malformed dim_labels={instr.attrs.get('dim_labels')}")
    groups = m.groups()
    spatial = sum(c.isdigit() for c in groups[0])
    digits = "".join(str(i) for i in range(spatial))
    for labels, special, rank in zip(groups, ("bf", "io", "bf"), ranks):
        if (len(labels) != rank or sorted(labels) != sorted(digits + special)):
            raise _Bad(f"has dim_labels={m.group()} that do not fit its operands and result "
                       f"of ranks {', '.join(map(str, ranks))}")
    return (*groups, spatial)


def _window(instr: Instruction, spatial: int) -> dict[str, list]:
    """size/stride/pad/lhs_dilate/rhs_dilate of a window over `spatial` dimensions."""
    text = instr.attrs.get("window")
    if text is None:
        if spatial:
            raise _Bad(f"has no window= attribute for its {spatial} window dimensions")
        return {"size": [], "stride": [], "pad": [], "lhs_dilate": [], "rhs_dilate": []}
    if not re.fullmatch(r"\{[\w=\s\-x]*\}", str(text).strip()):
        raise _Bad(f"has malformed window={text}")
    w = instr.window()
    defaults = {"size": None, "stride": 1, "pad": (0, 0), "lhs_dilate": 1, "rhs_dilate": 1}
    for key, default in defaults.items():
        values = w.get(key)
        if values is None:
            if default is None:
                raise _Bad(f"has window={text} without size=")
            w[key] = [default] * spatial
        elif len(values) != spatial:
            raise _Bad(f"has window={text} over {len(values)} dimensions, expected {spatial}")
    if any(len(p) != 2 for p in w["pad"]) or min(w["stride"] + w["lhs_dilate"]
                                                 + w["rhs_dilate"], default=1) < 1:
        raise _Bad(f"has malformed window={text}")
    return w


def _windowed(size: int, window: int, stride: int, pad: tuple[int, int], base_dilation: int,
              window_dilation: int) -> int:
    """Output extent of one dimension under a window (XLA's strided bound)."""
    base = (size - 1) * base_dilation + 1 if size else 0
    padded = base + pad[0] + pad[1]
    extent = (window - 1) * window_dilation + 1 if window else 0
    if padded < extent or padded < 0:
        return 0
    return (padded - extent) // stride + 1


def _convolution(instr: Instruction) -> Shape:
    lhs, rhs = _arrays(instr, 2)
    out = _declared_array(instr)
    if "dim_labels" not in instr.attrs:
        raise _Bad("has no dim_labels= attribute, which convolution needs (XLA prints it)")
    lab_l, lab_r, lab_o, spatial = _labels(instr, (lhs.rank, rhs.rank, out.rank))
    w = _window(instr, spatial)
    fgc = _int(instr, "feature_group_count", 1)
    bgc = _int(instr, "batch_group_count", 1)
    batch, feat = lhs.dims[lab_l.index("b")], lhs.dims[lab_l.index("f")]
    k_in, k_out = rhs.dims[lab_r.index("i")], rhs.dims[lab_r.index("o")]
    if fgc < 1 or bgc < 1 or feat != k_in * fgc or k_out % fgc or k_out % bgc or batch % bgc:
        raise _Bad(f"convolves {_fmt(lhs)} with {_fmt(rhs)} (dim_labels={lab_l}_{lab_r}->"
                   f"{lab_o}), which do not fit feature_group_count={fgc} and "
                   f"batch_group_count={bgc}")
    dims = [0] * out.rank
    dims[lab_o.index("b")], dims[lab_o.index("f")] = batch // bgc, k_out
    for i in range(spatial):
        d = str(i)
        if w["size"][i] != rhs.dims[lab_r.index(d)]:
            raise _Bad(f"has a window of size {w['size'][i]} over kernel dimension "
                       f"{lab_r.index(d)} of {_fmt(rhs)}")
        dims[lab_o.index(d)] = _windowed(lhs.dims[lab_l.index(d)], w["size"][i],
                                         w["stride"][i], w["pad"][i], w["lhs_dilate"][i],
                                         w["rhs_dilate"][i])
    return Shape.array(out.dtype, dims)  # the result type is chosen


# ---- data movement ----------------------------------------------------------------------------

def _reshape(instr: Instruction) -> Shape:
    (x,) = _arrays(instr, 1)
    out = _declared_array(instr)
    if x.num_elements != out.num_elements:
        raise _Bad(f"declares {_fmt(out)} ({out.num_elements} elements) but reshapes "
                   f"{_fmt(x)} ({x.num_elements} elements)")
    return Shape.array(x.dtype, out.dims)


def _broadcast(instr: Instruction) -> Shape:
    (x,) = _arrays(instr, 1)
    out = _declared_array(instr)
    dims = _ints(instr, "dimensions")
    if len(dims) != x.rank:
        raise _Bad(f"broadcasts {_fmt(x)} with dimensions={{{','.join(map(str, dims))}}}, "
                   f"which must name {x.rank} dimensions")
    _dims_in_range(instr, dims, out.rank, "dimensions")
    for i, d in enumerate(dims):
        if x.dims[i] not in (out.dims[d], 1):
            raise _Bad(f"declares {_fmt(out)} but broadcasts dimension {i} of {_fmt(x)} to "
                       f"its dimension {d}")
    return Shape.array(x.dtype, out.dims)


def _transpose(instr: Instruction) -> Shape:
    (x,) = _arrays(instr, 1)
    perm = _ints(instr, "dimensions", None)
    if sorted(perm) != list(range(x.rank)):
        raise _Bad(f"transposes {_fmt(x)} by dimensions={{{','.join(map(str, perm))}}}, "
                   f"which is not a permutation of its {x.rank} dimensions")
    return Shape.array(x.dtype, [x.dims[p] for p in perm])


def _reverse(instr: Instruction) -> Shape:
    (x,) = _arrays(instr, 1)
    _dims_in_range(instr, _ints(instr, "dimensions"), x.rank, "dimensions")
    return x.without_layout()


def _iota(instr: Instruction) -> None:
    _operands(instr, 0)
    out = _declared_array(instr)
    d = _int(instr, "iota_dimension")
    if not 0 <= d < max(out.rank, 1):
        raise _Bad(f"has iota_dimension={d}, out of range for {_fmt(out)}")


_SLICE = re.compile(r"\[\s*(-?\d+)\s*:\s*(-?\d+)\s*(?::\s*(-?\d+)\s*)?\]")


def _slice(instr: Instruction) -> Shape:
    (x,) = _arrays(instr, 1)
    text = str(instr.attrs.get("slice", "{}")).strip()
    parts = _SLICE.findall(text)
    if not re.fullmatch(r"\{\s*(" + _SLICE.pattern + r"\s*,?\s*)*\}", text) or \
            len(parts) != x.rank:
        raise _Bad(f"slices {_fmt(x)} by slice={text}, which must give [start:limit] or "
                   f"[start:limit:stride] for each of its {x.rank} dimensions")
    dims = []
    for i, (start, limit, stride) in enumerate(parts):
        start, limit, stride = int(start), int(limit), int(stride or 1)
        if not (0 <= start <= limit <= x.dims[i] and stride >= 1):
            raise _Bad(f"slices dimension {i} of {_fmt(x)} by [{start}:{limit}:{stride}], "
                       f"out of range")
        dims.append(-(-(limit - start) // stride))
    return Shape.array(x.dtype, dims)


def _check_indices(instr: Instruction, indices, rank: int) -> None:
    shapes = [op.shape for op in indices]
    if any(s.is_tuple or s.dtype[0] not in "su" for s in shapes):
        raise _Bad("has start indices that are not integers")
    if all(s.rank == 0 for s in shapes) and len(shapes) == rank:
        return
    if len(shapes) == 1 and shapes[0].dims == (rank,):  # the older single-vector form
        return
    raise _Bad(f"has {len(shapes)} start indices for an operand of rank {rank}")


def _dynamic_slice(instr: Instruction) -> Shape:
    x = _arrays(instr, at_least=1)[0]
    _check_indices(instr, instr.operands[1:], x.rank)
    sizes = _ints(instr, "dynamic_slice_sizes", None)
    if len(sizes) != x.rank or any(not 0 <= s <= n for s, n in zip(sizes, x.dims)):
        raise _Bad(f"slices {_fmt(x)} by dynamic_slice_sizes={{{','.join(map(str, sizes))}}}, "
                   f"which does not fit it")
    return Shape.array(x.dtype, sizes)


def _dynamic_update_slice(instr: Instruction) -> Shape:
    x, update = _arrays(instr, at_least=2)[:2]
    _check_indices(instr, instr.operands[2:], x.rank)
    if update.rank != x.rank or any(u > n for u, n in zip(update.dims, x.dims)):
        raise _Bad(f"updates {_fmt(x)} with the larger {_fmt(update)}")
    _same_dtype(instr, (x, update))
    return x.without_layout()


def _concatenate(instr: Instruction) -> Shape:
    shapes = _arrays(instr, at_least=1)
    dims = _ints(instr, "dimensions", None)
    if len(dims) != 1:
        raise _Bad("needs dimensions={d} naming one dimension")
    d, first = dims[0], shapes[0]
    _dims_in_range(instr, dims, first.rank, "dimensions")
    for s in shapes[1:]:
        if s.rank != first.rank or any(a != b for i, (a, b) in enumerate(zip(s.dims, first.dims))
                                       if i != d):
            raise _Bad(f"concatenates {_fmt(first)} and {_fmt(s)} along dimension {d}, which "
                       f"differ elsewhere")
    out = list(first.dims)
    out[d] = sum(s.dims[d] for s in shapes)
    return Shape.array(_same_dtype(instr, shapes), out)


def _pad(instr: Instruction) -> Shape:
    x, value = _arrays(instr, 2)
    text = str(instr.attrs.get("padding", "")).strip()
    parts = [p.split("_") for p in text.split("x")] if text else []
    if len(parts) != x.rank or any(len(p) not in (2, 3) for p in parts) or value.rank:
        raise _Bad(f"pads {_fmt(x)} by padding={text} with a {_fmt(value)} value, which "
                   f"needs lo_hi[_interior] for each of its {x.rank} dimensions and a scalar")
    dims = []
    for n, p in zip(x.dims, parts):
        lo, hi, interior = (int(v) for v in p + ["0"] * (3 - len(p)))
        size = lo + hi + n + max(n - 1, 0) * interior
        if interior < 0 or size < 0:
            raise _Bad(f"pads {_fmt(x)} by padding={text}, which leaves a negative size")
        dims.append(size)
    return Shape.array(_same_dtype(instr, (x, value)), dims)


# ---- reductions -------------------------------------------------------------------------------

def _variadic(instr: Instruction) -> tuple[list[Shape], list[Shape]]:
    """(inputs, init values) of reduce and reduce-window: n arrays, then n scalars."""
    shapes = _arrays(instr, at_least=2)
    if len(shapes) % 2:
        raise _Bad(f"has {len(shapes)} operands; {instr.opcode} takes inputs and as many "
                   f"initial values")
    n = len(shapes) // 2
    inputs, inits = shapes[:n], shapes[n:]
    for s in inputs[1:]:
        if s.dims != inputs[0].dims:
            raise _Bad(f"reduces inputs of different shapes {_fmt(inputs[0])} and {_fmt(s)}")
    for s in inits:
        if s.rank:
            raise _Bad(f"has the initial value {_fmt(s)}, which must be a scalar")
    _reducer(instr, "to_apply", 2 * n)
    return inputs, inits


def _reducer(instr: Instruction, key: str, n: int) -> None:
    comp = _callee(instr, key)
    if len(comp.parameters) != n:
        raise _Bad(f"applies '{comp.name}', which takes {len(comp.parameters)} parameters, "
                   f"not {n}")


def _results(instr: Instruction, inits, dims) -> Shape:
    outs = [Shape.array(s.dtype, dims) for s in inits]
    if len(outs) == 1 and not instr.shape.is_tuple:
        return outs[0]
    return Shape.tuple_of(outs)


def _reduce(instr: Instruction) -> Shape:
    inputs, inits = _variadic(instr)
    dims = _ints(instr, "dimensions", None)
    _dims_in_range(instr, dims, inputs[0].rank, "dimensions")
    return _results(instr, inits, [n for d, n in enumerate(inputs[0].dims) if d not in dims])


def _window_output(instr: Instruction, x: Shape) -> list[int]:
    w = _window(instr, x.rank)
    return [_windowed(n, w["size"][i], w["stride"][i], w["pad"][i], w["lhs_dilate"][i],
                      w["rhs_dilate"][i]) for i, n in enumerate(x.dims)]


def _reduce_window(instr: Instruction) -> Shape:
    inputs, inits = _variadic(instr)
    return _results(instr, inits, _window_output(instr, inputs[0]))


def _select_and_scatter(instr: Instruction) -> Shape:
    x, source, init = _arrays(instr, 3)
    _reducer(instr, "select", 2)
    _reducer(instr, "scatter", 2)
    expected = _window_output(instr, x)
    if list(source.dims) != expected or init.rank:
        raise _Bad(f"scatters a source {_fmt(source)} (and initial value {_fmt(init)}) over "
                   f"{_fmt(x)}, whose windows give [{','.join(map(str, expected))}] and a "
                   f"scalar")
    return Shape.array(x.dtype, x.dims)


# ---- gather and scatter -----------------------------------------------------------------------

def _index_dims(instr: Instruction, indices: Shape) -> tuple[list[int], int]:
    """(batch dimension sizes of the indices, length of the index vector)."""
    ivd = _int(instr, "index_vector_dim", indices.rank)
    dims = list(indices.dims)
    if ivd == len(dims):
        dims.append(1)
    if not 0 <= ivd < len(dims):
        raise _Bad(f"has index_vector_dim={ivd}, out of range for indices {_fmt(indices)}")
    return [n for i, n in enumerate(dims) if i != ivd], dims[ivd]


def _gather(instr: Instruction) -> Shape:
    x, indices = _arrays(instr, 2)
    batch, vector = _index_dims(instr, indices)
    sizes = _ints(instr, "slice_sizes", None)
    offset_dims = _ints(instr, "offset_dims")
    skipped = _ints(instr, "collapsed_slice_dims") + _ints(instr, "operand_batching_dims")
    _dims_in_range(instr, skipped, x.rank, "collapsed_slice_dims/operand_batching_dims")
    if len(sizes) != x.rank or any(not 0 <= s <= n for s, n in zip(sizes, x.dims)):
        raise _Bad(f"gathers slices of slice_sizes={{{','.join(map(str, sizes))}}} from "
                   f"{_fmt(x)}, which do not fit it")
    if len(_ints(instr, "start_index_map")) != vector:
        raise _Bad(f"has start_index_map of {len(_ints(instr, 'start_index_map'))} dimensions "
                   f"for index vectors of length {vector}")
    offsets = [s for d, s in enumerate(sizes) if d not in skipped]
    rank = len(batch) + len(offset_dims)
    if len(offsets) != len(offset_dims):
        raise _Bad(f"has {len(offset_dims)} offset_dims for {len(offsets)} slice dimensions")
    _dims_in_range(instr, offset_dims, rank, "offset_dims")
    batch_it, offset_it = iter(batch), iter(offsets)
    dims = [next(offset_it) if d in offset_dims else next(batch_it) for d in range(rank)]
    return Shape.array(x.dtype, dims)


def _scatter(instr: Instruction) -> Shape:
    shapes = _arrays(instr, at_least=3)
    if len(shapes) % 2 == 0:
        raise _Bad(f"has {len(shapes)} operands; scatter takes inputs, indices and as many "
                   f"updates as inputs")
    n = len(shapes) // 2
    inputs, indices, updates = shapes[:n], shapes[n], shapes[n + 1:]
    _reducer(instr, "to_apply", 2 * n)
    batch, vector = _index_dims(instr, indices)
    window = _ints(instr, "update_window_dims")
    skipped = _ints(instr, "inserted_window_dims") + _ints(instr, "input_batching_dims")
    x = inputs[0]
    _dims_in_range(instr, skipped, x.rank, "inserted_window_dims/input_batching_dims")
    if len(_ints(instr, "scatter_dims_to_operand_dims")) != vector:
        raise _Bad(f"has scatter_dims_to_operand_dims not of length {vector}, the length of "
                   f"its index vectors")
    window_operand = [d for d in range(x.rank) if d not in skipped]
    for u in updates:
        _check_updates(instr, x, u, window, window_operand, batch)
    for s in inputs[1:]:
        if s.dims != x.dims:
            raise _Bad(f"scatters into inputs of different shapes {_fmt(x)} and {_fmt(s)}")
    outs = [s.without_layout() for s in inputs]
    return outs[0] if n == 1 and not instr.shape.is_tuple else Shape.tuple_of(outs)


def _check_updates(instr, x: Shape, u: Shape, window, window_operand, batch) -> None:
    _dims_in_range(instr, window, u.rank, "update_window_dims")
    scatter_sizes = [n for d, n in enumerate(u.dims) if d not in window]
    if (u.rank != len(batch) + len(window) or scatter_sizes != batch
            or len(window) != len(window_operand)
            or any(u.dims[w] > x.dims[o] for w, o in zip(window, window_operand))):
        raise _Bad(f"scatters updates {_fmt(u)} into {_fmt(x)}, which do not fit its indices "
                   f"(batch [{','.join(map(str, batch))}]) and window dimensions")


# stochastic-convert has no rule (it takes a second operand, its random bits)
ARRAY_RULES = {
    **dict.fromkeys(sorted(ELEMENTWISE_UNARY - {"bitcast-convert", "stochastic-convert"}),
                    _unary),
    **dict.fromkeys(sorted(ELEMENTWISE_BINARY), _binary),
    "bitcast-convert": _bitcast_convert,
    "select": _select,
    "clamp": _clamp,
    "dot": _dot,
    "convolution": _convolution,
    "reshape": _reshape,
    "broadcast": _broadcast,
    "transpose": _transpose,
    "reverse": _reverse,
    "iota": _iota,
    "slice": _slice,
    "dynamic-slice": _dynamic_slice,
    "dynamic-update-slice": _dynamic_update_slice,
    "concatenate": _concatenate,
    "pad": _pad,
    "reduce": _reduce,
    "reduce-window": _reduce_window,
    "select-and-scatter": _select_and_scatter,
    "gather": _gather,
    "scatter": _scatter,
}
