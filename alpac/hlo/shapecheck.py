"""Shape checking at load: every declared shape must follow from its operands and attributes.

XLA's own verifier infers the shape of each instruction from its operands and attributes and
refuses a module whose printed shapes disagree; a module alpac accepted without that check would
crash later inside a pass (or be planned wrongly). `check_module` does the same inference for
the opcodes alpac reasons about, one rule per opcode family (`RULES`: the array ops' rules are
in `shaperules`, those of tuples, calls and constants here), and raises `UserError` naming the
file, the line and the instruction. An opcode without a rule is not checked, so a module XLA
accepts is never refused here. Layouts are ignored; element types count.

Constants must carry their whole literal: HLO printers elide large ones as `{...}`, and planning
with invented values would be a silent wrong answer.
"""

from __future__ import annotations

import re

from alpac.errors import UserError
from alpac.hlo.ir import Instruction, Module
from alpac.hlo.shape import Shape
from alpac.hlo.shaperules import ARRAY_RULES, _Bad, _callee, _fmt, _int, _operands, same_shape

ELIDED_HINT = (
    "alpac needs every constant in full: give it the HloModuleProto as a .pb file "
    "(PyTorch/XLA: torch_xla._XLAC._get_xla_tensors_hlo_proto instead of _get_xla_tensors_hlo; "
    "XLA dumps: XLA_FLAGS='--xla_dump_to=DIR --xla_dump_hlo_as_proto') or HLO text printed "
    "with large constants (HloPrintOptions print_large_constants=true; XLA dumps: "
    "--xla_dump_large_constants)")


class _Mismatch(Exception):
    """The declared shape differs from the one the operands give."""

    def __init__(self, expected: Shape):
        super().__init__(str(expected))
        self.expected = expected


# ---- entry point ------------------------------------------------------------------------------

def check_module(module: Module, path: str, text: str | None = None,
                 with_lines: bool = True) -> None:
    """Raise UserError at the first instruction whose shape does not follow from its operands
    (or whose constant literal is elided or short). `text` gives error columns; `with_lines`
    False leaves out line numbers (text XLA printed from a .pb or .mlir file)."""
    for comp in module.computations:
        _check_parameter_numbers(comp, path, text, with_lines)
        for instr in comp.instructions:
            try:
                check_instruction(instr)
            except (_Bad, _Mismatch) as e:
                raise _user_error(instr, e, path, text, with_lines) from None


def check_instruction(instr: Instruction) -> None:
    """Raise _Bad or _Mismatch if `instr` is malformed."""
    rule = RULES.get(instr.opcode)
    if rule is None:
        return
    try:
        expected = rule(instr)
    except (ValueError, IndexError, KeyError, ZeroDivisionError) as e:
        raise _Bad(f"has malformed attributes for {instr.opcode}: {e}") from None
    if expected is not None and not same_shape(expected, instr.shape):
        raise _Mismatch(expected)


def _user_error(instr: Instruction, e: Exception, path: str, text: str | None,
                with_lines: bool) -> UserError:
    declared = _fmt(instr.shape)
    if isinstance(e, _Mismatch):
        source = ("its computation returns" if instr.opcode in ("call", "conditional")
                  else "its operands give")
        message = f"'{instr.name}' declares {declared} but {source} {_fmt(e.expected)}"
    else:
        message = f"'{instr.name}' {e}"
    if not with_lines or instr.line is None:
        return UserError(message, path=path)
    return UserError(message, path=path, line=instr.line, col=_column(text, instr.line))


def _column(text: str | None, line: int) -> int | None:
    if text is None:
        return None
    start = 0
    for _ in range(line - 1):
        start = text.find("\n", start) + 1
        if start == 0:
            return None
    end = text.find("\n", start)
    row = text[start:end if end >= 0 else len(text)]
    return len(row) - len(row.lstrip()) + 1


def _check_parameter_numbers(comp, path, text, with_lines) -> None:
    seen: dict[int, Instruction] = {}
    params = [i for i in comp.instructions if i.opcode == "parameter"]
    for p in params:
        n = p.parameter_number
        if n in seen or n >= len(params):
            why = (f"repeats parameter number {n} of '{seen[n].name}'" if n in seen else
                   f"is parameter({n}) but computation '{comp.name}' has {len(params)} "
                   f"parameters (numbered from 0)")
            raise _user_error(p, _Bad(why), path, text, with_lines)
        seen[n] = p


