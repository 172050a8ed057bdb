"""Batch-dimension analysis: the batch class of every instruction (see `lattice`).

Given which entry parameters carry the batch (and on which dim), `Dataflow` propagates, in
instruction order, whether each value is split along the batch (and on which dim, through
reshapes that merge or split the batch dim, transposes, broadcasts, dots, convolutions,
gathers, scatters, ...), a partial sum over the batch, independent of it, or needs the whole
batch. While loops are analysed to a fixed point over their carried tuple; calls,
conditionals and fusions through their computations; other ops without a rule are opaque
(independent if all their operands are, else FULL).

Besides the classes it records what the microbatch rewrite and the exactness guard need:

- `need[instr][i] = k`: operand i is independent of the batch but meets batch-split data
  along its dim k (an iota or a broadcast constant of batch size), so the per-microbatch
  module must use its microbatch slice along k;
- `full_uses`: (instr, i) where a per-example computation uses a PSUM or FULL operand — the
  value must exist for the whole batch before any microbatch runs (a batch statistic);
- `scale_uses`: (instr, i) where a batch sum is scaled by a FULL operand (a loss divided by
  the number of real tokens): the result is a batch sum if that operand is known first;
- `blockers`: (instr, reason) that can never be microbatched exactly (batch-norm-training);
- `mixes`: (instr, reason) where examples are mixed with each other (a FULL made from split
  values without summing them) — used to reject wrong guesses of the batch dims;
- `origin[instr]`: the instruction that made a PSUM/FULL value (the reduction over the batch
  behind it), for messages.
"""

from __future__ import annotations

import math

from alpac.analysis.step.lattice import FULL, INDEP, PSUM, ZERO, Cls, all_indep, join, leaves, \
    like_shape, split
from alpac.analysis.step.oprules import OpRules, reducer_kind
from alpac.hlo.ir import Computation, Instruction, Module, is_zero_constant
from alpac.hlo.opcodes import COPY_PAIR, ELEMENTWISE, PASS_THROUGH, SLICES, VALUE_COPIES, VIEWS

# Ops that are linear in each operand taken alone (unary) — a PSUM stays a PSUM.
_LINEAR_UNARY = frozenset({"negate", "copy", "real", "imag", "reduce-precision"})
# Ops that only move, copy or broadcast a value: a batch statistic is found behind them.
_CHEAP_VIEWS = VIEWS | VALUE_COPIES | {"broadcast"}
# Ops whose result is zero when their (first) operand is zero.
_ZERO_KEEPING = _CHEAP_VIEWS | _LINEAR_UNARY | SLICES | {"reverse"}
# Ops whose result is their operand: the class passes through.
_PASS_THROUGH = PASS_THROUGH | COPY_PAIR
def _plain(c) -> bool:
    """A tuple class whose leaves are all INDEP (not ZERO)."""
    return all(x is INDEP or x.__class__ is tuple and _plain(x) for x in c)



