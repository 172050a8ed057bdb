"""Structural checks of the IR, run by the pass manager after every pass. The module-level
ones a user's file can break (`call_problem`, `alias_problem`) the parser asks too, to refuse
the file in one line."""

from __future__ import annotations

from typing import Iterator

from alpac.hlo.ir import Computation, Module
from alpac.hlo.limits import CALL_DEPTH_MAX, clipped
from alpac.hlo.shape import Shape


class InvalidIR(Exception):
    pass


def verify_module(module: Module) -> None:
    """Raise InvalidIR naming the first broken invariant."""
    comps = {id(c) for c in module.computations}
    if id(module.entry) not in comps:
        raise InvalidIR(f"entry computation '{module.entry.name}' is not in the module")
    for comp in module.computations:
        if not comp.instructions or comp.root is None:
            raise InvalidIR(f"computation '{comp.name}' is empty or has no root")
        placed: set[int] = set()
        names: set[str] = set()
        for instr in comp.instructions:
            if instr.name in names:
                raise InvalidIR(f"instruction name '{instr.name}' is used twice in "
                                f"'{comp.name}'")
            names.add(instr.name)
            if instr.parent is not comp:
                raise InvalidIR(f"'{instr.name}' is listed in '{comp.name}' but belongs "
                                f"elsewhere")
            for op in instr.operands:
                if id(op) not in placed:
                    raise InvalidIR(f"operand '{op.name}' of '{instr.name}' is not defined "
                                    f"before it in '{comp.name}'")
            for callee in instr.called_computations:
                if id(callee) not in comps:
                    raise InvalidIR(f"'{instr.name}' calls '{callee.name}', which is not in "
                                    f"the module")
            placed.add(id(instr))
        if id(comp.root) not in placed:
            raise InvalidIR(f"root of '{comp.name}' is not one of its instructions")
        numbers = sorted(p.parameter_number for p in comp.parameters)
        if numbers != list(range(len(numbers))):
            raise InvalidIR(f"parameters of '{comp.name}' are numbered {numbers}, expected "
                            f"0..{len(numbers) - 1}")
    for problem in (call_problem(module), alias_problem(module)):
        if problem:
            raise InvalidIR(problem[1])


def call_problem(module: Module) -> tuple[Computation, str] | None:
    """(computation, message) where a computation calls itself, directly or through others
    (XLA refuses recursion), or calls nest deeper than CALL_DEPTH_MAX (passes walk them
    recursively); None if neither. A walk with its own stack, so any file can be judged."""
    height: dict[int, int] = {}  # id -> computations on the longest chain of calls from it
    for start in module.computations:
        if id(start) in height:
            continue
        path, todo, on_path = [start], [_callees(start)], {id(start): 0}
        while path:
            callee = next(todo[-1], None)
            if callee is None:
                comp = path.pop()
                todo.pop()
                del on_path[id(comp)]
                height[id(comp)] = 1 + max((height[id(c)] for c in _callees(comp)), default=0)
                if height[id(comp)] > CALL_DEPTH_MAX:
                    return comp, (f"computation '{comp.name}' nests calls more than "
                                  f"{CALL_DEPTH_MAX} deep")
            elif id(callee) in on_path:
                cycle = [c.name for c in path[on_path[id(callee)]:]] + [callee.name]
                shown = cycle if len(cycle) <= 5 else cycle[:3] + ["...", cycle[-1]]
                return callee, (f"computation '{callee.name}' calls itself "
                                f"({' -> '.join(shown)}); HLO computations cannot be recursive")
            elif id(callee) not in height:
                on_path[id(callee)] = len(path)
                path.append(callee)
                todo.append(_callees(callee))
    return None


def _callees(comp: Computation) -> Iterator[Computation]:
    return (callee for instr in comp.instructions for callee in instr.called_computations)


def alias_problem(module: Module) -> tuple[str, str] | None:
    """(header attribute, message) for the first entry of input_output_alias or buffer_donor
    that names a parameter or a shape index the entry lacks, or aliases buffers of different
    sizes (as XLA's HloInputOutputAliasConfig::Verify refuses them); None if all fit."""
    params = {p.parameter_number: p.shape for p in module.entry.parameters}
    result = module.entry.root.shape
    for alias in module.input_output_alias:
        key = "input_output_alias"
        if problem := _buffer_problem(params, alias.parameter_number, alias.parameter_index):
            return key, f"{key}: {problem}"
        out = _subshape(result, alias.output_index)
        if out is None:
            return key, (f"{key}: the entry's result has no index "
                         f"{{{_index(alias.output_index)}}} (its shape is {result})")
        given = params[alias.parameter_number].subshape(alias.parameter_index)
        if out.byte_size != given.byte_size:
            return key, (f"{key}: output {{{_index(alias.output_index)}}} ({out}) and "
                         f"parameter {alias.parameter_number} {{{_index(alias.parameter_index)}}} "
                         f"({given}) differ in size")
    for number, index in module.buffer_donors:
        if problem := _buffer_problem(params, number, index):
            return "buffer_donor", f"buffer_donor: {problem}"
    return None


def _buffer_problem(params: dict[int, Shape], number: int, index: tuple[int, ...]) -> str | None:
    if number not in params:
        return f"no parameter {number} (the entry has {len(params)})"
    if _subshape(params[number], index) is None:
        return (f"parameter {number} has no index {{{_index(index)}}} (its shape is "
                f"{params[number]})")
    return None


def _subshape(shape: Shape, index: tuple[int, ...]) -> Shape | None:
    """The part of `shape` at `index`, None where it has none."""
    for i in index:
        if not shape.is_tuple or i >= len(shape.tuple_shapes):
            return None
        shape = shape.tuple_shapes[i]
    return shape


def _index(index: tuple[int, ...]) -> str:
    return clipped(",".join(map(str, index)))
