"""Layer loops cut for pipelining, with their stacked arrays cut to match.

A pipeline stage is a set of instructions and a layer loop is one instruction: as a loop, the
layers it applies cannot be spread over stages. Two ways out, both exact:

- **Per stage** (a forced pipeline of S stages, each loop's trip count a multiple of S, and
  the step still splits into microbatches): each loop becomes S consecutive loops over equal
  ranges of its iterations (`loopsplit`), one per stage, and the stacked weights, optimizer
  state and gradients are cut into S multi-row pieces. A stage holds a shorter loop over its
  own rows; the ILP walks one loop body per stage (priced times its trip count) whatever the
  depth, so compile time does not grow with the trip count.
- **Unrolled** (otherwise: the stage DP chooses where to cut, between any two iterations):
  each iteration is a layer of its own, the same program as its neighbours (the stage DP
  prices it once), and the step is the program its unrolled twin would be; the stacked arrays
  are cut into one parameter (and output) per layer, so a stage holds only its own layers'
  rows. The price: the module, the stage construction and the stage ILPs grow with the trip
  count.

`Unrolled` says how the rewritten module's parameters and outputs are pieces of the source
module's: the plan carries it, alpa-run feeds each piece its rows of the stacked input and
concatenates the output pieces back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from alpac.analysis.layerloops import find_layer_loops
from alpac.hlo.ir import Alias, Instruction, Module
from alpac.hlo.opcodes import ELEMENTWISE
from alpac.hlo.printer import print_module
from alpac.hlo.shape import Shape
from alpac.hlo.transforms import (flatten_call_graph, forward_tuples, inline_at,
                                  remove_dead_code)
from alpac.interop.loopsplit import split_layer_loop
from alpac.plan.program import input_value


@dataclass(frozen=True)
class Piece:
    """A parameter or output of the rewritten module as part of the source module's: rows
    [first, stop) on `axis` (the layer axis) of source parameter (or output position)
    `source`, or all of it. A piece of one row has no layer axis (the layer's own weight, as
    the unrolled twin has it)."""

    source: int
    first: int | None = None
    stop: int | None = None
    axis: int = 0


@dataclass(frozen=True)
class Unrolled:
    """The compile's layer loops, unrolled (the module docstring)."""

    source_text: str | None  # the module before unrolling (alpa-run's inputs and --check)
    loops: tuple[str, ...]  # the unrolled loops, described
    parameters: tuple[Piece, ...]  # per parameter number of the rewritten module
    outputs: tuple[Piece, ...]  # per position in the rewritten module's output tuple
    aliases: tuple[tuple[int, int], ...]  # the source module's (output position, parameter)
    whole: tuple[str, ...]  # stacked values a use still needs whole (concatenated)
    per_stage: tuple[str, ...] = ()  # the loops kept, one per stage (empty: unrolled)
    why_unrolled: str = ""  # why the loops were unrolled rather than kept one per stage

    def layer_axes(self) -> dict[str, int]:
        """Program input value (`input_value`) -> its layer axis, for the parameters that hold
        several layers' rows (a stage's piece of a stacked array)."""
        return {input_value(n): p.axis for n, p in enumerate(self.parameters)
                if p.first is not None and p.stop - p.first > 1}

    def layout(self) -> dict:
        """The plan's `program.layout`: how its inputs and outputs are the source's."""
        return {"parameters": [[p.source, p.first, p.stop, p.axis] for p in self.parameters],
                "outputs": [[o.source, o.first, o.stop, o.axis] for o in self.outputs],
                "aliases": [list(a) for a in self.aliases]}

    def plan_entries(self) -> dict:
        if not self.loops:
            return {}
        how = {"per_stage": list(self.per_stage)} if self.per_stage else \
            {"unrolled": True, **({"why": self.why_unrolled} if self.why_unrolled else {})}
        return {"layer_loops": {"loops": list(self.loops), **how,
                                "cut_parameters": sum(p.first is not None
                                                      for p in self.parameters),
                                "concatenated_whole": list(self.whole)}}


