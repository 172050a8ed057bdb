"""Which entry parameters carry the batch, and on which dim (`BatchInfo`).

A training step returns its state (weights, optimizer moments, batch-norm statistics) as
outputs of the same shape — aliased to the parameter (donated) or not; batch inputs do not
come back, share one batch size and reach the loss through every layer. So:

1. parameters aliased to an output, or returned as an output of the same shape that depends
   on them, are state;
2. every other non-scalar parameter dim is a candidate; the batch-dimension analysis
   (`Dataflow`) runs with that one candidate split: a candidate is plausible when some output
   becomes split or a batch sum, and scores by the dots and convolutions it reaches;
3. the best candidate fixes the batch size N; the other candidates of size N join one by one
   if the analysis of the joint set mixes no examples that the smaller set did not.

Each trial analyses only what its split parameters reach (`_Trials`), so that a module with
thousands of candidates is not analysed whole thousands of times.

`--batch-args` (param:dim,...) overrides all of this.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from alpac.analysis.step.dataflow import Dataflow, analyse, batch_only
from alpac.analysis.step.lattice import all_indep, leaves
from alpac.errors import UserError
from alpac.hlo.ir import Instruction, Module
from alpac.hlo.opcodes import CONTRACTIONS


@dataclass
class BatchArg:
    param: int
    name: str
    dim: int
    shape: list[int]
    dtype: str

    def to_dict(self) -> dict:
        return {"param": self.param, "name": self.name, "dim": self.dim,
                "shape": self.shape, "dtype": self.dtype}


@dataclass
class BatchInfo:
    """The batch inputs of a module: parameter number, batch dim, and how sure we are."""

    args: list[BatchArg]
    size: int | None
    confidence: str  # 'high' | 'medium' | 'low' | 'none'
    evidence: list[str] = field(default_factory=list)
    reason: str | None = None  # why none was found
    given: bool = False  # from --batch-args

    @property
    def dims(self) -> dict[int, int]:
        return {a.param: a.dim for a in self.args}

    def to_dict(self) -> dict:
        return {"args": [a.to_dict() for a in self.args], "size": self.size,
                "confidence": self.confidence, "evidence": list(self.evidence),
                "reason": self.reason, "given": self.given}


def parse_batch_args(text: str) -> dict[int, int]:
    """'5:0,6:0' -> {5: 0, 6: 0}; a bare index means dim 0."""
    out: dict[int, int] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?::(\d+))?", item)
        if not m:
            raise UserError(f"--batch-args: expected param:dim items like '5:0,6:0', got "
                            f"'{item}'")
        out[int(m.group(1))] = int(m.group(2) or 0)
    if not out:
        raise UserError("--batch-args: no parameter given (expected e.g. '5:0,6:0')")
    return out


def batch_info_from_args(module: Module, dims: dict[int, int]) -> BatchInfo:
    """A BatchInfo for user-given batch args, checked against the entry's parameters."""
    params = {p.parameter_number: p for p in module.entry.parameters}
    args, sizes = [], set()
    for number, dim in sorted(dims.items()):
        p = params.get(number)
        if p is None:
            raise UserError(f"--batch-args: the entry has no parameter {number} (it has "
                            f"{len(params)})")
        if p.shape.is_tuple or dim >= p.shape.rank:
            raise UserError(f"--batch-args: parameter {number} ({p.shape}) has no dim {dim}")
        args.append(_arg(p, dim))
        sizes.add(p.shape.dims[dim])
    if len(sizes) != 1:
        raise UserError(f"--batch-args: the batch dims given have different sizes "
                        f"{sorted(sizes)}; batch inputs share one batch size")
    return BatchInfo(args, sizes.pop(), "high", ["given by --batch-args"], given=True)


def _arg(p: Instruction, dim: int) -> BatchArg:
    return BatchArg(p.parameter_number, p.name, dim, list(p.shape.dims), p.shape.dtype)


def output_sources(module: Module) -> list[Instruction]:
    """The instruction behind each output leaf (through the root's tuple instructions)."""
    out: list[Instruction] = []

    def walk(x: Instruction) -> None:
        if x.opcode == "tuple" and x.shape.is_tuple:
            for o in x.operands:
                walk(o)
        else:
            out.append(x)

    walk(module.entry.root)
    return out


