"""Loops that apply a stack of layers (`lax.scan`, Flax `nn.scan`, MaxText's scanned decoder).

Such a loop runs a known number of iterations; its body takes one slice of stacked arrays
(weights stacked on a leading layer axis, or the forward's saved activations) per iteration,
indexed by the loop counter, and carries activations (or their gradients) from one iteration
to the next; it may write one slice per iteration of stacked results (activations saved for
the backward, weight gradients). The backward of a scanned forward is a second such loop that
walks the slices in reverse and reads what the forward saved. Loops of another shape (the RNG
loops of threefry, a `fori_loop` inside one layer) are not layer loops, and `LayerLoops.others`
says why each is not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from alpac.analysis.tripcount import loop_counter, through, while_trip_count
from alpac.hlo.ir import Computation, Instruction, Module
from alpac.hlo.opcodes import CONTRACTIONS


@dataclass(frozen=True)
class LayerLoop:
    """One layer loop of the entry computation; state elements by their tuple index."""

    name: str  # the while instruction
    trips: int  # iterations: layers applied
    counter: int
    reverse: bool  # slices taken from the last to the first (a backward)
    stacked_inputs: tuple[int, ...]  # read one slice per iteration, never written
    stacked_outputs: tuple[int, ...]  # written one slice per iteration
    carried: tuple[int, ...]  # handed from one iteration to the next
    invariant: tuple[int, ...]  # read whole by every iteration (masks), never written
    recomputes: bool  # the body holds an opt-barrier (jax.checkpoint / nn.remat)
    reads_saved_by: str | None = None  # the forward loop whose stacked outputs it reads

    def describe(self) -> str:
        what = "backward" if self.reads_saved_by else "forward"
        return (f"{self.name}: {what} over {self.trips} layers"
                f"{' (last to first)' if self.reverse else ''}, "
                f"{len(self.stacked_inputs)} stacked inputs, "
                f"{len(self.stacked_outputs)} stacked outputs, {len(self.carried)} carried"
                + (", recomputes" if self.recomputes else ""))


@dataclass(frozen=True)
class LayerLoops:
    loops: tuple[LayerLoop, ...]
    others: tuple[tuple[str, str], ...]  # (while name, why it is not a layer loop)

    def summary(self) -> dict:
        return {"layer_loops": [loop.describe() for loop in self.loops],
                "other_loops": [f"{name}: {why}" for name, why in self.others]}


def find_layer_loops(module: Module) -> LayerLoops:
    """The layer loops of the entry computation (see the module docstring)."""
    loops, others = [], []
    for instr in module.entry.instructions:
        if instr.opcode != "while":
            continue
        found = _layer_loop(instr)
        if isinstance(found, str):
            others.append((instr.name, found))
        else:
            loops.append(found)
    return LayerLoops(tuple(_paired(loops, module.entry)), tuple(others))


def _layer_loop(loop: Instruction) -> LayerLoop | str:
    """The loop's LayerLoop, or why it is not one."""
    trips, estimated = while_trip_count(loop)
    counter = loop_counter(loop)
    if estimated or counter is None:
        return "no counted trip count"
    if trips < 2:
        return f"{trips} iteration"
    body = loop.called("body")
    if body.root.opcode != "tuple" or loop.operands[0].opcode != "tuple":
        return "its state is not a tuple"
    index, start, step = counter
    slices = _SliceIndex(body, index, [start + t * step for t in range(trips)], trips)
    read, written, carried, invariant, reverse = [], [], [], [], set()
    for k, out in enumerate(body.root.operands):
        if k == index:
            continue
        element = _elements(body, k)
        if through(out) in element:  # passed through unchanged
            order = slices.read_only(element)
            if order is None:
                invariant.append(k)
            else:
                read.append(k)
                reverse.add(order)
            continue
        order = slices.written(out, element)
        if order is None:
            carried.append(k)
        else:
            written.append(k)
            reverse.add(order)
    if not any(x.opcode in CONTRACTIONS for x in body.instructions):
        return "no dot or convolution in its body"
    if not read or not carried:
        return "it takes no slice of stacked arrays per iteration" if not read \
            else "it carries nothing from one iteration to the next"
    if len(reverse) != 1:
        return "its slices are taken in more than one order"
    return LayerLoop(loop.name, trips, index, reverse.pop(), tuple(read), tuple(written),
                     tuple(carried), tuple(invariant), recomputes(body))


