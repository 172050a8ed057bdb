"""`Module` -> HLO text that XLA's parser accepts.

Computations are printed callees first (XLA's parser needs a computation defined before it is
named), instructions in their topological order, names with `%`, operands without shapes.
Printing a parsed module and parsing it again gives the same text (a fixed point).
"""

from __future__ import annotations

from alpac.hlo.ir import Computation, ComputationRefs, Instruction, Module


def print_module(module: Module) -> str:
    parts = [_header(module)]
    for comp in module.callee_order():
        parts.append(print_computation(comp))
    return "\n\n".join(parts) + "\n"


def _index(index) -> str:
    return "{" + ",".join(str(i) for i in index) + "}"


def _header(module: Module) -> str:
    items = [f"HloModule {module.name}"]
    attrs = dict(module.attrs)
    if "is_scheduled" in attrs:
        items.append(f"is_scheduled={attrs.pop('is_scheduled')}")
    if module.input_output_alias:
        entries = ", ".join(f"{_index(a.output_index)}: ({a.parameter_number}, "
                            f"{_index(a.parameter_index)}, {a.kind})"
                            for a in module.input_output_alias)
        items.append("input_output_alias={ " + entries + " }")
    if module.buffer_donors:
        entries = ", ".join(f"({p}, {_index(i)})" for p, i in module.buffer_donors)
        items.append("buffer_donor={ " + entries + " }")
    if module.entry_layout is not None:
        params, result = module.entry_layout
        items.append("entry_computation_layout={(" + ", ".join(str(p) for p in params)
                     + ")->" + str(result) + "}")
    items.extend(f"{k}={v}" for k, v in attrs.items())
    return ", ".join(items)


def print_computation(comp: Computation) -> str:
    params = ", ".join(f"{p.name}: {p.shape}" for p in comp.parameters)
    head = ("ENTRY " if comp.is_entry else "") + f"%{comp.name} ({params}) -> {comp.root.shape} {{"
    lines = [head]
    for instr in comp.instructions:
        lines.append("  " + print_instruction(instr, instr is comp.root))
    lines.append("}")
    return "\n".join(lines)


def print_instruction(instr: Instruction, is_root: bool = False) -> str:
    if instr.payload is not None:
        inner = instr.payload
    else:
        inner = ", ".join(f"%{op.name}" for op in instr.operands)
    text = f"{'ROOT ' if is_root else ''}%{instr.name} = {instr.shape} {instr.opcode}({inner})"
    for key, value in instr.attrs.items():
        text += f", {key}={_attr_value(value)}"
    return text


def _attr_value(value) -> str:
    if isinstance(value, ComputationRefs):
        names = ", ".join(f"%{c.name}" for c in value)
        return "{" + names + "}" if value.braced or len(value) != 1 else names
    return str(value)

