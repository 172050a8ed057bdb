"""Cut a set of instructions out of a computation as a module of its own.

Operands defined outside the set become parameters, chosen instructions become the outputs
(a root tuple), and called computations are copied with the module, so that annotating one
extracted module never touches another.
"""

from __future__ import annotations

from alpac.hlo.ir import Computation, ComputationRefs, Instruction, Module, UniqueNames
from alpac.hlo.shape import Shape


def extract(name: str, members: list[Instruction], outputs: list[Instruction],
            inputs: list[Instruction] | None = None, keep_attrs: bool = True
            ) -> tuple[Module, list[Instruction], list[Instruction]]:
    """A module computing `outputs` from `members` (in the given order, operands first).

    Returns the module, the outside instructions its parameters stand for (in parameter
    order: `inputs` first when given, then any other outside operand in order of first use),
    and `outputs` (the root tuple's order)."""
    member_ids = {id(i) for i in members}
    params: list[Instruction] = list(inputs or [])
    seen = {id(p) for p in params}
    for instr in members:
        for op in instr.operands:
            if id(op) not in member_ids and id(op) not in seen:
                seen.add(id(op))
                params.append(op)
    comp = Computation(name, is_entry=True)
    mapping: dict[int, Instruction] = {}
    # a member may already be called `x.in` (a module extracted before, a split accumulator)
    names = UniqueNames(i.name for i in members)
    for k, outside in enumerate(params):
        p = Instruction(names.fresh(f"{outside.name}.in"), "parameter", outside.shape, (),
                        {"sharding": outside.attrs["sharding"]}
                        if keep_attrs and "sharding" in outside.attrs else {}, str(k))
        mapping[id(outside)] = comp.append(p)
    callees: dict[int, Computation] = {}
    for instr in members:
        attrs = {}
        for key, value in instr.attrs.items():
            if isinstance(value, ComputationRefs):
                value = ComputationRefs((_copy_callee(c, callees) for c in value), value.braced)
            elif not keep_attrs and key == "sharding":
                continue
            attrs[key] = value
        mapping[id(instr)] = comp.append(Instruction(
            instr.name, instr.opcode, instr.shape, [mapping[id(o)] for o in instr.operands],
            attrs, instr.payload, instr.line))
    outs = [mapping[id(o)] for o in outputs]
    root = comp.append(Instruction(names.fresh(f"{name}.outputs"), "tuple",
                                   Shape.tuple_of(o.shape for o in outs), outs))
    if keep_attrs and all("sharding" in o.attrs for o in outs):
        root.attrs["sharding"] = "{" + ", ".join(_leaf_texts(o) for o in outs) + "}"
    comp.root = root
    module = Module(name, [], comp)
    module.computations = callee_order(comp) + [comp]
    return module, params, outputs


def _leaf_texts(instr: Instruction) -> str:
    text = str(instr.attrs["sharding"]).strip()
    if instr.shape.is_tuple:
        return text[1:-1]  # a tuple sharding's elements join the root's flat list
    return text


def _copy_callee(comp: Computation, done: dict[int, Computation]) -> Computation:
    hit = done.get(id(comp))
    if hit is not None:
        return hit
    copy = Computation(comp.name)
    done[id(comp)] = copy
    mapping: dict[int, Instruction] = {}
    for instr in comp.instructions:
        attrs = {k: (ComputationRefs((_copy_callee(c, done) for c in v), v.braced)
                     if isinstance(v, ComputationRefs) else v) for k, v in instr.attrs.items()}
        mapping[id(instr)] = copy.append(Instruction(
            instr.name, instr.opcode, instr.shape, [mapping[id(o)] for o in instr.operands],
            attrs, instr.payload, instr.line))
    copy.root = mapping[id(comp.root)]
    return copy


def callee_order(entry: Computation) -> list[Computation]:
    """The computations `entry` calls, transitively, each after its own callees."""
    order, seen = [], set()

    def visit(comp):
        for instr in comp.instructions:
            for callee in instr.called_computations:
                if id(callee) not in seen:
                    seen.add(id(callee))
                    visit(callee)
                    order.append(callee)

    visit(entry)
    return order
