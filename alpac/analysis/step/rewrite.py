"""The microbatch rewrite: a `StepSplit` as three modules and the wiring between them.

- `prologue` (optional): the batch-only statistics, on the whole batch, once per step;
- `microbatch`: the per-microbatch part with every split dim divided by B — shapes, reshape
  and broadcast sizes, slice limits, dynamic-slice and gather sizes. An independent value that
  meets split data along the batch dim is shrunk where that is exact by construction (a
  broadcast along a new dim, an iota along another dim, elementwise ops of such values, a
  transpose) and otherwise computed full size and dynamic-sliced at
  microbatch_index * (size / B), the microbatch index being an extra s32[] parameter. HLO
  literal constants are kept: a mean `sum / 256` per microbatch is that microbatch's share of
  the full-batch mean, so the shares add up to it exactly.
  While loops in the per-microbatch part are rewritten with their carried tuple shrunk
  (body and condition follow the classes of the loop state); a batch-sized value that is
  independent of the batch and passed through a loop unchanged (an attention mask) is carried
  as its microbatch slice, taken once outside the loop.
- `epilogue`: the once-per-step part; it returns every output of the original module, in
  the original tuple structure (accumulated and concatenated values pass through).

Each module input says where it comes from (`Source`), each per-microbatch output where it
goes (`Sink`).
"""

from __future__ import annotations

from alpac.analysis.step.lattice import Cls, all_indep, split
from alpac.analysis.step.oprules import _slice_spec
from alpac.analysis.step.wiring import MicrobatchedStep, MicrobatchRefused, Sink, SinkKind, \
    Source, SourceKind
from alpac.hlo.extract import callee_order
from alpac.hlo.ir import Alias, Computation, ComputationRefs, Instruction, Module, UniqueNames
from alpac.hlo.opcodes import ELEMENTWISE
from alpac.hlo.shape import Shape

__all__ = ["MicrobatchRefused", "MicrobatchedStep", "Sink", "Source", "build_microbatched"]


class _Emitter:
    """Builds one entry computation: parameters with their sources, then instructions."""

    def __init__(self, names: UniqueNames):
        self.names = names  # shared with the emitters of the loop bodies it contains
        self.instrs: list[Instruction] = []
        self.params: list[tuple[Instruction, Source]] = []
        self.map: dict[Instruction, Instruction] = {}
        self.added: set[int] = set()

    def fresh(self, base: str) -> str:
        return self.names.fresh(base)

    def add(self, instr: Instruction) -> Instruction:
        self.instrs.append(instr)
        self.added.add(id(instr))
        return instr

    def param(self, name: str, shape: Shape, source: Source, attrs=None) -> Instruction:
        p = Instruction(name, "parameter", shape, [], dict(attrs or {}), "0")
        self.params.append((p, source))
        return self.add(p)

    def module(self, name: str, root: Instruction, like: Module) -> tuple[Module, list[Source]]:
        """The module (a copy sharing nothing with the original), dropping dead instructions
        and unused parameters; the sources of its parameters in order."""
        live, stack = set(), [root]
        while stack:
            x = stack.pop()
            if id(x) in live:
                continue
            live.add(id(x))
            stack.extend(x.operands)
        comp = Computation(name, is_entry=True)
        sources = []
        source_of = {id(p): s for p, s in self.params}
        for x in self.instrs:
            if id(x) not in live:
                continue
            if x.opcode == "parameter":
                x.payload = str(len(sources))
                sources.append(source_of[id(x)])
            comp.append(x)
        comp.root = root
        module = Module(name, callee_order(comp) + [comp], comp, dict(like.attrs))
        return module.clone(), sources


def _mb_shape(shape: Shape, c, B: int) -> Shape:
    if shape.is_tuple:
        cs = c if not isinstance(c, Cls) else [c] * len(shape.tuple_shapes)
        return Shape.tuple_of(_mb_shape(s, k, B) for s, k in zip(shape.tuple_shapes, cs))
    if isinstance(c, Cls) and c.kind == "S":
        dims = list(shape.dims)
        if dims[c.dim] % B:
            raise MicrobatchRefused(f"dim {c.dim} of {shape} (size {dims[c.dim]}) does not "
                                    f"divide into {B} microbatches")
        dims[c.dim] //= B
        return shape.with_dims(dims)
    return shape