def unroll_layer_loops(module: Module, stages: int = 0) -> tuple[Module, Unrolled] | None:
    """A copy of the module with its layer loops cut (module docstring: one loop per stage
    where `stages` > 1 divides every trip count, else unrolled) and their stacked arrays cut
    to match, or None when it has no layer loop read by a backward one (nothing to pipeline)
    or its outputs are not a flat tuple."""
    loops = find_layer_loops(module).loops
    root = module.entry.root
    if not any(loop.reads_saved_by for loop in loops) or root.opcode != "tuple" or \
            any(o.shape.is_tuple for o in root.operands):
        return None
    if stages > 1 and any(loop.trips % stages for loop in loops):
        done = _cut(module, loops, 0)
        trips = ", ".join(str(loop.trips) for loop in loops)
        return done and (done[0], replace(done[1], why_unrolled=f"kept one per stage, their "
                                          f"trip counts ({trips}) would not divide into "
                                          f"{stages} stages"))
    return _cut(module, loops, stages if stages > 1 else 0)


def _cut(module: Module, loops, stages: int) -> tuple[Module, Unrolled] | None:
    """`stages` loops per layer loop, or (0) every iteration inlined."""
    source_text = print_module(module)
    work = module.clone()
    stacked: set[Instruction] = set()  # the loops' stacked results, concatenated from pieces
    kept = []
    for loop in loops:
        before = set(work.entry.instructions)
        rows = loop.trips // stages if stages else 1
        names = split_layer_loop(work, loop, range(rows, loop.trips, rows))
        stacked |= {x for x in work.entry.instructions
                    if x not in before and x.opcode == "concatenate"}
        if stages:
            kept += names
            continue
        for name in names:
            piece = next(x for x in work.entry.instructions if x.name == name)
            inline_at(work, work.entry, piece, piece.called("body"), piece.operands)
    forward_tuples(work)
    _Cutter(work, stacked).run()
    remove_dead_code(work)
    parameters = _cut_parameters(work)
    outputs = _cut_outputs(work, stacked)
    _Squeezer(work).run()
    remove_dead_code(work)
    flatten_call_graph(work)  # the inlined layers' loops (a dropout's PRNG) share bodies
    aliases = _aliases(module, work, parameters, outputs)
    if aliases is None:
        return None
    work.entry_layout = None
    whole = tuple(sorted(x.name for x in work.entry.instructions if x in stacked))
    return work, Unrolled(source_text, tuple(loop.describe() for loop in loops),
                          tuple(parameters), tuple(outputs), aliases, whole, tuple(kept))


class _Rewriter:
    """One pass in order over the entry: `rewrite(x)` returns what replaces x (or None), and
    the instructions it made with `add` go before x."""

    def __init__(self, module: Module):
        self.module, self.entry = module, module.entry
        self.new: list[Instruction] = []

    def rewrite(self, x: Instruction) -> Instruction | None:
        raise NotImplementedError

    def run(self) -> None:
        out, replaced = [], {}
        for x in self.entry.instructions:
            x.operands = [replaced.get(id(o), o) for o in x.operands]
            self.new = []
            y = self.rewrite(x)
            out += self.new + [x]
            if y is not None:
                replaced[id(x)] = y
        self.entry.instructions = out
        self.entry.root = replaced.get(id(self.entry.root), self.entry.root)

    def add(self, like: Instruction, opcode: str, shape: Shape, operands,
            attrs: dict | None = None) -> Instruction:
        attrs = {k: v for k, v in (like.attrs if attrs is None else attrs).items()
                 if k != "sharding"}
        y = Instruction(self.module.unique_name(like.name), opcode, shape, operands, attrs,
                        like.payload if opcode == like.opcode else None)
        y.parent = self.entry
        self.new.append(y)
        return y