def recomputes(body: Computation) -> bool:
    """Whether a loop body recomputes part of itself in the backward: it holds an
    opt-barrier (jax.checkpoint / nn.remat)."""
    return any(x.opcode == "opt-barrier" for x in body.instructions)


def _paired(loops: list[LayerLoop], entry: Computation) -> list[LayerLoop]:
    """Each loop with the earlier loop whose stacked outputs it reads as stacked inputs."""
    by_name = {x.name: x for x in entry.instructions}
    out = []
    for loop in loops:
        init = by_name[loop.name].operands[0]
        saved_by = None
        for k in loop.stacked_inputs:
            source = through(init.operands[k])
            if source.opcode == "get-tuple-element":
                earlier = next((e for e in out if e.name == source.operands[0].name), None)
                if earlier and source.tuple_index in earlier.stacked_outputs:
                    saved_by = earlier.name
                    break
        out.append(replace(loop, reads_saved_by=saved_by))
    return out


def _elements(body: Computation, k: int) -> set[Instruction]:
    """The body's reads of state element k (get-tuple-element of its parameter)."""
    param = body.parameters[0]
    return {x for x in body.instructions if x.opcode == "get-tuple-element"
            and x.operands[0] is param and x.tuple_index == k}


class _SliceIndex:
    """Whether the body takes (or writes) slice i of an element at iteration i (or at
    iteration trips-1-i): the index is evaluated from the counter's value at each iteration."""

    def __init__(self, body: Computation, counter: int, values: list[float], trips: int):
        self.body, self.counter, self.values, self.trips = body, counter, values, trips
        self.users = body.users()

    def read_only(self, element: set[Instruction]) -> bool | None:
        """The order (reverse?) in which every use slices the element along its first
        dimension, one layer per iteration; None if some use does anything else."""
        orders = set()
        for read in element:
            for user in self.users.get(read, ()):
                if user is self.body.root:  # handed on unchanged
                    continue
                if user.opcode != "dynamic-slice" or user.operands[0] is not read:
                    return None
                order = self.order(user.operands[1:], read.shape.dims, user.shape.dims)
                if order is None:
                    return None
                orders.add(order)
        return orders.pop() if len(orders) == 1 else None

    def written(self, out: Instruction, element: set[Instruction]) -> bool | None:
        """The order in which the body writes one slice of the element per iteration."""
        out = through(out)
        if out.opcode != "dynamic-update-slice" or through(out.operands[0]) not in element:
            return None
        return self.order(out.operands[2:], out.shape.dims, out.operands[1].shape.dims)

    def order(self, indices, dims, piece) -> bool | None:
        """Forward (False) or reverse (True) if `indices` pick slice i or trips-1-i of the
        first dimension at iteration i and start every other dimension at 0."""
        if not dims or dims[0] != self.trips or piece[0] != 1 or tuple(piece[1:]) != \
                tuple(dims[1:]):
            return None
        if any(_scalar(i, self.body, self.counter, 0) != 0 for i in indices[1:]):
            return None
        first = [_scalar(indices[0], self.body, self.counter, v) for v in self.values]
        if first == list(range(self.trips)):
            return False
        if first == list(range(self.trips - 1, -1, -1)):
            return True
        return None


_ARITHMETIC = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b,
               "multiply": lambda a, b: a * b, "maximum": max, "minimum": min}
_COMPARE = {"LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
            "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b}


def _scalar(x: Instruction, body: Computation, counter: int, value: float):
    """A scalar index computed from constants and the counter (at `value`); None otherwise."""
    x = through(x)
    if x.opcode == "constant":
        return x.scalar_constant()
    if x.opcode == "get-tuple-element" and x.operands[0] is body.parameters[0]:
        return value if x.tuple_index == counter else None
    args = [_scalar(o, body, counter, value) for o in x.operands]
    if any(a is None for a in args):
        return None
    if x.opcode in _ARITHMETIC and len(args) == 2:
        return _ARITHMETIC[x.opcode](*args)
    if x.opcode == "negate":
        return -args[0]
    if x.opcode == "compare":
        return _COMPARE[str(x.attrs.get("direction"))](*args)
    if x.opcode == "select":
        return args[1] if args[0] else args[2]
    if x.opcode == "clamp":
        return min(max(args[1], args[0]), args[2])
    return None
