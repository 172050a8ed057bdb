"""Split a layer loop into consecutive loops over ranges of its iterations.

A loop over layers [0, L) becomes loops over [c0, c1), [c1, c2), ...: each takes the slices
of the stacked inputs its iterations read, writes the slices of the stacked outputs they
produce, and hands the carried values on to the next. Every loop counts from the original
start, so loops over equally many iterations are one program up to names: a pipeline stage
holds a shorter loop over its own layers and its own slice of the stacked weights, and the
pricing of one iteration stands for all of them.
"""

from __future__ import annotations

import re
from typing import Sequence

from alpac.analysis.layerloops import LayerLoop
from alpac.analysis.tripcount import loop_counter, through
from alpac.hlo.ir import Computation, ComputationRefs, Instruction, Module
from alpac.hlo.shape import Shape
from alpac.hlo.transforms import drop_unreachable, forward_tuples


def split_layer_loop(module: Module, loop: LayerLoop, cuts: Sequence[int]) -> list[str]:
    """Replace the loop by one loop per range between `cuts` (iteration numbers, ascending,
    inside (0, trips)); returns the new loops' names in execution order."""
    entry = module.entry
    whole = next(x for x in entry.instructions if x.name == loop.name)
    bounds = [0, *cuts, loop.trips]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cuts {list(cuts)} must lie strictly inside 0..{loop.trips}")
    start, step = loop_counter(whole)[1:]
    init = whole.operands[0]
    emit = _Emitter(module, entry)
    carried = {k: init.operands[k] for k in loop.carried}
    pieces = []  # (first slice, loop instruction)
    for a, b in zip(bounds, bounds[1:]):
        n = b - a
        first = loop.trips - b if loop.reverse else a
        elements = []
        for k, x in enumerate(init.operands):
            if k == loop.counter:
                elements.append(emit.constant(x.shape.dtype, start))
            elif k in loop.stacked_inputs or k in loop.stacked_outputs:
                elements.append(emit.slice(x, first, n))
            else:
                elements.append(carried.get(k, x))
        state = emit.tuple(elements)
        offset = loop.trips - n if loop.reverse else 0
        body = _body(module, whole.called("body"), loop, state.shape, offset)
        condition = _condition(module, whole.called("condition"), state.shape, loop.counter,
                               start + n * step)
        attrs = dict(whole.attrs, body=ComputationRefs([body]),
                     condition=ComputationRefs([condition]))
        if "backend_config" in attrs:
            attrs["backend_config"] = re.sub(r'("n"\s*:\s*"?)\d+', rf"\g<1>{n}",
                                             str(attrs["backend_config"]))
        piece = emit.add(Instruction(module.unique_name(whole.name), "while", state.shape,
                                     [state], attrs))
        carried = {k: emit.element(piece, k) for k in loop.carried}
        pieces.append((first, piece))
    results = []
    for k, x in enumerate(init.operands):
        if k == loop.counter:
            results.append(emit.constant(x.shape.dtype, start + loop.trips * step))
        elif k in loop.stacked_outputs:
            parts = [emit.element(p, k) for _, p in sorted(pieces, key=lambda fp: fp[0])]
            results.append(emit.concatenate(parts, x.shape))
        else:
            results.append(carried.get(k, x))
    emit.replace(whole, emit.tuple(results))
    forward_tuples(module)
    drop_unreachable(module)
    return [p.name for _, p in pieces]


class _Emitter:
    """New entry instructions, placed before the loop they replace."""

    def __init__(self, module: Module, comp: Computation):
        self.module, self.comp, self.new = module, comp, []

    def add(self, instr: Instruction) -> Instruction:
        instr.parent = self.comp
        self.new.append(instr)
        return instr

    def constant(self, dtype: str, value: float) -> Instruction:
        return self.add(Instruction(self.module.unique_name("layer_loop_counter"), "constant",
                                    Shape.array(dtype, ()), [], {}, str(int(value))))

    def slice(self, x: Instruction, first: int, n: int) -> Instruction:
        """Rows [first, first + n) of `x`; of a broadcast that makes the rows (a loop's
        zeroed stacked output), a smaller broadcast (as XLA's simplifier makes it)."""
        dims = x.shape.dims
        if x.opcode == "broadcast" and 0 not in x.dims("dimensions"):
            return self.add(Instruction(self.module.unique_name(f"{x.name}.layers"),
                                        "broadcast", x.shape.with_dims((n, *dims[1:])),
                                        list(x.operands), dict(x.attrs)))
        spans = [f"[{first}:{first + n}]"] + [f"[0:{d}]" for d in dims[1:]]
        return self.add(Instruction(self.module.unique_name(f"{x.name}.layers"), "slice",
                                    x.shape.with_dims((n, *dims[1:])), [x],
                                    {"slice": "{" + ", ".join(spans) + "}"}))

    def tuple(self, elements: list[Instruction]) -> Instruction:
        return self.add(Instruction(self.module.unique_name("layer_loop_state"), "tuple",
                                    Shape.tuple_of([e.shape for e in elements]), elements))

    def element(self, x: Instruction, k: int) -> Instruction:
        return self.add(Instruction(self.module.unique_name(f"{x.name}.{k}"),
                                    "get-tuple-element", x.shape.subshape((k,)), [x],
                                    {"index": str(k)}))

    def concatenate(self, parts: list[Instruction], shape: Shape) -> Instruction:
        if len(parts) == 1:
            return parts[0]
        return self.add(Instruction(self.module.unique_name("layer_loop_stacked"),
                                    "concatenate", shape, parts, {"dimensions": "{0}"}))

    def replace(self, old: Instruction, new: Instruction) -> None:
        """Put the new instructions where `old` was, and make its users read `new`."""
        at = self.comp.instructions.index(old)
        self.comp.instructions[at:at + 1] = self.new
        for instr in self.comp.instructions:
            instr.operands = [new if o is old else o for o in instr.operands]
        if self.comp.root is old:
            self.comp.root = new