class _Cutter(_Rewriter):
    """Uses of a stacked concatenate done per piece where that is exact (elementwise, slices,
    reductions, transposes, reshapes that keep the rows), the slices of a one-iteration
    loop's stacked state are its pieces, and a slice of a transpose is taken before it (the
    stacked weights of MaxText lie on axis 1 and are transposed for the loop)."""

    def __init__(self, module: Module, stacked: set[Instruction]):
        super().__init__(module)
        self.stacked = stacked
        self.memo: dict[tuple, list[Instruction]] = {}  # (value, axis, bounds) -> its pieces

    def rewrite(self, x: Instruction) -> Instruction | None:
        op = x.opcode
        if op == "dynamic-slice" and x.shape.dims == x.operands[0].shape.dims:
            return x.operands[0]  # a whole-array slice (XLA clamps the start to 0)
        if op == "dynamic-update-slice" and x.operands[1].shape.dims == x.shape.dims:
            return x.operands[1]
        if op == "slice" and x.operands[0].opcode == "transpose" and \
                x.operands[0] not in self.stacked:
            return self.slice_before_transpose(x)
        cut = next((o for o in x.operands if o in self.stacked), None)
        if cut is None or x.shape.is_tuple:
            return None
        axis, bounds = _cut_of(cut)
        if op == "slice" and x.operands[0] is cut:
            return self.slice(x, cut, axis, bounds)
        if op in ELEMENTWISE and x.shape.dims == cut.shape.dims:
            return self.per_piece(x, axis, bounds,
                                  [self.pieces(o, axis, bounds) for o in x.operands])
        if op == "transpose" and x.operands[0] is cut:
            return self.per_piece(x, x.dims("dimensions").index(axis), bounds, [cut.operands])
        keeps_rows = x.shape.dims == cut.shape.dims or (axis == 0 and x.shape.dims[:1]
                                                        == cut.shape.dims[:1])
        if op == "reshape" and keeps_rows:  # a new layout, or rows reshaped
            return self.per_piece(x, axis, bounds, [cut.operands])
        if op == "reduce" and len(x.operands) == 2 and x.operands[0] is cut:
            return self.reduce(x, cut, axis, bounds)
        return None

    def pieces(self, o: Instruction, axis: int, bounds) -> list[Instruction]:
        """`o` cut along `axis` at `bounds`: elementwise work is done per piece back to where
        its operands are pieces already, broadcasts along the axis, or sliced (parameters,
        whose slices become parameters of their own)."""
        key = (o, axis, tuple(bounds))
        if key in self.memo:
            return self.memo[key]
        if o.shape.rank == 0:
            return [o] * len(bounds)
        if o in self.stacked and _cut_of(o) == (axis, bounds):
            out = list(o.operands)
        elif o.opcode == "broadcast" and axis not in o.dims("dimensions"):
            out = [self.add(o, "broadcast", _along(o.shape, axis, b - a), o.operands)
                   for a, b in bounds]
        elif o.opcode in ELEMENTWISE:
            operands = [self.pieces(x, axis, bounds) for x in o.operands]
            out = [self.add(o, o.opcode, _along(o.shape, axis, b - a),
                            [ops[k] for ops in operands]) for k, (a, b) in enumerate(bounds)]
        else:
            out = [self.add(o, "slice", _along(o.shape, axis, b - a), [o],
                            {"slice": _slice_text([(a, b) if d == axis else (0, n)
                                                   for d, n in enumerate(o.shape.dims)])})
                   for a, b in bounds]
        self.memo[key] = out
        return out

    def per_piece(self, x: Instruction, axis: int, bounds, operands) -> Instruction:
        parts = [self.add(x, x.opcode, _along(x.shape, axis, b - a),
                          [ops[k] for ops in operands]) for k, (a, b) in enumerate(bounds)]
        return self.concatenate(x, axis, parts)

    def reduce(self, x: Instruction, cut: Instruction, axis: int,
               bounds) -> Instruction | None:
        """Per piece; over the layer axis, the pieces' results combined by the reducer (when
        the initial value is its identity, so counting it once per piece changes nothing)."""
        init, reduced = x.operands[1], x.dims("dimensions")
        if axis not in reduced:
            kept = axis - sum(d < axis for d in reduced)
            return self.concatenate(x, kept, [
                self.add(x, "reduce", _along(x.shape, kept, b - a), [p, init])
                for p, (a, b) in zip(cut.operands, bounds)])
        combine = _combiner(x)
        if combine is None:
            return None
        acc = None
        for p in cut.operands:
            partial = self.add(x, "reduce", x.shape, [p, init])
            acc = partial if acc is None else self.add(x, combine, x.shape, [acc, partial], {})
        return acc

    def slice(self, x: Instruction, cut: Instruction, axis: int,
              bounds) -> Instruction | None:
        spans = _spans(x)
        a, b, stride = spans[axis]
        whole = all(s == (0, n, 1) for d, (s, n) in enumerate(zip(spans, cut.shape.dims))
                    if d != axis)
        if stride != 1:
            return None
        covered = []
        for part, (lo, hi) in zip(cut.operands, bounds):
            if lo <= a and b <= hi:  # inside one piece
                if (a, b) == (lo, hi) and whole:
                    return part
                return self.add(x, "slice", x.shape, [part], {"slice": _slice_text(
                    [(a - lo, b - lo) if d == axis else (s, e)
                     for d, (s, e, _) in enumerate(spans)])})
            if a <= lo and hi <= b:
                covered.append(part)
        if whole and covered and sum(p.shape.dims[axis] for p in covered) == b - a:
            return self.concatenate(x, axis, covered)
        return None

    def slice_before_transpose(self, x: Instruction) -> Instruction | None:
        transpose = x.operands[0]
        spans, perm = _spans(x), transpose.dims("dimensions")
        if any(stride != 1 for _, _, stride in spans):
            return None
        inner = [spans[perm.index(d)][:2] for d in range(len(perm))]
        source = transpose.operands[0]
        sliced = self.add(x, "slice", source.shape.with_dims([b - a for a, b in inner]),
                          [source], {"slice": _slice_text(inner)})
        return self.add(transpose, "transpose", x.shape, [sliced])

    def concatenate(self, like: Instruction, axis: int,
                    parts: list[Instruction]) -> Instruction:
        if len(parts) == 1:
            return parts[0]
        y = self.add(like, "concatenate", like.shape, parts, {"dimensions": f"{{{axis}}}"})
        self.stacked.add(y)
        return y


