"""Sharding strategies per opcode.

A strategy fixes the sharding of an instruction's outputs, the sharding it needs of each
operand, how much its work is divided, and the collectives it performs itself (a dot that
contracts a split dimension all-reduces or reduce-scatters its partial sums). Three kinds of
instruction:

- sources (parameters, dots, convolutions, reduces, gathers, scatters, ...) enumerate their
  strategies and become ILP nodes;
- followers (elementwise ops, transposes, reshapes, slices, ...) take the sharding of one
  operand, mapped through the op, and share that operand's ILP node;
- transparent values (constants, iota, broadcasts) take whatever sharding each user needs and
  are cloned per sharding when the module is written out.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass, replace

from alpac.analysis.step.oprules import reducer_kind
from alpac.hlo.ir import Instruction, is_zero_constant
from alpac.hlo.opcodes import BATCH_NORM, CONTROL_FLOW, DEVICE_IDS, DYNAMIC_SHAPES, ELEMENTWISE, \
    ELEMENTWISE_UNARY, GENERATORS, HOST_IO, LIBRARY_CALLS, RANDOM, RESHAPES, SCHEDULED_ASYNC, \
    SIDE_EFFECTING, VIEWS, WINDOW_REDUCTIONS
from alpac.intraop.collectives import Collective
from alpac.intraop.space import array_shardings, reshape_sharding, transpose_sharding
from alpac.plan.sharding import Sharding


@dataclass(frozen=True)
class Strategy:
    name: str
    outputs: tuple[Sharding, ...]  # one per output leaf
    inputs: tuple[Sharding | None, ...]  # per operand (None: the operand is a tuple)
    divisor: int = 1  # the instruction's work is split this many ways
    collectives: tuple[Collective, ...] = ()


#: followers whose result takes the sharding of their one operand as it is
IDENTITY = ELEMENTWISE_UNARY | {"opt-barrier"}
#: values each user gets in the sharding it needs (see `is_transparent`)
TRANSPARENT = GENERATORS
#: ops that only ever get the replicated strategy (no rule here shards them)
REPLICATED_ONLY = (SIDE_EFFECTING | RANDOM | DEVICE_IDS | DYNAMIC_SHAPES | LIBRARY_CALLS
                   | {"custom-call", "domain", "add-dependency"})
#: opcodes alpac refuses (exit 2), with why: they appear only after XLA's own optimization
#: passes, talk to the host, or mean nothing before partitioning; the module cannot be run
UNSUPPORTED_OPS = {
    **dict.fromkeys(sorted(SCHEDULED_ASYNC),
                    "an asynchronous pair that only XLA's scheduling passes create; alpac needs "
                    "the module before optimization"),
    "bitcast": "a layout bitcast that only XLA's layout assignment creates; alpac needs the "
               "module before optimization",
    **dict.fromkeys(sorted(HOST_IO), "host or channel I/O, which alpa-run cannot serve"),
    "partition-id": "a value that depends on the partitioning; alpac needs the module before "
                    "SPMD partitioning",
    "set-dimension-size": "a dynamic shape; alpac plans static shapes only",
}
#: heavy ops: XLA keeps their result in a buffer of its own
MATERIALIZED = (frozenset({"parameter", "dot", "convolution", "reduce", "gather", "scatter",
                           "sort", "custom-call", "dynamic-update-slice", "concatenate", "pad"})
                | WINDOW_REDUCTIONS | CONTROL_FLOW | LIBRARY_CALLS | BATCH_NORM | RANDOM)


def leaf_shapes(instr: Instruction):
    return [s for _, s in instr.shape.leaves()]


def replicated_strategy(instr: Instruction) -> Strategy:
    outs = tuple(Sharding.replicated(s.rank) for s in leaf_shapes(instr))
    ins = tuple(None if op.shape.is_tuple else Sharding.replicated(op.shape.rank)
                for op in instr.operands)
    return Strategy("R", outs, ins)


def rule_strategies(instr: Instruction, mesh_shape) -> list[Strategy]:
    """Strategies of a custom-call from its Shardy sharding rule: one result factor split over
    a group of mesh axes, with the operand dimensions at the same position and of the same size
    split alike (a fused kernel's rule may name the batch of each operand apart, as the step
    analysis also assumes). Factors the rule marks reduction, blocked or need-replication are
    never split. No rule: replicated only."""
    rule = instr.sharding_rule()
    leaves = leaf_shapes(instr)
    if rule is None or len(rule[1]) != len(leaves) or len(rule[0]) != len(instr.operands):
        return [replicated_strategy(instr)]
    operand_factors, result_factors, sizes = rule
    out = [replicated_strategy(instr)]
    axes = _axes(mesh_shape)
    groups = [g for n in range(1, len(axes) + 1) for g in itertools.combinations(axes, n)]
    for f in dict.fromkeys(f for facs in result_factors for f in facs):
        linked = _linked_factors(f, operand_factors, sizes)
        if linked is None:
            continue
        for group in groups:
            ways = math.prod(mesh_shape[a] for a in group)
            if sizes.get(f, 0) % ways or sizes.get(f, 0) == 0:
                continue

            def spec(facs, rank):
                return Sharding(tuple(group if k < len(facs) and facs[k] in linked else ()
                                      for k in range(rank)))
            ins = tuple(None if o.shape.is_tuple else spec(facs, o.shape.rank)
                        for o, facs in zip(instr.operands, operand_factors))
            outs = tuple(spec(facs, leaf.rank) for leaf, facs in zip(leaves, result_factors))
            out.append(Strategy(f"{f}:{group}", outs, ins, ways))
    return out


def _linked_factors(f: str, operand_factors, sizes) -> set[str] | None:
    """`f` and the factors at its position, of its size, in the other operands; None when
    `f` may not be split."""
    if any(g == f + "!" for facs in operand_factors for g in facs):
        return None
    spots = [k for facs in operand_factors for k, g in enumerate(facs) if g == f]
    linked = {f}
    for facs in operand_factors:
        for k in spots:
            if k < len(facs) and not facs[k].endswith("!") and \
                    sizes.get(facs[k]) == sizes.get(f):
                linked.add(facs[k])
    return linked


def _axes(mesh_shape) -> list[int]:
    return [a for a, n in enumerate(mesh_shape) if n > 1]


def _size(mesh_shape, axes) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def _sharding(dim_axes: list[list[int]]) -> Sharding:
    """Axes stay in the order given: a reduce-scatter appends its axes as the minor split."""
    return Sharding(tuple(tuple(a) for a in dim_axes))


def _fits(dims, dim_axes, mesh_shape) -> bool:
    return all(d % _size(mesh_shape, a) == 0 for d, a in zip(dims, dim_axes))


def _reduction_variants(name, out_axes, out_dims, partial_axes, elem_bits, mesh_shape,
                        scatter: bool = True):
    """Partial sums over `partial_axes` are all-reduced, or reduce-scattered onto one output
    dimension that they divide: (name suffix, output sharding, collectives)."""
    out = _sharding(out_axes)
    if not partial_axes:
        return [(name, out, ())]
    tile = out.tile_dims(out_dims, mesh_shape)
    nbytes = out.tile_bytes(out_dims, elem_bits, mesh_shape)
    axes = tuple(sorted(partial_axes))
    variants = [(name + "|all-reduce", out, (Collective("all-reduce", axes, nbytes),))]
    if not scatter:
        return variants
    n = _size(mesh_shape, axes)
    for d, size in enumerate(tile):
        if size % n == 0 and size >= n:
            scattered = [list(a) for a in out_axes]
            scattered[d] = scattered[d] + list(axes)
            s = _sharding(scattered)
            variants.append((f"{name}|reduce-scatter@{d}", s,
                             (Collective("reduce-scatter", axes, nbytes // n),)))
    return variants


# ---- sources ----------------------------------------------------------------------------------

def source_strategies(instr: Instruction, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    rule = SOURCE_RULES.get(instr.opcode)
    if rule is None or instr.shape.is_tuple and instr.opcode == "parameter":
        return [replicated_strategy(instr)]
    return rule(instr, mesh_shape)


def parameter_strategies(instr: Instruction, mesh_shape) -> list[Strategy]:
    return [Strategy(str(s), (s,), (), s.num_tiles(mesh_shape))
            for s in array_shardings(instr.shape.dims, mesh_shape)]


def rng_strategies(instr: Instruction, mesh_shape) -> list[Strategy]:
    """A stateful `rng` stays replicated, and XLA's partitioner keeps its values equal on every
    device by drawing them on one and all-reducing the result over the whole mesh."""
    axes = tuple(_axes(mesh_shape))
    if not axes:
        return [replicated_strategy(instr)]
    return [replace(replicated_strategy(instr),
                    collectives=(Collective("all-reduce", axes, instr.shape.byte_size),))]


def dot_strategies(instr: Instruction, mesh_shape) -> list[Strategy]:
    lhs, rhs = instr.operands
    return list(_dot_strategies(
        lhs.shape.dims, rhs.shape.dims, instr.shape.dims, instr.shape.element_bits,
        *(instr.dims(f"{side}_{kind}_dims") for side in ("lhs", "rhs")
          for kind in ("batch", "contracting")), tuple(mesh_shape)))


@functools.lru_cache(maxsize=4096)  # a stage of 24 identical layers asks 24 times alike
def _dot_strategies(lhs_dims, rhs_dims, out_dims, elem_bits, lb, lc, rb, rc, mesh_shape
                    ) -> tuple[Strategy, ...]:
    lf = [d for d in range(len(lhs_dims)) if d not in lb and d not in lc]
    rf = [d for d in range(len(rhs_dims)) if d not in rb and d not in rc]
    # each choice names the operand dims and the output dim that one mesh axis splits
    choices = [None]
    choices += [("b", i, lb[i], rb[i], i) for i in range(len(lb))]
    choices += [("m", i, d, None, len(lb) + i) for i, d in enumerate(lf)]
    choices += [("n", i, None, d, len(lb) + len(lf) + i) for i, d in enumerate(rf)]
    choices += [("k", i, lc[i], rc[i], None) for i in range(len(lc))]
    axes = _axes(mesh_shape)
    out: list[Strategy] = []
    for assign in itertools.product(choices, repeat=len(axes)):
        la = [[] for _ in lhs_dims]
        ra = [[] for _ in rhs_dims]
        oa = [[] for _ in out_dims]
        partial, names = [], []
        for axis, c in zip(axes, assign):
            if c is None:
                continue
            kind, i, ld, rd, od = c
            names.append(f"{kind}{i}@{axis}")
            if ld is not None:
                la[ld].append(axis)
            if rd is not None:
                ra[rd].append(axis)
            if od is not None:
                oa[od].append(axis)
            else:
                partial.append(axis)
        if not (_fits(lhs_dims, la, mesh_shape) and _fits(rhs_dims, ra, mesh_shape)
                and _fits(out_dims, oa, mesh_shape)):
            continue
        divisor = _size(mesh_shape, [a for a, c in zip(axes, assign) if c is not None])
        base = ",".join(names) or "R"
        for name, osh, colls in _reduction_variants(base, oa, out_dims, partial, elem_bits,
                                                    mesh_shape):
            out.append(Strategy(name, (osh,), (_sharding(la), _sharding(ra)), divisor, colls))
    return tuple(out)


_LABELS = re.compile(r"(\w+)_(\w+)->(\w+)")


def conv_strategies(instr: Instruction, mesh_shape) -> list[Strategy]:
    lhs, rhs = instr.operands[:2]
    m = _LABELS.match(str(instr.attrs.get("dim_labels", "b01f_01io->b01f")))
    lhs_l, rhs_l, out_l = m.groups()
    groups = instr.int_attr("feature_group_count", 1)
    batch_groups = instr.int_attr("batch_group_count", 1)
    choices = [None]
    if batch_groups == 1:
        choices.append(("b", lhs_l.index("b"), None, out_l.index("b")))
        if groups == 1:
            choices.append(("o", None, rhs_l.index("o"), out_l.index("f")))
            choices.append(("i", lhs_l.index("f"), rhs_l.index("i"), None))
        else:  # grouped/depthwise: split whole groups (input and output channels together)
            choices.append(("g", lhs_l.index("f"), rhs_l.index("o"), out_l.index("f")))
    axes = _axes(mesh_shape)
    out: list[Strategy] = []
    for assign in itertools.product(choices, repeat=len(axes)):
        la = [[] for _ in lhs_l]
        ra = [[] for _ in rhs_l]
        oa = [[] for _ in out_l]
        partial, names, used = [], [], []
        for axis, c in zip(axes, assign):
            if c is None:
                continue
            kind, ld, rd, od = c
            names.append(f"{kind}@{axis}")
            used.append(axis)
            for target, dim in ((la, ld), (ra, rd), (oa, od)):
                if dim is not None:
                    target[dim].append(axis)
            if od is None:
                partial.append(axis)
        if c_groups_bad(assign, groups, mesh_shape, axes):
            continue
        if not (_fits(lhs.shape.dims, la, mesh_shape) and _fits(rhs.shape.dims, ra, mesh_shape)
                and _fits(instr.shape.dims, oa, mesh_shape)):
            continue
        ins = (_sharding(la), _sharding(ra)) + tuple(
            Sharding.replicated(o.shape.rank) for o in instr.operands[2:])
        for name, osh, colls in _reduction_variants(",".join(names) or "R", oa,
                                                    instr.shape.dims, partial,
                                                    instr.shape.element_bits, mesh_shape):
            out.append(Strategy(name, (osh,), ins, _size(mesh_shape, used), colls))
    return out


def c_groups_bad(assign, groups, mesh_shape, axes) -> bool:
    """A group split must divide the number of groups."""
    n = _size(mesh_shape, [a for a, c in zip(axes, assign) if c is not None and c[0] == "g"])
    return groups % n != 0


def reduce_strategies(instr: Instruction, mesh_shape) -> list[Strategy]:
    n_in = len(instr.operands) // 2
    leaves = leaf_shapes(instr)
    return list(_reduce_strategies(
        n_in, tuple(instr.operands[0].shape.dims), tuple(sorted(set(instr.dims("dimensions")))),
        len(leaves), sum(s.element_bits for s in leaves), tuple(mesh_shape)))


@functools.lru_cache(maxsize=4096)  # like `_dot_strategies`: identical layers ask alike
def _reduce_strategies(n_in: int, dims: tuple, reduced: tuple, n_leaves: int, bits: int,
                       mesh_shape: tuple) -> tuple[Strategy, ...]:
    rank = len(dims)
    kept = [d for d in range(rank) if d not in reduced]
    out_dims = tuple(dims[d] for d in kept)
    choices = [None] + [("k", i) for i in range(len(kept))] + [("r", d) for d in reduced]
    axes = _axes(mesh_shape)
    out: list[Strategy] = []
    for assign in itertools.product(choices, repeat=len(axes)):
        ia = [[] for _ in range(rank)]
        oa = [[] for _ in kept]
        partial, names = [], []
        for axis, c in zip(axes, assign):
            if c is None:
                continue
            names.append(f"{c[0]}{c[1]}@{axis}")
            if c[0] == "k":
                ia[kept[c[1]]].append(axis)
                oa[c[1]].append(axis)
            else:
                ia[c[1]].append(axis)
                partial.append(axis)
        if not (_fits(dims, ia, mesh_shape) and _fits(out_dims, oa, mesh_shape)):
            continue
        divisor = _size(mesh_shape, [a for a, c in zip(axes, assign) if c is not None])
        ins = tuple([_sharding(ia)] * n_in) + tuple(Sharding.replicated(0)
                                                   for _ in range(n_in))
        for name, osh, colls in _reduction_variants(",".join(names) or "R", oa, out_dims,
                                                    partial, bits, mesh_shape,
                                                    scatter=n_leaves == 1):
            out.append(Strategy(name, tuple(osh for _ in range(n_leaves)), ins, divisor, colls))
    return tuple(out)


def gather_strategies(instr: Instruction, mesh_shape) -> list[Strategy]:
    """Split the batch of indices (operand replicated), or a dimension of the operand that
    every slice takes whole (indices replicated)."""
    operand, indices = instr.operands
    offset_dims = instr.dims("offset_dims")
    collapsed = set(instr.dims("collapsed_slice_dims")) | set(instr.dims("operand_batching_dims"))
    slice_sizes = instr.dims("slice_sizes")
    ivd = instr.int_attr("index_vector_dim", indices.shape.rank)
    batch_out = [d for d in range(instr.shape.rank) if d not in offset_dims]
    batch_idx = [d for d in range(indices.shape.rank) if d != ivd]
    window_operand = [d for d in range(operand.shape.rank) if d not in collapsed]
    choices = [None]
    choices += [("i", bi, bo) for bi, bo in zip(batch_idx, batch_out)]
    choices += [("p", od, offset_dims[k]) for k, od in enumerate(window_operand)
                if slice_sizes[od] == operand.shape.dims[od]]
    return _indexed_strategies(instr, operand, indices, choices, mesh_shape, out_is_operand=False)


def scatter_strategies(instr: Instruction, mesh_shape) -> list[Strategy]:
    """Split a dimension that every update window covers whole (operand, updates and output
    together), or replicate; a scatter-add into zeros (an embedding's gradient) may also split
    its updates' rows ("b"): each device scatters its rows, the partial sums are all-reduced."""
    if len(instr.operands) != 3:
        return [replicated_strategy(instr)]
    operand, indices, updates = instr.operands
    window = instr.dims("update_window_dims")
    inserted = set(instr.dims("inserted_window_dims")) | set(
        instr.dims("input_batching_dims"))
    operand_window = [d for d in range(operand.shape.rank) if d not in inserted]
    choices = [None] + [("w", od, window[k]) for k, od in enumerate(operand_window)
                        if k < len(window)
                        and updates.shape.dims[window[k]] == operand.shape.dims[od]]
    if reducer_kind(instr.called("to_apply")) == "add" and operand.opcode == "broadcast" \
            and is_zero_constant(operand.operands[0]):
        ivd = instr.int_attr("index_vector_dim", indices.shape.rank)
        rows = zip([d for d in range(indices.shape.rank) if d != ivd],
                   [d for d in range(updates.shape.rank) if d not in window])
        choices += [("b", index_dim, update_dim) for index_dim, update_dim in rows]
    axes, out = _axes(mesh_shape), []
    for assign in itertools.product(choices, repeat=len(axes)):
        oa, ia, ua = ([[] for _ in x.shape.dims] for x in (operand, indices, updates))
        for axis, c in zip(axes, assign):
            if c is not None:
                (oa if c[0] == "w" else ia)[c[1]].append(axis)
                ua[c[2]].append(axis)
        partial = [axis for axis, c in zip(axes, assign) if c is not None and c[0] == "b"]
        if not all(_fits(x.shape.dims, a, mesh_shape)
                   for x, a in ((operand, oa), (indices, ia), (updates, ua))):
            continue
        s = _sharding(oa)
        divisor = _size(mesh_shape, [a for a, c in zip(axes, assign) if c is not None])
        for name, osh, colls in _reduction_variants(
                str(s) + "".join(f",b@{a}" for a in partial), oa, tuple(operand.shape.dims),
                partial, operand.shape.element_bits, mesh_shape, scatter=False):
            out.append(Strategy(name, (osh,), (s, _sharding(ia), _sharding(ua)), divisor,
                                colls))
    return out


def _indexed_strategies(instr, operand, indices, choices, mesh_shape, out_is_operand):
    axes = _axes(mesh_shape)
    out: list[Strategy] = []
    for assign in itertools.product(choices, repeat=len(axes)):
        pa = [[] for _ in range(operand.shape.rank)]
        ia = [[] for _ in range(indices.shape.rank)]
        oa = [[] for _ in range(instr.shape.rank)]
        names = []
        for axis, c in zip(axes, assign):
            if c is None:
                continue
            names.append(f"{c[0]}{c[1]}@{axis}")
            (ia if c[0] == "i" else pa)[c[1]].append(axis)
            oa[c[2]].append(axis)
        if not (_fits(operand.shape.dims, pa, mesh_shape)
                and _fits(indices.shape.dims, ia, mesh_shape)
                and _fits(instr.shape.dims, oa, mesh_shape)):
            continue
        divisor = _size(mesh_shape, [a for a, c in zip(axes, assign) if c is not None])
        out.append(Strategy(",".join(names) or "R", (_sharding(oa),),
                            (_sharding(pa), _sharding(ia)), divisor))
    return out


#: the sources with strategies of their own (`source_strategies`); any other source is replicated
SOURCE_RULES = {"parameter": parameter_strategies, "dot": dot_strategies,
                "convolution": conv_strategies, "reduce": reduce_strategies,
                "gather": gather_strategies, "scatter": scatter_strategies,
                "rng": rng_strategies}


# ---- followers ------------------------------------------------------------------------------

#: ops that follow the sharding of their first operand (`followed_operand`, `follow`), besides
#: IDENTITY; `_whole_dims` says which dimensions some of them need whole
FOLLOW_FIRST = (VIEWS | BATCH_NORM | WINDOW_REDUCTIONS
                | {"reverse", "slice", "dynamic-slice", "sort", "pad", "dynamic-update-slice"})
#: ops that follow their largest operand of their rank that is not transparent
FOLLOW_LARGEST = ELEMENTWISE | {"concatenate"}


def followed_operand(instr: Instruction, transparent) -> int | None:
    """Index of the operand whose sharding this instruction follows, or None for a source."""
    op = instr.opcode
    if op in IDENTITY or op in FOLLOW_FIRST:
        return 0 if instr.operands and not instr.operands[0].shape.is_tuple else None
    if instr.is_identity_call:
        return 0
    if op in FOLLOW_LARGEST:
        candidates = [i for i, o in enumerate(instr.operands)
                      if not transparent(o) and o.shape.rank == instr.shape.rank
                      and not o.shape.is_tuple]
        if not candidates:
            return None
        return max(candidates, key=lambda i: (instr.operands[i].shape.byte_size, -i))
    return None


def follow(instr: Instruction, index: int, s: Sharding, mesh_shape) -> Strategy:
    """The strategy of a follower whose operand `index` has sharding `s`."""
    op = instr.opcode
    ops = instr.operands
    rank = instr.shape.rank if not instr.shape.is_tuple else None

    def same_for_all(out: Sharding) -> Strategy:
        return _same_for_all(tuple((o.shape.rank, o.shape.is_tuple) for o in ops), out,
                             tuple(mesh_shape))

    if op in IDENTITY or op in ELEMENTWISE or (op == "custom-call"):
        if op == "opt-barrier":
            return Strategy(str(s), (s,), (s,), 1)
        return same_for_all(s)
    if op == "transpose":
        out = transpose_sharding(s, instr.dims("dimensions"))
        return Strategy(str(out), (out,), (s,), out.num_tiles(mesh_shape))
    if op in RESHAPES:
        out = reshape_sharding(s, ops[0].shape.dims, instr.shape.dims, mesh_shape)
        if out is None:  # gather first, reshape replicated
            r = Sharding.replicated(ops[0].shape.rank)
            return Strategy("R", (Sharding.replicated(rank),), (r,), 1)
        return Strategy(str(out), (out,), (s,), out.num_tiles(mesh_shape))
    # ops that need some dimensions whole: clear the axes on those dimensions
    whole = _whole_dims(instr)
    kept = Sharding(tuple(() if d in whole else axes for d, axes in enumerate(s.dim_axes)))
    if op == "concatenate":
        return same_for_all(kept)
    if op in ("slice", "pad", "reverse", "dynamic-slice"):
        out = kept if kept.divides(instr.shape.dims, mesh_shape) else Sharding.replicated(rank)
        keep = out if out.rank == ops[0].shape.rank else Sharding.replicated(ops[0].shape.rank)
        ins = (keep,) + tuple(Sharding.replicated(o.shape.rank) for o in ops[1:])
        return Strategy(str(out), (out,), ins, out.num_tiles(mesh_shape))
    if op == "dynamic-update-slice":
        update = ops[1]
        upd = kept if kept.divides(update.shape.dims, mesh_shape) else Sharding.replicated(
            update.shape.rank)
        out = kept if upd == kept else Sharding.replicated(rank)
        ins = (out, upd) + tuple(Sharding.replicated(0) for _ in ops[2:])
        return Strategy(str(out), (out,), ins, out.num_tiles(mesh_shape))
    if op == "sort" or op in WINDOW_REDUCTIONS:
        outs = tuple(kept for _ in leaf_shapes(instr))
        ins = tuple(kept if o.shape.rank == kept.rank else Sharding.replicated(o.shape.rank)
                    for o in ops)
        return Strategy(str(kept), outs, ins, kept.num_tiles(mesh_shape))
    if op.startswith("batch-norm"):
        # XLA does not partition batch norm, not even along the feature dimension: it gathers
        # every operand, computes the whole result on each device and slices it to the
        # annotated sharding (free). So the inputs are replicated and the work is not split.
        outs = tuple(kept if leaf.rank == kept.rank else
                     Sharding.replicated(leaf.rank) for leaf in leaf_shapes(instr))
        ins = tuple(Sharding.replicated(o.shape.rank) for o in ops)
        return Strategy(str(kept), outs, ins, 1)
    raise ValueError(f"no follow rule for {op}")


@functools.lru_cache(maxsize=4096)  # most instructions are elementwise: ask alike per layer
def _same_for_all(operands: tuple, out: Sharding, mesh_shape: tuple) -> Strategy:
    """`out` for the result and every array operand of its rank (`operands`: each one's
    (rank, is a tuple)), the others replicated."""
    ins = tuple(out if r == out.rank and not is_tuple else Sharding.replicated(r)
                for r, is_tuple in operands)
    return Strategy(str(out), (out,), ins, out.num_tiles(mesh_shape))


def _whole_dims(instr: Instruction) -> set[int]:
    """Dimensions an op needs whole on every device."""
    op = instr.opcode
    src = instr.operands[0].shape.dims
    if op == "concatenate":
        return set(instr.dims("dimensions"))
    if op == "slice":
        whole = set()
        text = str(instr.attrs.get("slice", ""))
        for d, (lo, hi, *step) in enumerate(re.findall(r"\[(\d+):(\d+)(?::(\d+))?\]", text)):
            if int(lo) != 0 or int(hi) != src[d] or (step and step[0] not in ("", "1")):
                whole.add(d)
        return whole
    if op == "pad":
        text = str(instr.attrs.get("padding", ""))
        return {d for d, p in enumerate(text.split("x")) if set(p.replace("_", "")) - {"0"}}
    if op in ("reverse", "sort"):
        return set(instr.dims("dimensions"))
    if op in ("dynamic-slice", "dynamic-update-slice"):
        sizes = instr.dims("dynamic_slice_sizes") if op == "dynamic-slice" else \
            instr.operands[1].shape.dims
        return {d for d, (n, k) in enumerate(zip(src, sizes)) if n != k}
    if op in WINDOW_REDUCTIONS:
        w = instr.window()
        sizes = w.get("size", [1] * len(src))
        strides = w.get("stride", [1] * len(src))
        pads = w.get("pad", [(0, 0)] * len(src))
        return {d for d in range(len(src))
                if sizes[d] != 1 or strides[d] != 1 or pads[d] != (0, 0)}
    if op.startswith("batch-norm"):
        feature = instr.int_attr("feature_index", 0)
        return {d for d in range(len(src)) if d != feature}
    return set()


_TRANSPARENT_THROUGH = ELEMENTWISE | VIEWS


def is_transparent(instr: Instruction, _cache: dict = {}) -> bool:
    """Constants, iota and broadcasts, and elementwise ops, reshapes and transposes computed
    from them alone: cheap values each user gets in the sharding it needs (one copy per
    sharding, computed where it is used)."""
    key = id(instr)
    hit = _cache.get(key)
    if hit is not None and hit[0] is instr:
        return hit[1]
    if instr.opcode in TRANSPARENT:
        result = True
    elif instr.opcode in _TRANSPARENT_THROUGH and not instr.shape.is_tuple and instr.operands:
        result = all(is_transparent(o) for o in instr.operands)
    else:
        result = False
    _cache[key] = (instr, result)
    return result


def transparent_operand_needs(instr: Instruction, out: Sharding,
                              mesh_shape) -> list[Sharding]:
    """What each operand of a transparent instruction must be given for its result to come
    out in `out`."""
    op = instr.opcode
    if op == "broadcast":
        return [Sharding(tuple(out.dim_axes[d] for d in instr.dims("dimensions")))]
    if op == "transpose":
        perm = instr.dims("dimensions")
        inverse = [perm.index(d) for d in range(len(perm))]
        return [transpose_sharding(out, tuple(inverse))]
    if op in RESHAPES:
        src = instr.operands[0].shape.dims
        back = reshape_sharding(out, instr.shape.dims, src, mesh_shape)
        return [back if back is not None else Sharding.replicated(len(src))]
    return [out if o.shape.rank == out.rank else Sharding.replicated(o.shape.rank)
            for o in instr.operands]