# ---- tuples, calls and constants --------------------------------------------------------------

def _tuple(instr: Instruction) -> Shape:
    return Shape.tuple_of(op.shape.without_layout() for op in instr.operands)


def _get_tuple_element(instr: Instruction) -> Shape:
    (op,) = _operands(instr, 1)
    index = _int(instr, "index")
    if not op.shape.is_tuple or not 0 <= index < len(op.shape.tuple_shapes):
        raise _Bad(f"takes element {index} of '{op.name}', whose shape is {_fmt(op.shape)}")
    return op.shape.tuple_shapes[index].without_layout()


def _signature(instr: Instruction, comp, args) -> None:
    params = comp.parameters
    if len(params) != len(args) or any(not same_shape(p.shape, a) for p, a in zip(params, args)):
        got = ", ".join(_fmt(p.shape) for p in params)
        raise _Bad(f"calls '{comp.name}' with ({', '.join(_fmt(a) for a in args)}) but it "
                   f"takes ({got})")


def _while(instr: Instruction) -> Shape:
    (op,) = _operands(instr, 1)
    body, cond = _callee(instr, "body"), _callee(instr, "condition")
    _signature(instr, body, [op.shape])
    _signature(instr, cond, [op.shape])
    if not same_shape(body.root.shape, op.shape):
        raise _Bad(f"loops over {_fmt(op.shape)} but its body '{body.name}' returns "
                   f"{_fmt(body.root.shape)}")
    if not same_shape(cond.root.shape, Shape.array("pred", ())):
        raise _Bad(f"has condition '{cond.name}' returning {_fmt(cond.root.shape)}, not pred[]")
    return op.shape.without_layout()


def _call(instr: Instruction) -> Shape:
    comp = _callee(instr, "to_apply")
    _signature(instr, comp, [op.shape for op in instr.operands])
    return comp.root.shape.without_layout()


def _conditional(instr: Instruction) -> Shape:
    ops = _operands(instr, at_least=1)
    refs = instr.attrs.get("branch_computations")
    keys = ("true_computation", "false_computation")
    branches = list(refs) if refs else [_callee(instr, key) for key in keys]
    selector = ops[0].shape
    kind = "s32" if refs else "pred"
    if not branches or selector.is_tuple or selector.rank or selector.dtype != kind:
        raise _Bad(f"selects its branch by {_fmt(selector)}, which must be {kind}[] for "
                   f"{'branch_computations' if refs else 'true/false computations'}")
    if len(ops) != len(branches) + 1:
        raise _Bad(f"has {len(ops) - 1} branch operands for {len(branches)} branches")
    for branch, op in zip(branches, ops[1:]):
        _signature(instr, branch, [op.shape])
        if not same_shape(branch.root.shape, branches[0].root.shape):
            raise _Bad(f"has branches returning {_fmt(branches[0].root.shape)} and "
                       f"{_fmt(branch.root.shape)}")
    return branches[0].root.shape.without_layout()


_LITERAL_SPLIT = re.compile(r"[\s,{}]+")
_COMMENT = re.compile(r"/\*.*?\*/")  # XLA marks the index of each row: /*i0=0*/


def _constant(instr: Instruction) -> None:
    text = (instr.payload or "").strip()
    if "..." in text:
        raise _Bad(f"is a constant whose value was elided ({text[:20]}); {ELIDED_HINT}")
    shape = instr.shape
    if shape.is_tuple or shape.dtype.startswith("c") or shape.dtype in ("token", "opaque"):
        return None
    count = sum(1 for v in _LITERAL_SPLIT.split(_COMMENT.sub(" ", text)) if v)
    if count != shape.num_elements:
        raise _Bad(f"declares {_fmt(shape)} ({shape.num_elements} values) but its literal has "
                   f"{count}")
    return None


def _parameter(instr: Instruction) -> None:
    _operands(instr, 0)


RULES = {
    **ARRAY_RULES,
    "tuple": _tuple,
    "get-tuple-element": _get_tuple_element,
    "while": _while,
    "call": _call,
    "conditional": _conditional,
    "constant": _constant,
    "parameter": _parameter,
}