class _Squeezer(_Rewriter):
    """One-row pieces have no row axis: elementwise work on pieces that are reshapes of
    row-less values is done row-less (the reshape moves after it), and a reshape of a
    reshape is one reshape, or none."""

    def rewrite(self, x: Instruction) -> Instruction | None:
        if x.opcode == "transpose" and _moves_only_unit_dims(x):
            return self.add(x, "reshape", x.shape, x.operands, {})
        if x.opcode == "reshape":
            source = x.operands[0]
            while source.opcode == "reshape":
                source = source.operands[0]
            if source.shape.dims == x.shape.dims:
                return source
            if source is not x.operands[0]:
                return self.add(x, "reshape", x.shape, [source])
            return None
        if x.opcode not in ELEMENTWISE or x.shape.rank == 0:
            return None
        sources = [o.operands[0] for o in x.operands if o.opcode == "reshape"]
        if not sources or any(s.shape.dims != sources[0].shape.dims for s in sources):
            return None
        dims = sources[0].shape.dims
        operands = []
        for o in x.operands:
            if o.opcode == "reshape":
                operands.append(o.operands[0])
            elif o.shape.rank == 0:
                operands.append(o)
            elif o.opcode == "broadcast" and o.operands[0].shape.rank == 0:
                operands.append(self.add(o, "broadcast", o.shape.with_dims(dims), o.operands))
            else:
                return None
        inner = self.add(x, x.opcode, x.shape.with_dims(dims), operands)
        return self.add(x, "reshape", x.shape, [inner], {})