def _state_params(module: Module) -> tuple[set[int], list[str]]:
    entry = module.entry
    aliased = {a.parameter_number for a in module.input_output_alias}
    evidence = []
    if aliased:
        evidence.append(f"{len(aliased)} parameters are aliased to outputs (donated state)")
    unaliased_by_shape: dict[tuple, set[int]] = {}
    for p in entry.parameters:
        if p.parameter_number not in aliased and not p.shape.is_tuple and p.shape.rank > 0:
            unaliased_by_shape.setdefault(_shape_key(p), set()).add(p.parameter_number)
    sources_by_shape: dict[tuple, list[Instruction]] = {}
    for s in output_sources(module):
        if not s.shape.is_tuple:
            sources_by_shape.setdefault(_shape_key(s), []).append(s)
    # A parameter feeds some output of its shape iff it is an ancestor of those outputs taken
    # together: one walk per output shape, not one per parameter.
    returned = set()
    for key, numbers in unaliased_by_shape.items():
        if key in sources_by_shape:
            returned |= numbers & _param_ancestors(sources_by_shape[key])
    if returned:
        evidence.append(f"{len(returned)} unaliased parameters come back as outputs of the "
                        f"same shape that depend on them (state)")
    return aliased | returned, evidence


def _shape_key(x: Instruction) -> tuple:
    return x.shape.dtype, x.shape.dims


def _param_ancestors(roots: list[Instruction]) -> set[int]:
    """The numbers of the parameters any of `roots` depends on."""
    seen, out, stack = set(), set(), list(roots)
    while stack:
        y = stack.pop()
        if id(y) in seen:
            continue
        seen.add(id(y))
        if y.opcode == "parameter":
            out.add(y.parameter_number)
        stack.extend(y.operands)
    return out


@dataclass
class _Trial:
    dots: int  # dots and convolutions reached (split or psum)
    outputs: int  # output leaves reached
    mixes: set  # instructions where examples get mixed
    loss: bool  # some scalar float output is a batch sum

    @property
    def plausible(self) -> bool:
        return self.outputs > 0


class _Trials:
    """What the trial splits of one module share. A split changes the classes of only the
    entry instructions that depend on a split parameter (its cone): a trial walks its cone,
    the others keep their classes with nothing split, and trying every candidate costs the
    sum of their cones, not candidates x instructions. Exact where every class with nothing
    split is independent of the batch (then no batch statistic, prologue value or mixing of
    examples lies outside a cone); elsewhere a trial analyses the whole module."""

    def __init__(self, module: Module):
        entry = module.entry
        self.module = module
        self.outputs = Counter(output_sources(module))  # an instruction may be output twice
        self.users = entry.users()
        self.position = {x: k for k, x in enumerate(entry.instructions)}
        self.params = {p.parameter_number: p for p in entry.parameters}
        root = entry.root  # the output tuple: its leaves are read one by one
        self.unread_root = root if root.opcode == "tuple" and not self.users[root] else None
        self.parameterless = batch_only(module, {})  # constants and what they make
        self._unsplit: dict[int, dict | None] = {}

    def analyse(self, dims: dict[int, int], size: int) -> Dataflow:
        unsplit = self._unsplit_classes(size)
        if unsplit is None:
            return analyse(self.module, dims, size)[0]
        walk = self._cone(dims)
        only = batch_only(self.module, dims, walk, self.parameterless)
        return analyse(self.module, dims, size, only, (walk, unsplit))[0]

    def _unsplit_classes(self, size: int) -> dict | None:
        """The classes with nothing split, at batch size `size`; None where one is not
        independent of the batch (a cone alone would not be exact)."""
        if size not in self._unsplit:
            cls = Dataflow(self.module, {}, size).cls
            self._unsplit[size] = cls if all(all_indep(c) for c in cls.values()) else None
        return self._unsplit[size]

    def _cone(self, dims: dict[int, int]) -> list[Instruction]:
        """Entry instructions that depend on a split parameter, in program order."""
        seen, stack = set(), [self.params[n] for n in dims]
        while stack:
            x = stack.pop()
            if x not in seen:
                seen.add(x)
                stack.extend(self.users[x])
        seen.discard(self.unread_root)
        return sorted(seen, key=self.position.__getitem__)


