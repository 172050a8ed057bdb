"""Structural checks of the IR, run by the pass manager after every pass."""

from __future__ import annotations

from alpac.hlo.ir import Module


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
    entry_params = len(module.entry.parameters)
    for alias in module.input_output_alias:
        if alias.parameter_number >= entry_params:
            raise InvalidIR(f"input_output_alias names parameter {alias.parameter_number}, "
                            f"but the entry has {entry_params}")
