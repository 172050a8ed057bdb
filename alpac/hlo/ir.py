"""The one HLO representation every pass works on.

A `Module` holds `Computation`s, a computation holds `Instruction`s in a topological order.
Attributes XLA printed are kept as their exact text (`Instruction.attrs`), so nothing is lost,
and typed views (`dims`, `window`, `parameter_number`, ...) read them on demand. References to
other computations (`to_apply`, `body`, `calls`, ...) are held as objects, so renaming or
extracting a computation keeps them right. Analyses of a module are results of their own
(passes hand them on by type), never attached to the IR.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from alpac.hlo.opcodes import IDENTITY_CUSTOM_CALLS, SIDE_EFFECTING
from alpac.hlo.shape import Shape

# Attributes whose values name computations.
COMPUTATION_ATTRS = frozenset({
    "to_apply", "body", "condition", "calls", "branch_computations", "true_computation",
    "false_computation", "select", "scatter", "called_computations", "async_wrapped_computation",
})

_DIMS = re.compile(r"-?\d+")
_SDY_RULE = re.compile(r"#sdy\.op_sharding_rule<\((.*?)\)->\((.*?)\)\s*\{([^}]*)\}(.*?)>")
_SDY_SPECIAL = re.compile(r"(reduction|need_replication|permutation|blocked)")


def _factor_lists(text: str) -> list[list[str]]:
    return [[f.strip() for f in grp.split(",") if f.strip()]
            for grp in re.findall(r"\[([^\]]*)\]", text)]


class ComputationRefs(tuple):
    """Computations named by one attribute; `braced` remembers `{%a, %b}` vs `%a`."""

    braced: bool = False

    def __new__(cls, comps: Iterable["Computation"], braced: bool = False):
        obj = super().__new__(cls, tuple(comps))
        obj.braced = braced
        return obj


class Instruction:
    __slots__ = ("name", "opcode", "shape", "operands", "attrs", "payload", "parent", "line")

    def __init__(self, name: str, opcode: str, shape: Shape, operands=(), attrs=None,
                 payload: str | None = None, line: int | None = None):
        self.name = name
        self.opcode = opcode
        self.shape = shape
        self.operands: list[Instruction] = list(operands)
        self.attrs: dict[str, object] = dict(attrs or {})
        self.payload = payload  # text inside the parentheses of constant/parameter
        self.parent: Computation | None = None
        self.line = line  # source line, for messages

    def __repr__(self) -> str:
        return f"<{self.name} = {self.shape} {self.opcode}>"

    # ---- called computations -------------------------------------------------------------
    @property
    def called_computations(self) -> list["Computation"]:
        out = []
        for key, value in self.attrs.items():
            if isinstance(value, ComputationRefs):
                out.extend(value)
        return out

    def called(self, key: str) -> "Computation | None":
        refs = self.attrs.get(key)
        return refs[0] if isinstance(refs, ComputationRefs) and refs else None

    # ---- typed views of attributes ---------------------------------------------------------
    def dims(self, key: str) -> tuple[int, ...]:
        """An integer-list attribute such as `dimensions={0,1}` or `lhs_batch_dims={0}`."""
        value = self.attrs.get(key)
        if value is None:
            return ()
        return tuple(int(x) for x in _DIMS.findall(str(value)))

    def int_attr(self, key: str, default: int | None = None) -> int | None:
        value = self.attrs.get(key)
        return default if value is None else int(str(value))

    @property
    def parameter_number(self) -> int:
        return int(self.payload)

    @property
    def tuple_index(self) -> int:
        return int(str(self.attrs["index"]))

    @property
    def sharding_text(self) -> str | None:
        value = self.attrs.get("sharding")
        return None if value is None else str(value)

    @property
    def custom_call_target(self) -> str | None:
        value = self.attrs.get("custom_call_target")
        return None if value is None else str(value).strip('"')

    def sharding_rule(self):
        """(operand factors, result factors, factor sizes) of a custom-call's Shardy
        `op_sharding_rule`, or None. Factors the rule marks reduction, need-replication,
        permutation or blocked carry a trailing '!' in the operand lists."""
        text = str(self.attrs.get("frontend_attributes", ""))
        if "op_sharding_rule" not in text:
            return None
        m = _SDY_RULE.search(text.replace('\\"', '"'))
        if not m:
            return None
        sizes = {}
        for item in m.group(3).split(","):
            k, _, v = item.partition("=")
            if v.strip().isdigit():
                sizes[k.strip()] = int(v)
        special = m.group(4)
        ops, res = _factor_lists(m.group(1)), _factor_lists(m.group(2))
        if _SDY_SPECIAL.search(special):
            bad = set(re.findall(r"\b([a-z]\w*)\b", special.split("}", 1)[0]))
            ops = [[f if f not in bad else f + "!" for f in grp] for grp in ops]
        return ops, res, sizes

    @property
    def is_identity_call(self) -> bool:
        """A custom-call that returns its one operand as it is (an annotation)."""
        return (self.opcode == "custom-call" and self.custom_call_target in IDENTITY_CUSTOM_CALLS
                and len(self.operands) == 1
                and self.shape.without_layout() == self.operands[0].shape.without_layout())

    def window(self) -> dict[str, list]:
        """`window={size=3x3 stride=2x2 pad=1_1x1_1}` as lists per dimension."""
        text = str(self.attrs.get("window", "{}")).strip("{}")
        out: dict[str, list] = {}
        for item in text.split():
            key, _, value = item.partition("=")
            parts = value.split("x")
            if key == "pad":
                out[key] = [tuple(int(v) for v in p.split("_")) for p in parts]
            elif key == "rhs_reversal":
                out[key] = [p == "1" for p in parts]
            else:
                out[key] = [int(p) for p in parts]
        return out

    def scalar_constant(self) -> float | None:
        """The value of a scalar constant (or None)."""
        if self.opcode != "constant" or self.shape.rank != 0 or self.shape.is_tuple:
            return None
        text = (self.payload or "").strip()
        if text in ("true", "false"):
            return 1.0 if text == "true" else 0.0
        try:
            return float(text)
        except ValueError:
            return None


class Computation:
    def __init__(self, name: str, instructions: Iterable[Instruction] = (), root=None,
                 is_entry: bool = False):
        self.name = name
        self.instructions: list[Instruction] = []
        for instr in instructions:
            self.append(instr)
        self.root: Instruction | None = root or (self.instructions[-1] if self.instructions
                                                 else None)
        self.is_entry = is_entry

    def __repr__(self) -> str:
        return f"<computation {self.name}: {len(self.instructions)} instructions>"

    def append(self, instr: Instruction) -> Instruction:
        instr.parent = self
        self.instructions.append(instr)
        return instr

    @property
    def parameters(self) -> list[Instruction]:
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: i.parameter_number)

    def users(self) -> dict[Instruction, list[Instruction]]:
        """Users of every instruction (each user once, in instruction order)."""
        out: dict[Instruction, list[Instruction]] = {i: [] for i in self.instructions}
        for instr in self.instructions:
            for op in dict.fromkeys(instr.operands):
                out[op].append(instr)
        return out

    def topological_sort(self) -> None:
        """Reorder so operands come first, keeping the given order where it already holds."""
        placed: set[int] = set()
        order: list[Instruction] = []
        for start in self.instructions:
            if id(start) in placed:
                continue
            stack = [(start, iter(start.operands))]
            on_stack = {id(start)}
            while stack:
                node, it = stack[-1]
                nxt = next((op for op in it if id(op) not in placed), None)
                if nxt is None:
                    stack.pop()
                    on_stack.discard(id(node))
                    placed.add(id(node))
                    order.append(node)
                elif id(nxt) in on_stack:
                    raise ValueError(f"cycle through instruction {nxt.name} in {self.name}")
                else:
                    stack.append((nxt, iter(nxt.operands)))
                    on_stack.add(id(nxt))
        self.instructions = order

    def remove_dead(self) -> None:
        """Drop instructions the root does not need (parameters are always kept)."""
        live = set()
        stack = [self.root] + [i for i in self.instructions
                               if i.opcode == "parameter" or _has_side_effect(i)]
        while stack:
            node = stack.pop()
            if id(node) in live:
                continue
            live.add(id(node))
            stack.extend(node.operands)
        self.instructions = [i for i in self.instructions if id(i) in live]


def _has_side_effect(instr: Instruction, _seen: set[int] | None = None) -> bool:
    """Side effects as XLA's dead-code elimination sees them: I/O, rng, side-effecting custom
    calls, and any instruction whose called computations (a while body) have one."""
    if (instr.opcode in SIDE_EFFECTING
            or str(instr.attrs.get("custom_call_has_side_effect", "")) == "true"):
        return True
    seen = set() if _seen is None else _seen
    for comp in instr.called_computations:
        if id(comp) in seen:
            continue
        seen.add(id(comp))
        if any(_has_side_effect(i, seen) for i in comp.instructions):
            return True
    return False


_ZERO_LITERAL = re.compile(r"[\s{},()0.+\-e]*")


def is_zero_constant(instr: Instruction) -> bool:
    """A numeric constant all of whose elements are zero."""
    text = (instr.payload or "").strip()
    if instr.opcode != "constant" or instr.shape.is_tuple or not text or \
            not instr.shape.is_float and not instr.shape.dtype.startswith(("s", "u")):
        return False
    return "0" in text and bool(_ZERO_LITERAL.fullmatch(text))


@dataclass
class Alias:
    """One entry of input_output_alias: output index aliases (parameter, index)."""

    output_index: tuple[int, ...]
    parameter_number: int
    parameter_index: tuple[int, ...] = ()
    kind: str = "may-alias"


class UniqueNames:
    """Names not yet taken: `fresh(base)` is `base` itself when that is free, else the first
    free one of `base.1`, `base.2`, ...; a name handed out is taken from then on."""

    def __init__(self, taken: Iterable[str] = ()):
        self.taken: set[str] = set(taken)
        self._tried: dict[str, int] = {}  # base -> the last suffix found taken (names are
        # never given back, so the search for the next one starts there: unrolling 48
        # copies of a layer asks for each of its names 48 times)

    def fresh(self, base: str) -> str:
        name, k = base, self._tried.get(base, 0)
        if k:
            name = f"{base}.{k}"
        while name in self.taken:
            k += 1
            name = f"{base}.{k}"
        self._tried[base] = k
        self.taken.add(name)
        return name


@dataclass
class Module:
    name: str
    computations: list[Computation]
    entry: Computation
    attrs: dict[str, str] = field(default_factory=dict)  # other header attributes, verbatim
    input_output_alias: list[Alias] = field(default_factory=list)
    buffer_donors: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    entry_layout: tuple[list[Shape], Shape] | None = None  # entry_computation_layout
    _names: UniqueNames | None = field(default=None, repr=False, compare=False)

    def computation(self, name: str) -> Computation:
        for comp in self.computations:
            if comp.name == name:
                return comp
        raise KeyError(name)

    def instructions(self) -> Iterator[Instruction]:
        for comp in self.computations:
            yield from comp.instructions

    def instruction_count(self) -> int:
        return sum(len(c.instructions) for c in self.computations)

    def callee_order(self) -> list[Computation]:
        """Computations with every callee before its caller, entry last."""
        order: list[Computation] = []
        seen: set[int] = set()

        def visit(comp: Computation) -> None:
            if id(comp) in seen:
                return
            seen.add(id(comp))
            for instr in comp.instructions:
                for callee in instr.called_computations:
                    visit(callee)
            order.append(comp)

        for comp in self.computations:
            if comp is not self.entry:
                visit(comp)
        visit(self.entry)
        return order

    def unique_name(self, base: str) -> str:
        if self._names is None:
            self._names = UniqueNames({i.name for i in self.instructions()}
                                      | {c.name for c in self.computations})
        return self._names.fresh(base)

    def clone(self) -> "Module":
        """A copy sharing nothing mutable."""
        comp_map: dict[int, Computation] = {}
        for comp in self.computations:
            comp_map[id(comp)] = Computation(comp.name, is_entry=comp.is_entry)
        for comp in self.computations:
            new_comp = comp_map[id(comp)]
            instr_map: dict[int, Instruction] = {}
            for instr in comp.instructions:
                attrs = {k: (ComputationRefs((comp_map[id(c)] for c in v), v.braced)
                             if isinstance(v, ComputationRefs) else v)
                         for k, v in instr.attrs.items()}
                new = Instruction(instr.name, instr.opcode, instr.shape,
                                  [instr_map[id(o)] for o in instr.operands], attrs,
                                  instr.payload, instr.line)
                instr_map[id(instr)] = new_comp.append(new)
            new_comp.root = instr_map[id(comp.root)] if comp.root is not None else None
        return Module(self.name, [comp_map[id(c)] for c in self.computations],
                      comp_map[id(self.entry)], dict(self.attrs),
                      [copy.copy(a) for a in self.input_output_alias], list(self.buffer_donors),
                      self.entry_layout)