def _trial(trials: _Trials, dims: dict[int, int], size: int) -> _Trial:
    df = trials.analyse(dims, size)
    dots = outputs = 0
    loss = False
    for instr, c in df.cls.items():  # what the split reached (the rest is independent)
        reached = any(leaf.kind in "SP" for leaf in leaves(c))
        if instr.opcode in CONTRACTIONS and reached:
            dots += 1
        times = trials.outputs.get(instr, 0)
        if times and reached:
            outputs += times
        if times and not instr.shape.is_tuple and instr.shape.rank == 0 and \
                instr.shape.is_float and leaves(c)[0].kind == "P":
            loss = True
    return _Trial(dots, outputs, {id(x) for x, _ in df.mixes}, loss)


def detect_batch(module: Module) -> BatchInfo:
    """Guess the batch inputs of the entry computation (see the module docstring)."""
    entry = module.entry
    state, evidence = _state_params(module)
    candidates = [p for p in entry.parameters if p.parameter_number not in state
                  and not p.shape.is_tuple and p.shape.rank > 0]
    if not candidates:
        return BatchInfo([], None, "none", evidence,
                         "every parameter is returned as state or is a scalar; no parameter "
                         "can carry the batch")
    splits = _Trials(module)
    trials: dict[tuple[int, int], _Trial] = {}
    for p in candidates:
        for d, size in enumerate(p.shape.dims):
            if size >= 2:
                trials[(p.parameter_number, d)] = _trial(splits, {p.parameter_number: d}, size)
    params = {p.parameter_number: p for p in candidates}
    plausible = {k: t for k, t in trials.items() if t.plausible}
    if not plausible:
        return BatchInfo([], None, "none", evidence,
                         f"no dim of the {len(candidates)} non-state parameters reaches an "
                         f"output as a per-example value or a batch sum")

    def rank(k):
        t = plausible[k]
        p = params[k[0]]
        return (-(t.loss and not t.mixes), -t.dots, -t.outputs, len(t.mixes), k[1],
                not p.shape.dtype.startswith(("s", "u")), k[0])

    order = sorted(plausible, key=rank)
    best = order[0]
    # Secondary batch inputs (labels, loss weights) do not reach an output on their own: the
    # loss is affine in them while the rest of it is independent. They join if they reach
    # some dot and mix no examples with the inputs already chosen.
    reaching = {k: t for k, t in trials.items() if t.dots or t.outputs}
    order += sorted((k for k in reaching if k not in plausible),
                    key=lambda k: (-reaching[k].dots, k[1], k[0]))
    plausible.update(reaching)
    size = params[best[0]].shape.dims[best[1]]
    chosen = {best[0]: best[1]}
    current = plausible[best]
    notes = [f"param {best[0]} ({params[best[0]].shape}) split on dim {best[1]} reaches "
             f"{current.dots} dots/convolutions and {current.outputs} outputs"]
    rejected = []
    for k in order[1:]:
        number, dim = k
        if number in chosen or params[number].shape.dims[dim] != size:
            continue
        trial = _trial(splits, {**chosen, number: dim}, size)
        if trial.mixes <= current.mixes and trial.dots >= current.dots:
            chosen[number] = dim
            current = trial
            notes.append(f"param {number} ({params[number].shape}) on dim {dim} joins "
                         f"without mixing examples")
        else:
            rejected.append((number, dim))
    left_out = [p.parameter_number for p in candidates if p.parameter_number not in chosen]
    args = [_arg(params[n], d) for n, d in sorted(chosen.items())]
    if current.mixes:
        confidence = "low"
        notes.append(f"the analysis still mixes examples at {len(current.mixes)} "
                     f"instructions")
    elif state and not left_out and current.outputs:
        confidence = "high"
    elif state or current.outputs:
        confidence = "medium"
    else:
        confidence = "low"
    if state:
        notes.append(f"{len(state)} parameters are state; "
                     f"{len(left_out)} other non-scalar parameters are not batch inputs"
                     + (f" ({', '.join(map(str, left_out[:8]))}"
                        f"{', ...' if len(left_out) > 8 else ''})" if left_out else ""))
    else:
        notes.append("no parameter comes back as an output (a forward program?): weights "
                     "and inputs told apart by the analysis alone")
    if current.loss:
        notes.append("the scalar output(s) become batch sums (a loss)")
    return BatchInfo(args, size, confidence, evidence + notes)