def _clone(module: Module, comp: Computation, state: Shape) -> tuple[Computation, dict]:
    """A copy of a loop computation taking `state`; old instruction -> its copy."""
    copy = Computation(module.unique_name(comp.name))
    mapping: dict[int, Instruction] = {}
    for x in comp.instructions:
        new = Instruction(module.unique_name(x.name), x.opcode, x.shape,
                          [mapping[id(o)] for o in x.operands], dict(x.attrs), x.payload,
                          x.line)
        if x.opcode == "parameter":
            new.shape = state
        elif x.opcode == "get-tuple-element" and x.operands[0].opcode == "parameter":
            new.shape = state.subshape((x.tuple_index,))
        mapping[id(x)] = copy.append(new)
    copy.root = mapping[id(comp.root)]
    module.computations.insert(module.computations.index(comp), copy)
    return copy, mapping


def _body(module: Module, body: Computation, loop: LayerLoop, state: Shape,
          offset: int) -> Computation:
    """The body over a range of n iterations: its stacked elements hold n slices, indexed
    `offset` lower (a backward's index counts down from the full loop's last slice)."""
    copy, mapping = _clone(module, body, state)
    stacked = set(loop.stacked_inputs) | set(loop.stacked_outputs)
    param = mapping[id(body.parameters[0])]
    for x in list(copy.instructions):
        source = x.operands[0] if x.operands else None
        reads = source is not None and source.opcode == "get-tuple-element" and \
            source.operands[0] is param and source.tuple_index in stacked
        if x.opcode == "dynamic-slice" and reads:
            x.operands[1] = _lowered(module, copy, x, x.operands[1], offset)
        elif x.opcode == "dynamic-update-slice" and reads:
            x.shape = source.shape
            x.operands[2] = _lowered(module, copy, x, x.operands[2], offset)
    root = copy.root
    root.shape = state
    for k in stacked:
        element = root.operands[k]
        if element.shape.dims != state.subshape((k,)).dims:
            raise ValueError(f"layer loop {loop.name}: state element {k} is handed back "
                             f"through {element.opcode}, not as taken or updated in place")
    return copy


def _lowered(module: Module, comp: Computation, user: Instruction, index: Instruction,
             offset: int) -> Instruction:
    if not offset:
        return index
    constant = Instruction(module.unique_name("layer_offset"), "constant", index.shape, [],
                           {}, str(offset))
    lowered = Instruction(module.unique_name(f"{index.name}.in_range"), "subtract",
                          index.shape, [index, constant])
    at = comp.instructions.index(user)
    for x in (lowered, constant):
        x.parent = comp
        comp.instructions.insert(at, x)
    return lowered


def _condition(module: Module, condition: Computation, state: Shape, counter: int,
               limit: float) -> Computation:
    """The condition with the counter's limit replaced (a constant in the comparison)."""
    copy, _ = _clone(module, condition, state)
    compare = through(copy.root)  # as loop_counter reads it
    bounds = [k for k, o in enumerate(compare.operands) if o.opcode == "constant"]
    if compare.opcode != "compare" or len(bounds) != 1:
        raise ValueError(f"the condition {condition.name} does not compare the counter with "
                         f"a constant")
    old = compare.operands[bounds[0]]
    new = Instruction(module.unique_name(old.name), "constant", old.shape, [], {},
                      str(int(limit)))
    new.parent = copy
    copy.instructions.insert(copy.instructions.index(compare), new)
    compare.operands[bounds[0]] = new
    return copy