_IDENTITY = {"add": lambda v: v == 0, "multiply": lambda v: v == 1,
             "maximum": lambda v: v <= -3.4e38, "minimum": lambda v: v >= 3.4e38,
             "or": lambda v: v == 0, "and": lambda v: v == 1}


def _combiner(reduce: Instruction) -> str | None:
    """The reducer's opcode when it is one binary op of its two parameters and the initial
    value is that op's identity."""
    body = reduce.called("to_apply")
    root, init = body.root, reduce.operands[1].scalar_constant()
    if root.opcode not in _IDENTITY or init is None or \
            sorted(o.opcode for o in root.operands) != ["parameter", "parameter"]:
        return None
    return root.opcode if _IDENTITY[root.opcode](init) else None


def _moves_only_unit_dims(transpose: Instruction) -> bool:
    """The dims longer than 1 keep their order: the same bytes, relabelled (a reshape)."""
    dims = transpose.operands[0].shape.dims
    order = [d for d in transpose.dims("dimensions") if dims[d] != 1]
    return order == sorted(order)


def _cut_of(concat: Instruction) -> tuple[int, list[tuple[int, int]]]:
    """The axis a stacked concatenate joins its pieces on, and the pieces' bounds on it."""
    axis = concat.dims("dimensions")[0]
    out, lo = [], 0
    for part in concat.operands:
        out.append((lo, lo + part.shape.dims[axis]))
        lo += part.shape.dims[axis]
    return axis, out


def _along(shape: Shape, axis: int, n: int) -> Shape:
    return shape.with_dims(n if d == axis else size for d, size in enumerate(shape.dims))


def _piece_shape(shape: Shape, axis: int, first: int, stop: int) -> Shape:
    """Rows [first, stop) of `shape` on `axis`; one row without that axis."""
    if stop - first == 1:
        return Shape(shape.dtype, shape.dims[:axis] + shape.dims[axis + 1:], None)
    return _along(shape, axis, stop - first)


_SPAN = re.compile(r"\[\s*(\d+)\s*:\s*(\d+)\s*(?::\s*(\d+)\s*)?\]")


def _spans(x: Instruction) -> list[tuple[int, int, int]]:
    return [(int(a), int(b), int(s or 1)) for a, b, s in _SPAN.findall(str(x.attrs["slice"]))]


def _slice_text(spans) -> str:
    return "{" + ", ".join(f"[{a}:{b}]" for a, b in spans) + "}"


def _cut_parameters(module: Module) -> list[Piece]:
    """Entry parameters read only by slices along one axis, disjoint: one parameter per
    slice (the first keeps the number, the others are numbered after the last); the pieces
    by new parameter number."""
    entry = module.entry
    users = entry.users()
    pieces = {p.parameter_number: Piece(p.parameter_number) for p in entry.parameters}
    for p in list(entry.parameters):
        found = _row_ranges(p, users[p])
        if found is None or entry.root is p:
            continue
        axis, ranges = found
        made, placed = {}, []
        for k, (a, b) in enumerate(ranges):
            number = p.parameter_number if k == 0 else len(pieces)
            name = f"{p.name}.layer{a}" if b - a == 1 else f"{p.name}.layers{a}-{b - 1}"
            new = Instruction(module.unique_name(name), "parameter",
                              _piece_shape(p.shape, axis, a, b), [], {}, str(number))
            placed.append(new)
            if b - a == 1:  # read with its row axis, as the slice gave it
                new = Instruction(module.unique_name(f"{name}.row"), "reshape",
                                  _along(p.shape, axis, 1), [new])
                placed.append(new)
            made[(a, b)] = new
            pieces[number] = Piece(p.parameter_number, a, b, axis)
        for x in placed:
            x.parent = entry
        at = entry.instructions.index(p)
        entry.instructions[at:at + 1] = placed
        for u in users[p]:
            span = _spans(u)[axis][:2]
            for v in users[u]:
                v.operands = [made[span] if o is u else o for o in v.operands]
            if entry.root is u:
                entry.root = made[span]
    remove_dead_code(module)
    return [pieces[k] for k in range(len(pieces))]