class Dataflow(OpRules):
    """Batch classes of the entry computation of `module` (and of what it calls).

    `batch_dims` maps entry parameter numbers to their batch dim; `batch_size` is N.
    `prologue` lists entry instructions whose value is computed once for the whole batch
    before the microbatches (batch-only statistics): they count as independent of the batch.
    `scope` (entry instructions to walk, in order; the classes of the others) walks only what
    a split can change (alpac.analysis.step.batch tries many splits of one module).
    """

    def __init__(self, module: Module, batch_dims: dict[int, int], batch_size: int,
                 prologue=(), scope: tuple[list[Instruction], dict] | None = None):
        self.module = module
        self.batch_dims = dict(batch_dims)
        self.N = batch_size
        self.prologue = set(prologue)
        self.cls: dict[Instruction, object] = {}
        self.need: dict[Instruction, dict[int, int]] = {}
        self.full_uses: list[tuple[Instruction, int]] = []
        self.scale_uses: list[tuple[Instruction, int]] = []
        self.blockers: list[tuple[Instruction, str]] = []
        self.mixes: list[tuple[Instruction, str]] = []
        self.origin: dict[Instruction, Instruction] = {}
        self.why: dict[Instruction, str] = {}
        self.assumed: list[tuple[Instruction, str]] = []
        self._record = True
        self._rules = {
            "parameter": None, "constant": self._constant, "tuple": self._tuple,
            "get-tuple-element": self._gte, "broadcast": self._broadcast,
            "reshape": self._reshape, "bitcast": self._reshape, "transpose": self._transpose,
            "reduce": self._reduce, "dot": self._dot, "convolution": self._convolution,
            "slice": self._slice, "dynamic-slice": self._dynamic_slice,
            "dynamic-update-slice": self._dus, "pad": self._pad,
            "concatenate": self._concatenate, "gather": self._gather, "scatter": self._scatter,
            "sort": self._sort, "reverse": self._reverse, "reduce-window": self._reduce_window,
            "topk": self._topk, "fft": self._fft,
            "select-and-scatter": self._select_and_scatter,
            "batch-norm-training": self._bn_training, "batch-norm-grad": self._bn_training,
            "batch-norm-inference": self._bn_inference, "custom-call": self._custom_call,
            "while": self._while, "call": self._call, "fusion": self._fusion,
            "conditional": self._conditional, "map": self._elementwise,
        }
        for op in ELEMENTWISE:
            self._rules.setdefault(op, self._elementwise)
        for op in _PASS_THROUGH:
            self._rules[op] = self._pass_through
        walk, self._unwalked = scope if scope is not None else (None, {})
        self._computation(module.entry, None, walk)

    # ---- results ---------------------------------------------------------------------------
    def of(self, instr: Instruction):
        """The class of an instruction (INDEP for instructions never reached)."""
        c = self.cls.get(instr)
        if c is None:
            c = self._unwalked.get(instr)
        return c if c is not None else like_shape(instr.shape, INDEP)

    def touched(self, instr: Instruction) -> bool:
        """Whether the value depends on the batch (some leaf split, psum or full)."""
        return not all_indep(self.of(instr))

    def root_origin(self, instr: Instruction) -> Instruction:
        seen = set()
        while instr in self.origin and self.origin[instr] is not instr and instr not in seen:
            seen.add(instr)
            instr = self.origin[instr]
        return instr

    # ---- the walk ----------------------------------------------------------------------------
    def _computation(self, comp: Computation, param_classes: list | None, walk=None):
        cls = self.cls
        unwalked = self._unwalked
        rules = self._rules
        for x in comp.instructions if walk is None else walk:
            op = x.opcode
            if op == "parameter":
                if param_classes is None:
                    dim = self.batch_dims.get(x.parameter_number)
                    c = split(dim) if dim is not None else like_shape(x.shape, INDEP)
                else:
                    n = x.parameter_number
                    c = param_classes[n] if n < len(param_classes) else \
                        like_shape(x.shape, INDEP)
                cls[x] = c
                continue
            if param_classes is None and x in self.prologue:
                cls[x] = like_shape(x.shape, INDEP)
                continue
            ocs = [cls.get(o) or unwalked.get(o) or like_shape(o.shape, INDEP)
                   for o in x.operands]
            if op != "constant" and all(c is INDEP or c.__class__ is tuple and _plain(c)
                                        for c in ocs):
                cls[x] = INDEP if not x.shape.is_tuple else like_shape(x.shape, INDEP)
                continue
            rule = rules.get(op)
            if rule is None:
                rule = self._opaque
            cls[x] = rule(x, ocs)
        return cls.get(comp.root, INDEP)

    def _called(self, comp: Computation | None, param_classes: list):
        if comp is None:
            return FULL
        return self._computation(comp, param_classes)

    # ---- recording ---------------------------------------------------------------------------
    def _need(self, x: Instruction, i: int, dim: int) -> None:
        if self._record and x.operands[i].shape.rank > 0:
            self.need.setdefault(x, {})[i] = dim

    def _full_use(self, x: Instruction, i: int) -> None:
        if self._record:
            self.full_uses.append((x, i))

    def _mix(self, x: Instruction, reason: str):
        self.origin[x] = x
        self.why[x] = reason
        if self._record:
            self.mixes.append((x, reason))
        return like_shape(x.shape, FULL)

    def _sum(self, x: Instruction) -> Cls:
        self.origin[x] = x
        return PSUM

    def _from(self, x: Instruction, kind_cls: Cls, ocs) -> Cls:
        """`kind_cls` (PSUM or FULL) inheriting the origin of the first such operand."""
        for o, c in zip(x.operands, ocs):
            if isinstance(c, Cls) and c.kind in "PF" or not isinstance(c, Cls) and any(
                    leaf.kind in "PF" for leaf in leaves(c)):
                if o in self.origin:
                    self.origin[x] = self.origin[o]
                    break
        return kind_cls

    def _full(self, x: Instruction, ocs, reason: str | None = None):
        if reason is not None:
            self.origin[x] = x
            self.why[x] = reason
        else:
            self._from(x, FULL, ocs)
        return like_shape(x.shape, FULL)

    def _opaque(self, x: Instruction, ocs):
        if all(all_indep(c) for c in ocs):
            return like_shape(x.shape, INDEP)
        if any(leaf.kind == "S" for c in ocs for leaf in leaves(c)):
            return self._mix(x, f"{x.opcode} has no batch rule (treated as needing the "
                                f"whole batch)")
        return self._full(x, ocs)

    # ---- helpers -------------------------------------------------------------------------------
    def _the_split(self, x: Instruction, ocs, indices=None) -> Cls | None | bool:
        """The common split class of the operands (None if none; False if they disagree)."""
        s = None
        for i, c in enumerate(ocs):
            if indices is not None and i not in indices:
                continue
            if isinstance(c, Cls) and c.kind == "S":
                if s is None:
                    s = c
                elif c != s:
                    return False
        return s

    def _meet_split(self, x: Instruction, ocs, s: Cls, dim_of=None) -> None:
        """Record needs of independent operands and full uses of summed ones."""
        for i, c in enumerate(ocs):
            if not isinstance(c, Cls):
                continue
            if c.kind in "IZ":
                if dim_of is None:
                    self._need(x, i, s.dim)
                elif dim_of(i) is not None:
                    self._need(x, i, dim_of(i))
            elif c.kind in "PF":
                self._full_use(x, i)

    def _zero_rule(self, x: Instruction, ocs) -> Cls:
        kinds = [c.kind if isinstance(c, Cls) else "?" for c in ocs]
        op = x.opcode
        if not kinds:
            return INDEP
        if op in _ZERO_KEEPING and kinds[0] == "Z":
            return ZERO
        if op in ("multiply", "dot") and "Z" in kinds:
            return ZERO
        if op in ("add", "subtract", "concatenate", "pad", "maximum", "minimum") and \
                all(k == "Z" for k in kinds):
            return ZERO
        if op == "select" and kinds[1:] == ["Z", "Z"]:
            return ZERO
        if op == "dynamic-update-slice" and kinds[:2] == ["Z", "Z"]:
            return ZERO
        return INDEP

    # ---- rules -------------------------------------------------------------------------------
    def _constant(self, x, ocs):
        return ZERO if is_zero_constant(x) else like_shape(x.shape, INDEP)

    def _pass_through(self, x, ocs):
        return ocs[0] if ocs else INDEP

    def _tuple(self, x, ocs):
        return tuple(ocs)

    def _gte(self, x, ocs):
        c = ocs[0]
        if isinstance(c, Cls):
            return like_shape(x.shape, c)
        src = x.operands[0]
        if src.opcode == "tuple":
            src = src.operands[x.tuple_index]
        elif src.opcode == "while":
            body = src.called("body")
            if body is not None and body.root.opcode == "tuple":
                src = body.root.operands[x.tuple_index]
        if src in self.origin:
            self.origin[x] = self.origin[src]
        return c[x.tuple_index]

    def _elementwise(self, x, ocs):
        if any(not isinstance(c, Cls) for c in ocs):
            return self._opaque(x, ocs)
        s = self._the_split(x, ocs)
        if s is False:
            return self._mix(x, "combines values split along different dims")
        if s is not None:
            self._meet_split(x, ocs, s)
            return s
        kinds = [c.kind for c in ocs]
        if "F" in kinds:
            if "P" in kinds and self._record and \
                    self._linear(x, ["I" if k == "F" else k for k in kinds]):
                # a sum scaled by a whole-batch value: linear if that value came first
                self.scale_uses.extend((x, i) for i, k in enumerate(kinds) if k == "F")
            return self._full(x, ocs)
        if "P" in kinds:
            return self._from(x, PSUM if self._linear(x, kinds) else FULL, ocs)
        return self._zero_rule(x, ocs)

    def _linear(self, x: Instruction, kinds: list[str]) -> bool:
        op = x.opcode
        if op in ("add", "subtract", "complex"):
            return all(k in "PZ" for k in kinds)
        if op == "multiply":
            return kinds.count("P") == 1
        if op == "divide":
            return kinds[0] == "P" and kinds[1] in "IZ"
        if op in _LINEAR_UNARY:
            return True
        if op == "convert":
            return x.shape.is_float and x.operands[0].shape.is_float
        if op == "select":
            return kinds[0] in "IZ" and kinds[1] in "PZ" and kinds[2] in "PZ"
        return False

    def _broadcast(self, x, ocs):
        c = ocs[0]
        if c.kind == "S":
            return split(x.dims("dimensions")[c.dim], c.inner)
        if c.kind in "PF":
            return self._from(x, c, ocs)
        return self._zero_rule(x, ocs)

    def _transpose(self, x, ocs):
        c = ocs[0]
        if c.kind == "S":
            return split(x.dims("dimensions").index(c.dim), c.inner)
        if c.kind in "PF":
            return self._from(x, c, ocs)
        return self._zero_rule(x, ocs)

    def _reshape(self, x, ocs):
        c = ocs[0]
        if not isinstance(c, Cls):
            return self._opaque(x, ocs)
        if c.kind != "S":
            if c.kind in "PF":
                return self._from(x, c, ocs)
            return self._zero_rule(x, ocs)
        src = x.operands[0].shape.dims
        dst = x.shape.dims
        if x.opcode == "bitcast" and (math.prod(src) != math.prod(dst)
                                      or x.shape.dtype != x.operands[0].shape.dtype):
            return self._mix(x, "a bitcast that changes the element type")
        pre = math.prod(src[:c.dim])
        acc = 1
        for e, size in enumerate(dst):
            if acc == pre and size > 0 and size % self.N == 0:
                return split(e, size // self.N)
            acc *= size
            if acc > pre:
                break
        return self._mix(x, f"a reshape {list(src)} -> {list(dst)} that does not keep the "
                            f"batch as the major part of one dim")

    def _reduce(self, x, ocs):
        n = len(x.operands) // 2
        ins, inits = ocs[:n], ocs[n:]
        if any(not isinstance(c, Cls) for c in ocs):
            return self._opaque(x, ocs)
        dims = x.dims("dimensions")
        kind = reducer_kind(x.called("to_apply"))
        is_sum = n == 1 and kind == "add" and inits[0].kind == "Z"
        s = self._the_split(x, ins)
        if s is False:
            return self._mix(x, "reduces values split along different dims")
        if any(c.kind in "PF" for c in inits):
            if s is not None:
                for i in range(n, 2 * n):
                    if ocs[i].kind in "PF":
                        self._full_use(x, i)
            else:
                return self._full(x, ocs)
        if s is not None:
            self._meet_split(x, ins, s)
            if s.dim in dims:
                if is_sum:
                    return self._sum(x)
                return self._full(x, ocs, f"a {kind or 'non-additive'} reduction over the "
                                          f"batch")
            new = split(s.dim - sum(1 for d in dims if d < s.dim), s.inner)
            return new if n == 1 else tuple(new for _ in range(n))
        kinds = [c.kind for c in ins]
        if "F" in kinds:
            return self._full(x, ocs)
        if "P" in kinds:
            if is_sum:
                return self._from(x, PSUM, ocs)
            return self._full(x, ocs)
        if n == 1 and kinds[0] == "Z" and inits[0].kind == "Z":
            return ZERO
        return like_shape(x.shape, INDEP)

    def _while(self, x, ocs):
        body, cond = x.called("body"), x.called("condition")
        state = ocs[0]
        record, self._record = self._record, False
        try:
            for _ in range(16):
                out = self._called(body, [state])
                new = join(state, out)
                if new == state:
                    break
                state = new
            else:
                state = like_shape(x.shape, FULL)
            cond_cls = self._called(cond, [state])
        finally:
            self._record = record
        if not all_indep(cond_cls):
            return self._full(x, ocs, "a while loop whose trip count depends on the batch")
        if record:
            self._called(body, [state])
            self._called(cond, [state])
        if any(leaf.kind in "PF" for leaf in leaves(state)):
            for o in x.operands:
                if o in self.origin:
                    self.origin[x] = self.origin[o]
                    break
            else:
                self.origin[x] = x
        return state

    def _call(self, x, ocs):
        return self._called(x.called("to_apply"), ocs)

    def _fusion(self, x, ocs):
        return self._called(x.called("calls"), ocs)

    def _conditional(self, x, ocs):
        if not all_indep(ocs[0]):
            return self._full(x, ocs, "a conditional whose branch depends on the batch")
        branches = list(x.attrs.get("branch_computations") or ())
        if not branches:
            branches = [x.called("true_computation"), x.called("false_computation")]
        out = None
        for k, comp in enumerate(branches):
            c = self._called(comp, [ocs[k + 1]])
            out = c if out is None else join(out, c)
        return out if out is not None else like_shape(x.shape, INDEP)


def batch_only(module: Module, batch_dims: dict[int, int],
               walk: list[Instruction] | None = None,
               unwalked: set[Instruction] = frozenset()) -> set[Instruction]:
    """Entry instructions that depend on no parameter other than the batch inputs (nor on
    anything with side effects): values the whole batch alone determines. With `walk` (entry
    instructions in order), those of them only, given the `unwalked` others that are."""
    out: set[Instruction] = set()
    for x in module.entry.instructions if walk is None else walk:
        if x.opcode == "parameter":
            if x.parameter_number in batch_dims:
                out.add(x)
        elif all(o in out or o in unwalked for o in x.operands) and x.opcode not in (
                "infeed", "recv", "rng", "rng-get-and-update-state"):
            out.add(x)
    return out


def analyse(module: Module, batch_dims: dict[int, int], batch_size: int,
            only: set[Instruction] | None = None, scope=None
            ) -> tuple[Dataflow, list[Instruction]]:
    """The dataflow with batch-only statistics moved to a prologue: every PSUM/FULL value
    that a per-example computation needs and that depends on the batch inputs alone is
    computed once for the whole batch first, and then counts as independent of the batch.
    Returns the final dataflow and those prologue values (in instruction order). `scope`:
    the walk and the other classes of one trial split (`Dataflow`), which `only` covers."""
    only = batch_only(module, batch_dims) if only is None else only
    pre: set[Instruction] = set()
    for _ in range(16):
        df = Dataflow(module, batch_dims, batch_size, pre, scope)
        new = set()
        for u, i in df.full_uses + df.scale_uses:
            v = u.operands[i]
            if v not in only or v.parent is not module.entry:
                continue
            # the statistic itself, not its broadcast to the batch's shape
            while v.opcode in _CHEAP_VIEWS and v.operands and v.operands[0] in only and \
                    not all_indep(df.of(v.operands[0])):
                v = v.operands[0]
            new.add(v)
        if new <= pre:
            break
        pre |= new
    order = module.entry.instructions if scope is None else scope[0]
    return df, [x for x in order if x in pre]