def _flat(c) -> list:
    return [c] if isinstance(c, Cls) else [leaf for x in c for leaf in _flat(x)]


def _same_shape_class(a: Cls, b: Cls) -> bool:
    """Whether values of classes a and b have the same microbatch shape."""
    return a == b or a.kind != "S" and b.kind != "S"


def _braced(values) -> str:
    return "{" + ",".join(str(v) for v in values) + "}"


class _MicrobatchBuilder:
    def __init__(self, split, B: int, names: UniqueNames):
        self.split = split
        self.df = split.flow
        self.B = B
        self.em = self.entry_em = _Emitter(names)
        self.sliced_cache: dict[tuple[int, int, int], Instruction] = {}
        self.rewritten_bodies: set[int] = set()
        self.override: dict[Instruction, Cls] = {}
        self.promoted: dict[Instruction, tuple[dict[int, int], Instruction]] = {}
        self.N = split.batch.size
        self.index_param: Instruction | None = None
        self.consts: dict[int, Instruction] = {}
        self.inputs = set(split.inputs["microbatch"])

    def build(self) -> tuple[Module, list[Source], list[Sink]]:
        sp, em, df = self.split, self.em, self.df
        batch_dims = sp.batch.dims
        pro_index = {x: k for k, x in enumerate(sp.prologue_values)}
        needed = set(sp.parts["microbatch"])
        for x in sp.module.entry.instructions:
            if x in self.inputs:
                if x in pro_index:
                    em.map[x] = em.param(x.name, x.shape,
                                         Source(SourceKind.PROLOGUE, pro_index[x]))
                elif x.parameter_number in batch_dims:
                    d = batch_dims[x.parameter_number]
                    em.map[x] = em.param(x.name, _mb_shape(x.shape, df.of(x), self.B),
                                         Source(SourceKind.BATCH_SLICE, x.parameter_number, d),
                                         x.attrs)
                else:
                    em.map[x] = em.param(x.name, x.shape,
                                         Source(SourceKind.PARAM, x.parameter_number), x.attrs)
            elif x in needed:
                em.map[x] = self._emit(x)
        outs, sinks = [], []
        for k, x in enumerate(sp.accumulated):
            outs.append(em.map[x])
            sinks.append(Sink(SinkKind.ACCUMULATE, k))
        for k, (x, d) in enumerate(sp.concatenated):
            outs.append(em.map[x])
            sinks.append(Sink(SinkKind.CONCATENATE, k, d))
        root = em.add(Instruction(em.fresh("microbatch_outputs"), "tuple",
                                  Shape.tuple_of(o.shape for o in outs), outs))
        module, sources = em.module(f"{sp.module.name}.microbatch", root, sp.module)
        module.name = f"{sp.module.name}_microbatch"
        return module, sources, sinks

    # ---- one instruction ---------------------------------------------------------------------
    def _emit(self, x: Instruction) -> Instruction:
        new = self.rewrite(x)
        if id(new) in self.em.added:
            return new  # an existing value stands for x
        return self.em.add(new)

    def _cls(self, x: Instruction):
        c = self.override.get(x)
        return c if c is not None else self.df.of(x)

    def rewrite(self, x: Instruction) -> Instruction:
        c = self._cls(x)
        em = self.em
        if x.opcode == "get-tuple-element" and x.operands[0] in self.promoted:
            # a loop-invariant value the loop now carries sliced: the loop's input, whole
            promo, init = self.promoted[x.operands[0]]
            if x.tuple_index in promo and not (isinstance(c, Cls) and c.kind == "S"):
                return em.map[init.operands[x.tuple_index]]
        if all_indep(c):
            return Instruction(x.name, x.opcode, x.shape, [em.map[o] for o in x.operands],
                               dict(x.attrs), x.payload, x.line)
        if x.opcode == "while":
            return self._while(x)
        need = self.df.need.get(x, {})
        ops = [self.sliced(o, need[i]) if i in need and o not in self.override else em.map[o]
               for i, o in enumerate(x.operands)]
        shape = _mb_shape(x.shape, c, self.B)
        attrs = dict(x.attrs)
        op = x.opcode
        if op == "slice":
            spec = _slice_spec(x)
            new_in = ops[0].shape.dims
            parts = []
            for d, (start, limit, stride) in enumerate(spec):
                if new_in[d] != x.operands[0].shape.dims[d]:
                    start, limit, stride = 0, new_in[d], 1
                parts.append(f"[{start}:{limit}]" if stride == 1 else
                             f"[{start}:{limit}:{stride}]")
            attrs["slice"] = "{" + ", ".join(parts) + "}"
        elif op == "dynamic-slice":
            attrs["dynamic_slice_sizes"] = _braced(shape.dims)
        elif op == "gather":
            sizes = list(x.dims("slice_sizes"))
            for d, (old, new) in enumerate(zip(x.operands[0].shape.dims, ops[0].shape.dims)):
                if old != new and sizes[d] == old:
                    sizes[d] = new
            attrs["slice_sizes"] = _braced(sizes)
        self._check_operands(x, ops, shape)
        return Instruction(x.name, op, shape, ops, attrs, x.payload, x.line)

    # ---- while loops ---------------------------------------------------------------------------
    def _while(self, x: Instruction) -> Instruction:
        """The loop with its carried tuple shrunk: body and condition rewritten with the
        loop state's classes (the fixed point of the analysis)."""
        state = self.df.of(x)
        body, cond = x.called("body"), x.called("condition")
        promo, chain = self._promotions(x, state)
        if promo:
            shapes = x.shape.tuple_shapes
            state = tuple(split(promo[i], shapes[i].dims[promo[i]] // self.N) if i in promo
                          else leaf for i, leaf in enumerate(state))
            self.promoted[x] = (promo, x.operands[0])
            for comp in (body, cond):
                for y in comp.instructions:
                    if y.opcode == "get-tuple-element" and y.operands[0].opcode == "parameter" \
                            and y.tuple_index in promo:
                        self.override[y] = state[y.tuple_index]
        for y, d in chain.items():  # from promoted elements (or none) to the split data
            self.override[y] = split(d, y.shape.dims[d] // self.N)
        init = self._conform(x.operands[0], state)
        new_body = self._computation(body, state, conform_root=True)
        new_cond = self._computation(cond, state, conform_root=False)
        attrs = dict(x.attrs)
        attrs["body"] = ComputationRefs([new_body], getattr(x.attrs["body"], "braced", False))
        attrs["condition"] = ComputationRefs([new_cond],
                                             getattr(x.attrs["condition"], "braced", False))
        return Instruction(x.name, "while", _mb_shape(x.shape, state, self.B), [init], attrs,
                           x.payload, x.line)

    def _promotions(self, x: Instruction, state) -> tuple[dict[int, int], dict]:
        """Loop-carried elements that are independent of the batch, passed through the loop
        unchanged, and meet split data inside it along one dim (an attention-mask constant
        of batch size), directly or through reshapes, broadcasts, transposes and elementwise
        work of their own (a mask turned boolean and broadcast over heads): the loop can carry
        their microbatch slice instead, sliced once outside, and that work is done on the
        slice. Returns ({element index: dim}, {instruction of that work: its split dim})."""
        body = x.called("body")
        init = x.operands[0]
        if isinstance(state, Cls) or body is None or body.root.opcode != "tuple" or \
                init.opcode != "tuple" or len(body.parameters) != 1:
            return {}, {}
        param = body.parameters[0]
        users = body.users()
        out: dict[int, int] = {}
        bad: set[int] = set()
        chains = []
        for y in body.instructions:
            for j, d in self.df.need.get(y, {}).items():
                chain: dict = {}
                found = self._invariant_source(y.operands[j], d, param, chain)
                if found is None:
                    continue
                chains.append((found, chain))
                for i, dim in found.items():
                    leaf, back = state[i], body.root.operands[i]
                    passes = back.opcode == "get-tuple-element" and back.operands[0] is param \
                        and back.tuple_index == i
                    if not (isinstance(leaf, Cls) and leaf.kind in "IZ" and passes) or \
                            out.get(i, dim) != dim:
                        bad.add(i)
                    out[i] = dim
        promo = {i: d for i, d in out.items() if i not in bad}
        while True:  # an element carried sliced only if all the work it feeds can be
            left = {i for found, _ in chains if not set(found) <= set(promo) for i in found}
            if not left & set(promo):
                break
            promo = {i: d for i, d in promo.items() if i not in left}
        work = {y: d for found, chain in chains if set(found) <= set(promo)
                for y, d in chain.items()}
        # work that a whole-batch use reads too stays whole (the rewrite then refuses), and
        # only the elements read directly are carried sliced
        split_readers = set(work) | set(self.df.need)
        if any(u not in split_readers for x in work for u in users[x]):
            direct = {i for found, chain in chains if not chain for i in found}
            return {i: d for i, d in promo.items() if i in direct}, {}
        return promo, work

    def _invariant_source(self, o: Instruction, d: int, param: Instruction,
                          chain: dict) -> dict[int, int] | None:
        """The loop state elements (index: dim) that batch-independent `o`, needed split along
        `d`, is computed from inside the loop, the work between put in `chain`; None where
        it is computed otherwise."""
        if o.opcode == "get-tuple-element" and o.operands[0] is param:
            return {o.tuple_index: d}
        c = self.df.of(o)
        if not isinstance(c, Cls) or c.kind not in "IZ" or o.shape.dims[d] % self.N:
            return None
        found: dict[int, int] | None = {}
        if o.opcode == "broadcast":
            dims = o.dims("dimensions")
            if d in dims:
                found = self._invariant_source(o.operands[0], dims.index(d), param, chain)
        elif o.opcode in ("reshape", "transpose"):
            src = o.operands[0].shape.dims
            d_in = o.dims("dimensions")[d] if o.opcode == "transpose" else d
            if o.opcode == "reshape" and (src[:d + 1] != o.shape.dims[:d + 1]):
                return None
            found = self._invariant_source(o.operands[0], d_in, param, chain)
        elif o.opcode in ELEMENTWISE and o.opcode != "rng":
            for p in o.operands:
                if p.shape.rank == 0:
                    continue
                more = None if p.shape.dims != o.shape.dims else \
                    self._invariant_source(p, d, param, chain)
                if more is None or any(found.get(i, k) != k for i, k in more.items()):
                    return None
                found.update(more)
        else:
            return None
        if found is not None:
            chain[o] = d
        return found

    def _computation(self, comp: Computation, state, conform_root: bool) -> Computation:
        if id(comp) in self.rewritten_bodies:
            raise MicrobatchRefused(f"computation {comp.name} is the body of two loops that "
                                    f"carry batch data; only one rewrite of it is supported")
        self.rewritten_bodies.add(id(comp))
        saved, em = self.em, _Emitter(self.em.names)
        self.em = em
        try:
            for y in comp.instructions:
                if y.opcode == "parameter":
                    analysed = self.df.cls.get(y)
                    if y.parameter_number != 0 or analysed is not None and len(_flat(
                            analysed)) != len(_flat(state)):
                        raise MicrobatchRefused(f"loop computation {comp.name} was analysed "
                                                f"with other classes than its loop's state")
                    em.map[y] = em.add(Instruction(y.name, "parameter",
                                                   _mb_shape(y.shape, state, self.B), [],
                                                   dict(y.attrs), y.payload, y.line))
                else:
                    em.map[y] = self._emit(y)
            root = self._conform(comp.root, state) if conform_root else em.map[comp.root]
            return Computation(em.fresh(comp.name + ".mb"), em.instrs, root)
        finally:
            self.em = saved

    def _conform(self, v: Instruction, target) -> Instruction:
        """`v` (already emitted) with the shapes of class `target`: independent elements that
        a loop carries as split get sliced."""
        c = self._cls(v)
        if c == target or all(_same_shape_class(a, b) for a, b in
                              zip(_flat(c), _flat(target))) and len(_flat(c)) == \
                len(_flat(target)):
            return self.em.map[v]
        if isinstance(target, Cls):
            if target.kind == "S" and isinstance(c, Cls) and c.kind in "IZ":
                return self.sliced(v, target.dim)
        elif v.opcode == "tuple" and len(v.operands) == len(target):
            elems = [self._conform(o, t) for o, t in zip(v.operands, target)]
            return self.em.add(Instruction(self.em.fresh(v.name + ".mb"), "tuple",
                                           Shape.tuple_of(e.shape for e in elems), elems))
        raise MicrobatchRefused(f"%{v.name} enters a loop whose state is {target} but is "
                                f"{c}; the rewrite cannot make them agree")

    def _check_operands(self, x: Instruction, ops, shape: Shape) -> None:
        """Elementwise operands must match the (shrunk) result: a cheap early check."""
        if x.opcode in ELEMENTWISE and not shape.is_tuple:
            for o in ops:
                if o.shape.rank and o.shape.dims != shape.dims:
                    raise MicrobatchRefused(
                        f"cannot shrink %{x.name} ({x.opcode}) exactly: operand %{o.name} is "
                        f"{o.shape.without_layout()}, result {shape.without_layout()}")

    # ---- microbatch slices of independent values -----------------------------------------------
    def sliced(self, o: Instruction, k: int) -> Instruction:
        key = (id(self.em), id(o), k)
        hit = self.sliced_cache.get(key)
        if hit is not None:
            return hit
        em, B = self.em, self.B
        dims = list(o.shape.dims)
        if dims[k] % B:
            raise MicrobatchRefused(f"dim {k} of %{o.name} {o.shape.without_layout()} does "
                                    f"not divide into {B} microbatches")
        dims[k] //= B
        shape = o.shape.with_dims(dims)
        op = o.opcode
        new = None
        if o not in self.inputs and o in self.em.map:
            if op == "broadcast":
                bd = o.dims("dimensions")
                if k in bd:
                    src = self.sliced(o.operands[0], bd.index(k))
                else:
                    src = em.map[o.operands[0]]
                new = Instruction(em.fresh(o.name + ".mb"), op, shape, [src], dict(o.attrs))
            elif op == "iota" and o.int_attr("iota_dimension") != k:
                new = Instruction(em.fresh(o.name + ".mb"), op, shape, [], dict(o.attrs))
            elif op == "transpose":
                src = self.sliced(o.operands[0], o.dims("dimensions")[k])
                new = Instruction(em.fresh(o.name + ".mb"), op, shape, [src], dict(o.attrs))
            elif op in ELEMENTWISE and op not in ("rng",) and all(
                    p.shape.rank == 0 or p.shape.dims == o.shape.dims for p in o.operands):
                srcs = [self.sliced(p, k) if p.shape.rank else em.map[p] for p in o.operands]
                new = Instruction(em.fresh(o.name + ".mb"), op, shape, srcs, dict(o.attrs))
        if new is None:
            new = self._dynamic_slice(o, k, shape)
        em.add(new)
        self.sliced_cache[key] = new
        return new

    def _dynamic_slice(self, o: Instruction, k: int, shape: Shape) -> Instruction:
        em = self.em
        if em is not self.entry_em:
            raise MicrobatchRefused(f"%{o.name} inside a loop meets split data along its dim "
                                    f"{k} and would need slicing at the microbatch offset")
        full = em.map[o]
        zero = self._s32(0)
        step = shape.dims[k]
        offset = em.add(Instruction(em.fresh("mb_offset"), "multiply", Shape.array("s32", ()),
                                    [self._index(), self._s32(step)]))
        starts = [offset if d == k else zero for d in range(o.shape.rank)]
        return Instruction(em.fresh(o.name + ".mb"), "dynamic-slice", shape, [full] + starts,
                           {"dynamic_slice_sizes": _braced(shape.dims)})

    def _index(self) -> Instruction:
        if self.index_param is None:
            self.index_param = self.em.param(self.em.fresh("microbatch_index"),
                                             Shape.array("s32", ()),
                                             Source(SourceKind.MICROBATCH_INDEX))
        return self.index_param

    def _s32(self, value: int) -> Instruction:
        if value not in self.consts:
            self.consts[value] = self.em.add(Instruction(
                self.em.fresh(f"mb_constant_{value}"), "constant", Shape.array("s32", ()), [],
                {}, str(value)))
        return self.consts[value]


def _build_simple(split, part: str, roots: list[Instruction], sources: dict, names: UniqueNames,
                  suffix: str, output_tree=None):
    """Prologue or epilogue: the part's instructions unchanged, inputs as parameters."""
    sp = split
    em = _Emitter(names)
    inputs = set(sp.inputs[part])
    instrs = set(sp.parts[part])
    for x in sp.module.entry.instructions:
        if x in inputs:
            src = sources[x]
            attrs = x.attrs if x.opcode == "parameter" else None
            em.map[x] = em.param(x.name, x.shape, src, attrs)
        elif x in instrs:
            em.map[x] = em.add(Instruction(x.name, x.opcode, x.shape,
                                           [em.map[o] for o in x.operands], dict(x.attrs),
                                           x.payload, x.line))
    if output_tree is not None:
        root = _rebuild(output_tree, em)
    else:
        vals = [em.map[r] for r in roots]
        root = em.add(Instruction(em.fresh(f"{suffix}_outputs"), "tuple",
                                  Shape.tuple_of(v.shape for v in vals), vals))
    module, srcs = em.module(f"{sp.module.name}.{suffix}", root, sp.module)
    module.name = f"{sp.module.name}_{suffix}"
    return module, srcs


def _output_tree(root: Instruction):
    if root.opcode == "tuple" and root.shape.is_tuple:
        return ("tuple", root, [_output_tree(o) for o in root.operands])
    return root


def _rebuild(tree, em: _Emitter) -> Instruction:
    if isinstance(tree, tuple):
        _, orig, kids = tree
        vals = [_rebuild(k, em) for k in kids]
        return em.add(Instruction(em.fresh(orig.name), "tuple",
                                  Shape.tuple_of(v.shape for v in vals), vals,
                                  {k: v for k, v in orig.attrs.items() if k == "sharding"}))
    return em.map[tree]


def build_microbatched(split, B: int) -> MicrobatchedStep:
    if split.refusal is not None:
        raise MicrobatchRefused(split.refusal)
    N = split.batch.size
    if B < 1 or N % B:
        raise MicrobatchRefused(f"the batch size {N} does not divide into {B} microbatches")
    module = split.module
    names = {x.name for x in module.instructions()} | {c.name for c in module.computations}
    # prologue
    prologue, pro_sources = None, []
    if split.prologue_values:
        srcs = {x: Source(SourceKind.PARAM, x.parameter_number)
                for x in split.inputs["prologue"]}
        prologue, pro_sources = _build_simple(split, "prologue", split.prologue_values, srcs,
                                              UniqueNames(names), "prologue")
    mb, mb_sources, sinks = _MicrobatchBuilder(split, B, UniqueNames(names)).build()
    # epilogue
    pro_index = {x: k for k, x in enumerate(split.prologue_values)}
    acc_index = {x: k for k, x in enumerate(split.accumulated)}
    cat_index = {x: k for k, (x, _) in enumerate(split.concatenated)}
    srcs = {}
    for x in split.inputs["epilogue"]:
        if x in pro_index:
            srcs[x] = Source(SourceKind.PROLOGUE, pro_index[x])
        elif x in acc_index:
            srcs[x] = Source(SourceKind.ACCUMULATED, acc_index[x])
        elif x in cat_index:
            srcs[x] = Source(SourceKind.CONCATENATED, cat_index[x],
                             split.concatenated[cat_index[x]][1])
        else:
            srcs[x] = Source(SourceKind.PARAM, x.parameter_number)
    epilogue, ep_sources = _build_simple(split, "epilogue", [], srcs, UniqueNames(names),
                                         "epilogue",
                                         _output_tree(module.entry.root))
    _alias_state(module, epilogue, ep_sources)
    return MicrobatchedStep(B, N, prologue, pro_sources, mb, mb_sources, sinks, epilogue,
                            ep_sources, [x.name for x in split.accumulated],
                            [x.name for x, _ in split.concatenated])


def _alias_state(original: Module, epilogue: Module, sources: list[Source]) -> None:
    """The epilogue updates state in place where the original step did (donated params)."""
    position = {s.index: k for k, s in enumerate(sources) if s.kind == SourceKind.PARAM}
    params = epilogue.entry.parameters
    for a in original.input_output_alias:
        k = position.get(a.parameter_number)
        if k is None or a.parameter_index:
            continue
        try:
            out_shape = epilogue.entry.root.shape.subshape(a.output_index)
        except (IndexError, TypeError):
            continue
        if out_shape.without_layout() == params[k].shape.without_layout():
            epilogue.input_output_alias.append(Alias(a.output_index, k, (), a.kind))