def _row_ranges(p: Instruction, users) -> tuple[int, list[tuple[int, int]]] | None:
    """The axis slices of `p` cut, all whole on every other, and the disjoint ranges they
    take of it, in order (None if another use reads it, or two ranges overlap)."""
    if p.shape.rank == 0 or not users or any(u.opcode != "slice" for u in users):
        return None
    ranges, axes = set(), set()
    for u in users:
        spans = _spans(u)
        partial = [d for d, s in enumerate(spans) if s != (0, p.shape.dims[d], 1)]
        if len(partial) != 1 or spans[partial[0]][2] != 1:
            return None
        axes.add(partial[0])
        ranges.add(spans[partial[0]][:2])
    ordered = sorted(ranges)
    if len(axes) != 1 or len(ordered) < 2 or \
            any(b > c for (_, b), (c, _) in zip(ordered, ordered[1:])):
        return None
    return axes.pop(), ordered


def _cut_outputs(module: Module, stacked: set[Instruction]) -> list[Piece]:
    """Outputs that are stacked concatenates become one output per piece (the first keeps
    the position, the others are appended)."""
    root = module.entry.root
    elements, pieces, extra = list(root.operands), [], []
    for k, e in enumerate(list(elements)):
        if e not in stacked:
            pieces.append(Piece(k))
            continue
        axis, bounds = _cut_of(e)
        for j, ((a, b), part) in enumerate(zip(bounds, e.operands)):
            if b - a == 1:
                part = _squeezed(module, part, axis)
            if j == 0:
                elements[k] = part
                pieces.append(Piece(k, a, b, axis))
            else:
                extra.append((part, Piece(k, a, b, axis)))
    root.operands = elements + [part for part, _ in extra]
    root.shape = Shape.tuple_of([o.shape for o in root.operands])
    remove_dead_code(module)
    return pieces + [piece for _, piece in extra]


def _squeezed(module: Module, part: Instruction, axis: int) -> Instruction:
    """A one-row piece without its layer axis."""
    y = Instruction(module.unique_name(f"{part.name}.unrow"), "reshape",
                    _piece_shape(part.shape, axis, 0, 1), [part])
    y.parent = module.entry
    module.entry.instructions.insert(module.entry.instructions.index(module.entry.root), y)
    return y


def _aliases(source: Module, work: Module, parameters: list[Piece],
             outputs: list[Piece]) -> tuple[tuple[int, int], ...] | None:
    """The rewritten module's aliases (an output piece aliases the parameter piece of the
    same rows) and buffer donors; the source's aliases, or None where a cut output aliases a
    parameter cut otherwise."""
    pieces_of_param: dict[int, dict] = {}
    for number, p in enumerate(parameters):
        pieces_of_param.setdefault(p.source, {})[(p.first, p.stop, p.axis)] = number
    new_aliases = []
    for alias in source.input_output_alias:
        out = alias.output_index[0] if len(alias.output_index) == 1 else None
        if out is None:
            return None
        mine = [(k, o) for k, o in enumerate(outputs) if o.source == out]
        targets = pieces_of_param[alias.parameter_number]
        if set(targets) != {(o.first, o.stop, o.axis) for _, o in mine}:
            return None
        new_aliases += [Alias((k,), targets[(o.first, o.stop, o.axis)], (), alias.kind)
                        for k, o in mine]
    work.input_output_alias = new_aliases
    work.buffer_donors = [(number, ()) for d, _ in source.buffer_donors
                          for number in pieces_of_param[d].values()]
    return tuple((a.output_index[0], a.parameter_number) for a in source.input_output_alias)
