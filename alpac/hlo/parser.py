"""HLO text -> `Module`.

Reads what XLA prints (`as_text(dialect="hlo")`, `--xla_dump_to` files) the way XLA's own
parser does: as a token stream, so line breaks may fall anywhere. Computations may come in any
order, names may carry `%` or not, operands may carry their shapes, shapes may be omitted where
XLA infers them, and every attribute, known or not, is kept verbatim. Errors carry
file:line:col and say what was expected.
"""

from __future__ import annotations

import bisect
import gc
import re

from alpac.errors import UserError
from alpac.hlo.ir import COMPUTATION_ATTRS, Alias, Computation, ComputationRefs, Instruction, Module
from alpac.hlo.limits import (INSTRUCTIONS_MAX, PARAMETERS_MAX, TUPLE_DEPTH_MAX, clipped,
                              within)
from alpac.hlo.opcodes import ELEMENTWISE
from alpac.hlo.shape import Shape, ShapeSyntaxError, parse_shape
from alpac.hlo.shaperules import same_shape
from alpac.hlo.verify import alias_problem, call_problem

_SPECIAL = re.compile(r'[(){}\[\]",]')
_VALUE_STOP = re.compile(r'[\s(){}\[\]",]')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SKIP = re.compile(r"(?:\s+|/\*.*?\*/|//[^\n]*)*", re.S)
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_NAME_TOKEN = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\s*\(")
_KEY = re.compile(r"([A-Za-z_][\w.\-]*)\s*=")
_OPERAND_NAME = re.compile(r"%?([^\s=(){},%]+)$")
_OPENERS = {"(": ")", "{": "}", "[": "]"}
_STACK_SECTION = re.compile(
    r"(?:FileNames|FunctionNames|FileLocations|StackFrames)[ \t]*\n(?:[ \t]*\d+[ \t][^\n]*\n?)*")


class _Error(Exception):
    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


def find_close(text: str, pos: int) -> int:
    """Index of the bracket closing the one at `pos` (skipping quoted strings), or -1."""
    stack: list[str] = []
    while True:
        m = _SPECIAL.search(text, pos)
        if not m:
            return -1
        c = m.group()
        if c == '"':
            s = _STRING.match(text, m.start())
            if not s:
                return -1
            pos = s.end()
            continue
        pos = m.end()
        if c in _OPENERS:
            stack.append(_OPENERS[c])
        elif c in ")}]":
            if not stack or stack.pop() != c:
                return -1
            if not stack:
                return m.start()


def split_top_level(text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """(start, end) spans of the comma-separated items of text[start:end] at bracket depth 0."""
    end = len(text) if end is None else end
    spans, depth, item_start, pos = [], 0, start, start
    while True:
        m = _SPECIAL.search(text, pos, end)
        if not m:
            break
        c = m.group()
        if c == '"':
            s = _STRING.match(text, m.start(), end)
            pos = s.end() if s else end
            continue
        pos = m.end()
        if c in _OPENERS:
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            spans.append((item_start, m.start()))
            item_start = m.end()
    if text[item_start:end].strip():
        spans.append((item_start, end))
    return spans


def parse_hlo(text: str, path: str = "<string>") -> Module:
    """Parse HLO text; raise UserError with file:line:col on malformed input."""
    parser = _Parser(text)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the parser allocates many small objects and frees none of them
    try:
        return parser.parse()
    except _Error as e:
        line, col = parser.line_col(e.offset)
        raise UserError(str(e), path=path, line=line, col=col) from None
    finally:
        if gc_was_enabled:
            gc.enable()


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self.instructions = 0  # in the module so far, up to INSTRUCTIONS_MAX

    def line_col(self, offset: int) -> tuple[int, int]:
        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self.line_starts, offset) - 1
        return line + 1, offset - self.line_starts[line] + 1

    # ---- low-level cursor helpers -----------------------------------------------------------
    def skip(self, pos: int) -> int:
        return _SKIP.match(self.text, pos).end()

    def expect(self, pos: int, token: str, what: str) -> int:
        pos = self.skip(pos)
        if not self.text.startswith(token, pos):
            raise _Error(f"expected '{token}' {what}", pos)
        return pos + len(token)

    def value_end(self, pos: int) -> int:
        """End of an attribute value: a run of tokens and bracket groups up to a top-level
        comma, white space or closing bracket."""
        text = self.text
        while True:
            m = _VALUE_STOP.search(text, pos)
            if not m:
                return len(text)
            c = m.group()
            if c in _OPENERS:
                close = find_close(text, m.start())
                if close < 0:
                    raise _Error(f"unbalanced '{c}' in attribute value", m.start())
                pos = close + 1
            elif c == '"':
                s = _STRING.match(text, m.start())
                if not s:
                    raise _Error("unterminated string", m.start())
                pos = s.end()
            else:
                return m.start()

    def attributes(self, pos: int) -> tuple[dict[str, str], dict[str, int], int]:
        """`, key=value` pairs starting at pos; returns them, their offsets and the end."""
        attrs: dict[str, str] = {}
        where: dict[str, int] = {}
        while True:
            nxt = self.skip(pos)
            if not self.text.startswith(",", nxt):
                return attrs, where, pos
            key_pos = self.skip(nxt + 1)
            m = _KEY.match(self.text, key_pos)
            if not m:
                raise _Error("expected an attribute 'key=value' after ','", key_pos)
            value_pos = self.skip(m.end())
            end = self.value_end(value_pos)
            if end == value_pos:
                raise _Error(f"expected a value for attribute '{m.group(1)}'", value_pos)
            attrs[m.group(1)] = self.text[value_pos:end]
            where[m.group(1)] = key_pos
            pos = end

    # ---- module -----------------------------------------------------------------------------
    def parse(self) -> Module:
        text = self.text
        pos = self.skip(0)
        if pos >= len(text):
            raise _Error("empty file: expected 'HloModule <name>'", pos)
        if not text.startswith("HloModule", pos):
            raise _Error("expected 'HloModule <name>' at the start of an HLO module", pos)
        pos = self.skip(pos + len("HloModule"))
        m = _NAME_TOKEN.match(text, pos)
        if not m:
            raise _Error("expected a module name after 'HloModule'", pos)
        module_name = text[pos:self.value_end(pos)]
        header, header_where, pos = self.attributes(self.value_end(pos))
        pos = self.skip_stack_frames(pos)

        parsed: list[tuple[Computation, list, int]] = []
        seen: set[str] = set()
        pos = self.skip(pos)
        while pos < len(text):
            comp, pending, pos = self.computation(pos)
            if comp.name in seen:
                raise _Error(f"computation '{comp.name}' is defined twice", pending[1])
            seen.add(comp.name)
            parsed.append((comp, pending[0], pending[1]))
            pos = self.skip(pos)
        if not parsed:
            raise _Error("module has no computations: expected '%name {' or 'ENTRY %name {'",
                         pos)

        comps = {c.name: c for c, _, _ in parsed}
        starts = {c.name: start for c, _, start in parsed}
        for comp, calls, _ in parsed:
            for instr, key, value, offset in calls:
                refs = []
                for name in _computation_names(value):
                    callee = comps.get(name)
                    if callee is None:
                        raise _Error(f"'{instr.name}' calls computation '{name}', which is not "
                                     f"defined", offset)
                    refs.append(callee)
                instr.attrs[key] = ComputationRefs(refs, value.lstrip().startswith("{"))
        entries = [c for c in comps.values() if c.is_entry]
        if len(entries) > 1:
            raise _Error("more than one ENTRY computation", parsed[-1][2])
        entry = entries[0] if entries else parsed[-1][0]
        entry.is_entry = True
        module = Module(module_name, list(comps.values()), entry)
        for key, value in header.items():
            try:
                if key == "input_output_alias":
                    module.input_output_alias = _parse_aliases(value)
                elif key == "buffer_donor":
                    module.buffer_donors = _parse_donors(value)
                elif key == "entry_computation_layout":
                    module.entry_layout = _parse_entry_layout(value)
                else:
                    module.attrs[key] = value
            except (ValueError, ShapeSyntaxError, IndexError) as e:
                raise _Error(f"malformed {key}: {e}", header_where[key]) from None
        if problem := call_problem(module):
            raise _Error(problem[1], starts[problem[0].name])
        if problem := alias_problem(module):
            raise _Error(problem[1], header_where[problem[0]])
        return module

    def skip_stack_frames(self, pos: int) -> int:
        """Skip the debug tables XLA prints after the header when the module carries stack
        frames (`FileNames`, `FunctionNames`, `FileLocations`, `StackFrames`, each a list of
        numbered rows); instructions keep their `stack_frame_id` as metadata text."""
        while True:
            pos = self.skip(pos)
            m = _STACK_SECTION.match(self.text, pos)
            if not m:
                return pos
            pos = m.end()

    # ---- computations -----------------------------------------------------------------------
    def computation(self, pos: int):
        text = self.text
        start = pos
        is_entry = text.startswith("ENTRY", pos) and text[pos + 5:pos + 6].isspace()
        if is_entry:
            pos = self.skip(pos + len("ENTRY"))
        m = _NAME_TOKEN.match(text, pos)
        if not m:
            raise _Error("expected a computation header like '%name (...) -> ... {' or "
                         "'ENTRY %main {'", pos)
        name = m.group(1)
        pos = self.skip(m.end())
        if text.startswith("=", pos):
            raise _Error("expected a computation header like '%name {', found an "
                         "instruction outside any computation", start)
        if text.startswith("(", pos):  # signature: (p: shape, ...) -> shape
            close = find_close(text, pos)
            if close < 0:
                raise _Error(f"unbalanced '(' in the signature of computation '{name}'", pos)
            pos = self.expect(close + 1, "->", f"after the parameters of computation '{name}'")
            try:
                _, pos = parse_shape(text, self.skip(pos))
            except ShapeSyntaxError as e:
                raise _Error(f"malformed result shape of computation '{name}': {e}",
                             e.offset) from None
        pos = self.expect(pos, "{", f"to open computation '{name}'")
        comp = Computation(name, is_entry=is_entry)
        names: dict[str, Instruction] = {}
        operand_refs, calls, root = [], [], None
        while True:
            pos = self.skip(pos)
            if pos >= len(text):
                raise _Error(f"computation '{name}' is not closed with '}}' (truncated file?)",
                             pos)
            if text[pos] == "}":
                pos += 1
                break
            instr, is_root, refs, called, pos = self.instruction(pos)
            self.instructions += 1
            if self.instructions > INSTRUCTIONS_MAX:
                raise _Error(f"more than {INSTRUCTIONS_MAX:,} instructions in the module; "
                             f"alpac reads at most that many", instr.line)
            if instr.name in names:
                raise _Error(f"instruction '{instr.name}' is defined twice", instr.line)
            names[instr.name] = instr
            comp.append(instr)
            operand_refs.append((instr, refs))
            calls.extend((instr, key, value, off) for key, (value, off) in called.items())
            if is_root:
                root = instr
        if not comp.instructions:
            raise _Error(f"computation '{name}' has no instructions", pos - 1)
        typed = []  # operands printed with a shape: (instruction, operand, shape text, offset)
        for instr, refs in operand_refs:
            ops = []
            for ref, offset, shape_text in refs:
                op = names.get(ref)
                if op is None:
                    raise _Error(f"operand '{ref}' of '{instr.name}' is not defined in "
                                 f"computation '{name}'", offset)
                ops.append(op)
                if shape_text:
                    typed.append((instr, op, shape_text, offset))
            instr.operands = ops
        for instr in comp.instructions:  # in order, so inferred shapes feed later ones
            if instr.shape is None:
                instr.shape = _infer_shape(instr)
                if instr.shape is None:
                    raise _Error(f"'{instr.name}' has no shape and its shape cannot be "
                                 f"inferred from its operands", instr.line)
                if instr.shape.nesting > TUPLE_DEPTH_MAX:
                    raise _Error(f"'{instr.name}' makes a tuple shape nested more than "
                                 f"{TUPLE_DEPTH_MAX} deep", instr.line)
        for instr, op, shape_text, offset in typed:
            _check_operand_shape(instr, op, shape_text, offset)
        comp.root = root or comp.instructions[-1]
        try:
            comp.topological_sort()
        except ValueError as e:
            raise _Error(str(e), start) from None
        for instr in comp.instructions:
            instr.line = self.line_col(instr.line)[0]
        return comp, (calls, start), pos

    # ---- instructions -----------------------------------------------------------------------
    def instruction(self, pos: int):
        text = self.text
        start = pos
        is_root = text.startswith("ROOT", pos) and text[pos + 4:pos + 5].isspace()
        if is_root:
            pos = self.skip(pos + 4)
        m = _NAME_TOKEN.match(text, pos)
        if not m:
            raise _Error("expected an instruction 'name = shape opcode(operands)' or '}'", pos)
        name = m.group(1)
        pos = self.expect(m.end(), "=", f"after instruction name '{name}'")
        pos = self.skip(pos)
        shape = None
        if not _OPCODE.match(text, pos):  # XLA may omit shapes it can infer
            try:
                shape, pos = parse_shape(text, pos)
            except ShapeSyntaxError as e:
                raise _Error(f"malformed shape of '{name}': {e}", e.offset) from None
            pos = self.skip(pos)
        om = _OPCODE.match(text, pos)
        if not om:
            raise _Error(f"expected an opcode followed by '(' after the shape of '{name}'", pos)
        opcode = om.group(1)
        open_pos = om.end() - 1
        close = find_close(text, open_pos)
        if close < 0:
            raise _Error(f"unbalanced parentheses in the operands of '{name}'", open_pos)
        payload, refs = None, []
        if opcode in ("constant", "parameter"):
            payload = " ".join(text[open_pos + 1:close].split())
            if opcode == "parameter" and not (payload.isascii() and payload.isdigit()):
                raise _Error(f"parameter '{name}' needs a number, found "
                             f"'{clipped(payload)}'", open_pos + 1)
            if opcode == "parameter" and not within(payload, PARAMETERS_MAX - 1):
                raise _Error(f"parameter '{name}' is numbered {clipped(payload)}; parameter "
                             f"numbers are below {PARAMETERS_MAX:,}", open_pos + 1)
        else:
            for a, b in split_top_level(text, open_pos + 1, close):
                item = _COMMENT.sub("", text[a:b]).strip()
                nm = _OPERAND_NAME.search(item)
                if not nm:
                    raise _Error(f"malformed operand '{item[:40]}' of '{name}'", a)
                refs.append((nm.group(1), self.skip(a), item[:nm.start()]))
        attrs, where, pos = self.attributes(close + 1)
        called = {k: (v, where[k]) for k, v in attrs.items() if k in COMPUTATION_ATTRS}
        instr = Instruction(name, opcode, shape, (), attrs, payload, start)
        return instr, is_root, refs, called, pos


def _check_operand_shape(instr: Instruction, op: Instruction, text: str, offset: int) -> None:
    """An operand printed with its shape (`f32[8]{0} %x`) must be printed with the shape it
    was defined with (layouts aside), as XLA's parser requires."""
    try:
        shape, end = parse_shape(text)
    except ShapeSyntaxError as e:
        raise _Error(f"malformed shape of operand '{op.name}' of '{instr.name}': {e}",
                     offset) from None
    if text[end:].strip():
        raise _Error(f"malformed operand '{text.strip()[:40]} %{op.name}' of '{instr.name}'",
                     offset)
    if not same_shape(shape, op.shape):
        raise _Error(f"'{instr.name}' gives its operand '{op.name}' the shape "
                     f"{shape.without_layout()}, but '{op.name}' is "
                     f"{op.shape.without_layout()}", offset)


def _infer_shape(instr: Instruction) -> Shape | None:
    """The shape of an instruction printed without one (XLA allows it where it is implied)."""
    ops = instr.operands
    if instr.opcode == "tuple":
        return Shape.tuple_of(op.shape for op in ops)
    if instr.opcode == "get-tuple-element" and ops and ops[0].shape.is_tuple:
        return ops[0].shape.tuple_shapes[instr.tuple_index]
    if instr.opcode == "compare" and ops:
        return Shape.array("pred", ops[0].shape.dims)
    if instr.opcode in ELEMENTWISE and instr.opcode != "convert" and ops:
        return ops[-1].shape
    return None


def _computation_names(value: str) -> list[str]:
    value = value.strip()
    if value.startswith("{"):
        value = value[1:-1]
    return [v.strip().lstrip("%") for v in value.split(",") if v.strip()]


def _shape_index(text: str) -> tuple[int, ...]:
    text = text.strip().strip("{}")
    return tuple(int(x) for x in text.split(",") if x.strip())


_ALIAS = re.compile(
    r"\{([\d,\s]*)\}\s*:\s*\(\s*(\d+)\s*,\s*\{([\d,\s]*)\}\s*(?:,\s*([a-z\-]+)\s*)?\)")
_DONOR = re.compile(r"\(\s*(\d+)\s*,\s*\{([\d,\s]*)\}\s*\)")


def _parse_aliases(value: str) -> list[Alias]:
    out = [Alias(_shape_index(m.group(1)), int(m.group(2)), _shape_index(m.group(3)),
                 m.group(4) or "may-alias") for m in _ALIAS.finditer(value)]
    if not out and value.strip("{} "):
        raise ValueError("expected entries like {0}: (0, {}, may-alias)")
    return out


def _parse_donors(value: str) -> list[tuple[int, tuple[int, ...]]]:
    return [(int(m.group(1)), _shape_index(m.group(2))) for m in _DONOR.finditer(value)]


def _parse_entry_layout(value: str) -> tuple[list[Shape], Shape]:
    text = value.strip()[1:-1]  # drop the outer braces
    params, pos = parse_shape(text, 0)
    arrow = text.index("->", pos)
    result, _ = parse_shape(text, arrow + 2)
    return list(params.tuple_shapes), result
