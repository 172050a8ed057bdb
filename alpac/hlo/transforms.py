"""Small IR rewrites shared by several passes."""

from __future__ import annotations

from alpac.hlo.ir import Computation, Instruction, Module


def replace_uses(comp: Computation, old: Instruction, new: Instruction) -> None:
    for instr in comp.instructions:
        if old in instr.operands:
            instr.operands = [new if op is old else op for op in instr.operands]
    if comp.root is old:
        comp.root = new


def inline_calls(module: Module) -> int:
    """Inline every `call` (front ends such as jax keep library functions as calls); returns
    how many were inlined. Computations no longer called are dropped."""
    count = 0
    for comp in module.computations:
        while True:
            calls = [i for i in comp.instructions if i.opcode == "call"]
            if not calls:
                break
            for call in calls:
                _inline_one(module, comp, call)
                count += 1
    drop_unreachable(module)
    return count


def _inline_one(module: Module, comp: Computation, call: Instruction) -> None:
    callee = call.called("to_apply")
    mapping: dict[int, Instruction] = {}
    for param in callee.parameters:
        mapping[id(param)] = call.operands[param.parameter_number]
    new_instrs: list[Instruction] = []
    for instr in callee.instructions:
        if instr.opcode == "parameter":
            continue
        clone = Instruction(module.unique_name(instr.name), instr.opcode, instr.shape,
                            [mapping[id(op)] for op in instr.operands], dict(instr.attrs),
                            instr.payload, instr.line)
        clone.parent = comp
        mapping[id(instr)] = clone
        new_instrs.append(clone)
    result = mapping[id(callee.root)]
    if "sharding" in call.attrs and result in new_instrs:
        result.attrs["sharding"] = call.attrs["sharding"]
    position = comp.instructions.index(call)
    comp.instructions[position:position + 1] = new_instrs
    replace_uses(comp, call, result)


def drop_unreachable(module: Module) -> None:
    """Remove computations the entry does not reach."""
    reachable: set[int] = set()
    stack = [module.entry]
    while stack:
        comp = stack.pop()
        if id(comp) in reachable:
            continue
        reachable.add(id(comp))
        for instr in comp.instructions:
            stack.extend(instr.called_computations)
    module.computations = [c for c in module.computations if id(c) in reachable]

