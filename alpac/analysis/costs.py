"""Per-instruction cost figures: FLOPs, transcendentals, bytes read and bytes written.

The figures follow XLA's `HloCostAnalysis` (the numbers `jax`'s `cost_analysis()` reports), so
that alpac's estimates and XLA's can be compared op by op:

- an elementwise op costs one flop per output element, or one transcendental for exp, log,
  logistic, power, sqrt, rsqrt, cbrt, tanh, sin, cos, tan, erf, expm1, log1p and atan2; divide,
  compare, select, clamp, convert and bitcast-convert are ordinary flops;
- a dot costs 2 flops per output element per contracted element; a convolution 2 flops per
  multiply-add that touches real input (positions in padding or base dilation cost nothing);
- ops with a scalar body apply it as many times as XLA does: reduce (input - output elements,
  the combinations a reduction tree performs), reduce-window ((window - 1) per output element),
  select-and-scatter, scatter and map;
- bytes are each operand read plus the output written, except that slicing ops (slice,
  dynamic-slice, gather) read only what they output, dynamic-update-slice and scatter touch only
  the updated region, and a fusion is charged at its boundary only.

alpac differs from XLA on purpose where XLA's figure would mislead a planner:

- `while` counts its body and condition once per iteration (XLA: once in total). The trip count
  (`alpac.analysis.tripcount`) comes from `known_trip_count` in the backend config, or from
  the usual counter pattern (a tuple element initialised to a constant, compared with a
  loop-invariant constant in the condition, stepped by a constant in the body). When only the
  limit is known the counter is assumed to start at 0 and step by 1; when not even that, the
  loop counts once. Both are estimates, listed in `CostTable.estimated_loops`;
  `CostTable(trip_counts=...)` overrides them.
- `conditional` costs its most expensive branch (XLA: the maximum of each figure separately,
  which may mix branches).
- batch-norm ops cost what XLA's own BatchNormExpander turns them into (XLA: nothing).
- sort costs n·ceil(log2 d) comparisons (n elements, d the sorted dimension) times the
  comparator's flops (XLA: n·ceil(log2 n) over the whole array, comparator ignored); top-k
  (the opcode and the TopK custom-call) n·ceil(log2 k) (XLA: nothing).
- reduce-scatter costs its reducer once per output element, the same "two inputs per output"
  assumption XLA makes for all-reduce (XLA: nothing); reduce-window never uses XLA's special
  count for windows that span a whole padded dimension.
- custom-calls cost 0 flops and move their operands, or a real figure for targets alpac knows
  (TransformerEngine's fused attention), or nothing for sharding annotations (XLA: -1 flops and
  -1 bytes, meaning "unknown").
- tuple, get-tuple-element, opt-barrier and the `*-done` halves of asynchronous pairs are free
  (XLA charges tuples their pointer table and `*-done` ops their operands again); dynamic-slice
  and dynamic-update-slice read every start index (XLA: only the first).
- inside a fusion a parameter is read once however many ops use it, and a parameter that is
  only gathered is read row by row (XLA re-reads it for each broadcast or reshape user and
  reads a gathered one whole).
- sub-byte types are packed (s4 is half a byte; XLA's default layout gives it a whole byte).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Mapping

from alpac.analysis.tripcount import while_trip_count
from alpac.errors import UserError
from alpac.hlo.ir import Computation, Instruction, Module
from alpac.hlo.opcodes import ASYNC_DONES, ELEMENTWISE, PARTITIONER_CALLS, PASS_THROUGH, RANDOM, \
    SLICES, TRANSCENDENTAL
from alpac.hlo.shape import Shape


@dataclass(frozen=True, slots=True)
class Cost:
    flops: float = 0.0
    transcendentals: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0

    @staticmethod
    def zero() -> "Cost":
        return _ZERO

    @property
    def bytes_accessed(self) -> float:
        return self.bytes_read + self.bytes_written

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.transcendentals + other.transcendentals,
                    self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written)

    def __mul__(self, k: float) -> "Cost":
        return Cost(self.flops * k, self.transcendentals * k, self.bytes_read * k,
                    self.bytes_written * k)

    __rmul__ = __mul__


_ZERO = Cost()


def instruction_cost(instr: Instruction) -> Cost:
    """The cost of executing `instr` once, called computations included."""
    return _Costing({}).instruction(instr)


def module_cost(module: Module) -> Cost:
    """The cost of one execution of the module's entry computation."""
    return CostTable(module).total


class CostTable:
    """Cost of every instruction of the entry and of every computation reachable from it.

    `table[instr]` is the cost of executing `instr` once, including the computations it calls
    (a while: its body and condition times its trip count). Instructions inside a while body are
    not multiplied: the multiplier is `trip_counts[while_instr]`. So the entry's instructions sum
    to `total`, and summing every instruction of the table would count callees twice. Inside a
    fusion the instructions carry their standalone figures; only the fusion's bytes are real.

    `trip_counts` (while instruction name -> count) replaces derived or estimated counts.
    """

    def __init__(self, module: Module, trip_counts: Mapping[str, int] | None = None):
        costing = _Costing(dict(trip_counts or {}))
        self.total = costing.computation(module.entry)
        unknown = set(trip_counts or ()) - {loop.name for loop in costing.trip_counts}
        if unknown:
            raise UserError(f"no while loop named {', '.join(sorted(unknown))} in module "
                            f"{module.name} (given a trip count)")
        self.costs: dict[Instruction, Cost] = costing.costs
        self.trip_counts: dict[Instruction, int] = costing.trip_counts
        self.estimated_loops: list[Instruction] = costing.estimated_loops
        self._computation_costs = costing.computation_costs

    def __getitem__(self, instr: Instruction) -> Cost:
        return self.costs[instr]

    def __contains__(self, instr: Instruction) -> bool:
        return instr in self.costs

    def __len__(self) -> int:
        return len(self.costs)

    def __iter__(self) -> Iterator[Instruction]:
        return iter(self.costs)

    def computation_cost(self, comp: Computation) -> Cost:
        """One execution of `comp` (which must be reachable from the entry)."""
        return self._computation_costs[comp]


# ---- the analysis ------------------------------------------------------------------------------

class _Costing:
    """Memoised costs: every computation is costed once, however many sites call it."""

    def __init__(self, trip_overrides: dict[str, int]):
        self.trip_overrides = trip_overrides
        self.costs: dict[Instruction, Cost] = {}
        self.computation_costs: dict[Computation, Cost] = {}
        self.trip_counts: dict[Instruction, int] = {}
        self.estimated_loops: list[Instruction] = []
        self._users: dict[Computation, dict[Instruction, list[Instruction]]] = {}

    def instruction(self, instr: Instruction) -> Cost:
        cost = self.costs.get(instr)
        if cost is None:
            cost = self.costs[instr] = _RULES.get(instr.opcode, _data_movement)(instr, self)
        return cost

    def computation(self, comp: Computation) -> Cost:
        cost = self.computation_costs.get(comp)
        if cost is None:
            flops = trans = read = written = 0.0
            for instr in comp.instructions:
                c = self.instruction(instr)
                flops += c.flops
                trans += c.transcendentals
                read += c.bytes_read
                written += c.bytes_written
            cost = self.computation_costs[comp] = Cost(flops, trans, read, written)
        return cost

    def body(self, instr: Instruction, key: str = "to_apply") -> Cost:
        """Arithmetic of one application of a scalar body; its bytes stay in registers."""
        comp = instr.called(key)
        if comp is None:
            return _ZERO
        c = self.computation(comp)
        return Cost(c.flops, c.transcendentals)

    def users(self, comp: Computation) -> dict[Instruction, list[Instruction]]:
        if comp not in self._users:
            self._users[comp] = comp.users()
        return self._users[comp]

    def trip_count(self, loop: Instruction) -> int:
        if loop.name in self.trip_overrides:
            n = int(self.trip_overrides[loop.name])
        else:
            n, estimated = while_trip_count(loop)
            if estimated:
                self.estimated_loops.append(loop)
        self.trip_counts[loop] = n
        return n


Rule = Callable[[Instruction, _Costing], Cost]


# ---- shapes --------------------------------------------------------------------------------

def _elements(shape: Shape) -> int:
    """Elements of an array, or of the first array of a tuple (variadic reduce, sort, ...)."""
    while shape.is_tuple:
        if not shape.tuple_shapes:
            return 0
        shape = shape.tuple_shapes[0]
    return shape.num_elements


def _leaf_elements(shape: Shape) -> int:
    return sum(leaf.num_elements for _, leaf in shape.leaves())


def _operand_bytes(instr: Instruction) -> int:
    return sum(op.shape.byte_size for op in instr.operands)


# ---- rules -----------------------------------------------------------------------------------

def _free(instr: Instruction, ctx: _Costing) -> Cost:
    return _ZERO


def _data_movement(instr: Instruction, ctx: _Costing) -> Cost:
    """No arithmetic: every operand read once, the output written once."""
    return Cost(0.0, 0.0, _operand_bytes(instr), instr.shape.byte_size)


def _transpose(instr: Instruction, ctx: _Costing) -> Cost:
    """Free when the layouts make it a relabelling of the same bytes (XLA: a bitcast)."""
    operand = instr.operands[0].shape
    out_order = _minor_to_major(instr.shape)
    permutation = instr.dims("dimensions")
    if tuple(permutation[d] for d in out_order) == _minor_to_major(operand):
        return _ZERO
    return _data_movement(instr, ctx)


def _minor_to_major(shape: Shape) -> tuple[int, ...]:
    """The layout, or XLA's default one (row-major) when the text gave none."""
    order = shape.minor_to_major
    return order if order else tuple(range(shape.rank - 1, -1, -1))


def _elementwise(instr: Instruction, ctx: _Costing) -> Cost:
    n = instr.shape.num_elements
    if instr.opcode in TRANSCENDENTAL:
        return Cost(0.0, n, _operand_bytes(instr), instr.shape.byte_size)
    return Cost(n, 0.0, _operand_bytes(instr), instr.shape.byte_size)


def _slice(instr: Instruction, ctx: _Costing) -> Cost:
    """slice / dynamic-slice / gather read only the elements they output (plus indices)."""
    out = instr.shape.byte_size
    indices = sum(op.shape.byte_size for op in instr.operands[1:])
    return Cost(0.0, 0.0, out + indices, out)


def _dynamic_update_slice(instr: Instruction, ctx: _Costing) -> Cost:
    """The operand is updated in place: only the update is read and written."""
    update = instr.operands[1].shape.byte_size
    indices = sum(op.shape.byte_size for op in instr.operands[2:])
    return Cost(0.0, 0.0, update + indices, update)


def _scatter(instr: Instruction, ctx: _Costing) -> Cost:
    """In place like dynamic-update-slice; the combiner runs once per update element."""
    n = (len(instr.operands) - 1) // 2
    indices = instr.operands[n].shape.byte_size
    updates = instr.operands[n + 1:]
    update_bytes = sum(u.shape.byte_size for u in updates)
    applications = updates[0].shape.num_elements if updates else 0
    # The updated region of the operand is read too, hence updates twice.
    return ctx.body(instr) * applications + Cost(0.0, 0.0, 2 * update_bytes + indices,
                                                 update_bytes)


def _reduce(instr: Instruction, ctx: _Costing) -> Cost:
    applications = instr.operands[0].shape.num_elements - _elements(instr.shape)
    return ctx.body(instr) * applications + _data_movement(instr, ctx)


def _reduce_window(instr: Instruction, ctx: _Costing) -> Cost:
    window = math.prod(instr.window().get("size", []))
    return (ctx.body(instr) * ((window - 1) * _elements(instr.shape))
            + _data_movement(instr, ctx))


def _select_and_scatter(instr: Instruction, ctx: _Costing) -> Cost:
    """Per source element: window - 1 selections, then one scatter combination."""
    source = instr.operands[1].shape.num_elements
    window = math.prod(instr.window().get("size", []))
    return (ctx.body(instr, "select") * (source * (window - 1))
            + ctx.body(instr, "scatter") * source + _data_movement(instr, ctx))


def _map(instr: Instruction, ctx: _Costing) -> Cost:
    return ctx.body(instr) * instr.shape.num_elements + _data_movement(instr, ctx)


def _comparisons(elements: int, length: int) -> int:
    """elements * ceil(log2 length): a comparison sort of every row of `length`."""
    return elements * (length - 1).bit_length()


def _sort(instr: Instruction, ctx: _Costing) -> Cost:
    operand = instr.operands[0].shape
    length = operand.dims[instr.dims("dimensions")[0]]
    compare = max(ctx.body(instr).flops, 1.0)
    return Cost(_comparisons(operand.num_elements, length) * compare, 0.0,
                _operand_bytes(instr), instr.shape.byte_size)


def _top_k(instr: Instruction, ctx: _Costing) -> Cost:
    """A partial sort: ceil(log2 k) comparisons per element (a k-element heap)."""
    values = instr.shape.tuple_shapes[0] if instr.shape.is_tuple else instr.shape
    compare = max(ctx.body(instr, "called_computations").flops, 1.0)
    comparisons = _comparisons(instr.operands[0].shape.num_elements, values.dims[-1])
    return Cost(comparisons * compare, 0.0, _operand_bytes(instr), instr.shape.byte_size)


def _all_reduce(instr: Instruction, ctx: _Costing) -> Cost:
    """Like XLA: each output element combines two inputs (as if between two replicas)."""
    return ctx.body(instr) * _leaf_elements(instr.shape) + _data_movement(instr, ctx)


def _dot(instr: Instruction, ctx: _Costing) -> Cost:
    lhs = instr.operands[0].shape
    contracted = math.prod(lhs.dims[d] for d in instr.dims("lhs_contracting_dims"))
    return Cost(2.0 * instr.shape.num_elements * contracted, 0.0, _operand_bytes(instr),
                instr.shape.byte_size)


def transposed_batch(instr: Instruction) -> int:
    """How many leading dimensions of a dot's result are the batch of a batched dot whose
    lhs holds its matrices transposed, [k,m] (its contracted dimension before its free one),
    and whose rhs does not, [k,n]: XLA's CPU backend runs these in a loop of its own rather
    than its matmul library, dearer per matrix (`Calibration.matrix_s`). In BERT's and
    GPT's one-device training steps the 8 dots of this form took 0.9-1.5 µs per 16x16
    matrix, the 40 other batched dots 0.02-0.2. 0 for any other instruction."""
    if instr.opcode != "dot":  # strategy_seconds asks of every instruction: the cheap test first
        return 0
    batch = instr.dims("lhs_batch_dims")
    lhs_k, rhs_k = instr.dims("lhs_contracting_dims"), instr.dims("rhs_contracting_dims")
    if not batch or len(lhs_k) != 1:
        return 0
    lhs_free = [d for d in range(instr.operands[0].shape.rank) if d not in batch + lhs_k]
    rhs_batch = instr.dims("rhs_batch_dims")
    rhs_free = [d for d in range(instr.operands[1].shape.rank) if d not in rhs_batch + rhs_k]
    before = lhs_free and rhs_free and lhs_k[0] < lhs_free[0] and rhs_k[0] < rhs_free[0]
    return len(batch) if before else 0


_LABELS = re.compile(r"(\w+)_(\w+)->(\w+)")


def _convolution(instr: Instruction, ctx: _Costing) -> Cost:
    """2 flops per multiply-add between a kernel element and a real (not padded) input."""
    lhs, rhs, out = instr.operands[0].shape, instr.operands[1].shape, instr.shape
    labels = _LABELS.fullmatch(str(instr.attrs["dim_labels"]))
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = instr.window()
    spatial = [str(i) for i in range(sum(c.isdigit() for c in lhs_labels))]

    def per_dimension(key: str, default) -> list:
        return window.get(key, [default] * len(spatial))

    positions = math.prod(
        _valid_positions(lhs.dims[lhs_labels.index(d)], rhs.dims[rhs_labels.index(d)],
                         out.dims[out_labels.index(d)], stride, pad[0], base, dilation)
        for d, stride, pad, base, dilation in zip(
            spatial, per_dimension("stride", 1), per_dimension("pad", (0, 0)),
            per_dimension("lhs_dilate", 1), per_dimension("rhs_dilate", 1)))
    in_features = lhs.dims[lhs_labels.index("f")] // instr.int_attr("feature_group_count", 1)
    batch = lhs.dims[lhs_labels.index("b")] // instr.int_attr("batch_group_count", 1)
    out_features = out.dims[out_labels.index("f")]
    flops = 2.0 * in_features * out_features * batch * positions
    return Cost(flops, 0.0, _operand_bytes(instr), out.byte_size)


def _valid_positions(size: int, kernel: int, out: int, stride: int, pad_low: int,
                     base_dilation: int, window_dilation: int) -> int:
    """(kernel index, output index) pairs of one spatial dimension that land on a real input.

    Output o and kernel tap k read dilated input position o*stride - pad_low + k*window_dilation,
    which is real when it is a multiple of base_dilation inside the dilated input.
    """
    g = math.gcd(stride, base_dilation)
    period = base_dilation // g  # outputs between two that land on real input, for one tap
    inverse = pow(stride // g, -1, period) if period > 1 else 0
    last = (size - 1) * base_dilation
    total = 0
    for k in range(kernel):
        c = pad_low - k * window_dilation  # o*stride must be >= c, <= last + c, = c mod bd
        lo, hi = max(0, -(-c // stride)), min(out - 1, (last + c) // stride)
        if hi < lo or c % g:
            continue
        first = lo + ((c // g) * inverse - lo) % period if period > 1 else lo
        if first <= hi:
            total += (hi - first) // period + 1
    return total


# What XLA's BatchNormExpander turns each op into, measured by compiling it on CPU:
# (flops per element, flops per feature); one rsqrt per feature.
_BATCH_NORM = {
    "batch-norm-training": (7, 5),
    "batch-norm-inference": (2, 4),
    "batch-norm-grad": (11, 4),
}


def _batch_norm(instr: Instruction, ctx: _Costing) -> Cost:
    per_element, per_feature = _BATCH_NORM[instr.opcode]
    x = instr.operands[0].shape
    features = x.dims[instr.int_attr("feature_index")]
    return Cost(per_element * x.num_elements + per_feature * features, features,
                _operand_bytes(instr), instr.shape.byte_size)


def _fft(instr: Instruction, ctx: _Costing) -> Cost:
    """XLA's estimate: 4 complex multiply-adds per element per halving of each length."""
    halvings = math.prod(n.bit_length() - 1 for n in instr.dims("fft_length"))
    flops = 8.0 * halvings * _elements(instr.operands[0].shape)
    return Cost(flops, 0.0, _operand_bytes(instr), instr.shape.byte_size)


def _rng(instr: Instruction, ctx: _Costing) -> Cost:
    """Like XLA: one transcendental per generated element (the state counts as generated)."""
    return Cost(0.0, _leaf_elements(instr.shape), _operand_bytes(instr), instr.shape.byte_size)


# ---- custom calls --------------------------------------------------------------------------

_CONFIG_INT = re.compile(r"(\w+)\s*=\s*(-?\d+)\s*:\s*i64")


def _fused_attention(instr: Instruction, ctx: _Costing, backward: bool) -> Cost:
    """TransformerEngine's fused attention, counted as the dots it replaces (mask ignored):
    forward QK^T and PV; backward recomputes QK^T, then dV, dP, dQ and dK."""
    config = {k: int(v) for k, v in _CONFIG_INT.findall(str(instr.attrs.get("backend_config")))}
    try:
        scores = (config["input_batch"] * config["attn_heads"] * config["q_max_seqlen"]
                  * config["kv_max_seqlen"])
        qk, v = config["qk_head_dim"], config["v_head_dim"]
    except KeyError:
        return Cost(0.0, 0.0, _operand_bytes(instr), instr.shape.byte_size)
    depth = 3 * qk + 2 * v if backward else qk + v
    return Cost(2.0 * scores * depth, scores, _operand_bytes(instr), instr.shape.byte_size)


_CUSTOM_CALLS: dict[str, Rule] = {
    **dict.fromkeys(sorted(PARTITIONER_CALLS), _free),
    "te_fused_attn_forward_ffi": partial(_fused_attention, backward=False),
    "te_fused_attn_backward_ffi": partial(_fused_attention, backward=True),
    "TopK": _top_k,
}


def _custom_call(instr: Instruction, ctx: _Costing) -> Cost:
    """Unknown targets do no arithmetic alpac can see; they still move their operands."""
    return _CUSTOM_CALLS.get(instr.custom_call_target, _data_movement)(instr, ctx)


# ---- called computations ---------------------------------------------------------------------

def _call(instr: Instruction, ctx: _Costing) -> Cost:
    """call / async-start: the callee's instructions, bytes included."""
    return sum((ctx.computation(c) for c in instr.called_computations), _ZERO)


def _fusion(instr: Instruction, ctx: _Costing) -> Cost:
    """The body's arithmetic; bytes only where data crosses the fusion boundary."""
    body = instr.called("calls")
    inner = ctx.computation(body)
    users = ctx.users(body)
    read = sum(_fused_parameter_read(p, users[p]) for p in body.parameters)
    return Cost(inner.flops, inner.transcendentals, read, _fusion_written(body.root))


def _fused_parameter_read(param: Instruction, users: list[Instruction]) -> int:
    """A parameter only sliced is read slice by slice; one updated in place is not read."""
    sliced, whole = 0, False
    for user in users:
        if user.opcode in SLICES and user.operands[0] is param:
            sliced += user.shape.byte_size
        elif not (user.opcode == "dynamic-update-slice" and user.operands[0] is param):
            whole = True
    return param.shape.byte_size if whole else min(sliced, param.shape.byte_size)


def _fusion_written(root: Instruction) -> int:
    """An in-place update writes only the update, also as one output of several."""
    if root.opcode == "dynamic-update-slice":
        return root.operands[1].shape.byte_size
    if root.opcode == "tuple":
        return sum(_fusion_written(op) for op in root.operands)
    return root.shape.byte_size


def _while(instr: Instruction, ctx: _Costing) -> Cost:
    once = ctx.computation(instr.called("body")) + ctx.computation(instr.called("condition"))
    return once * ctx.trip_count(instr)


def _conditional(instr: Instruction, ctx: _Costing) -> Cost:
    branches = [ctx.computation(c) for c in instr.called_computations]
    return max(branches, key=lambda c: (c.flops + c.transcendentals, c.bytes_accessed),
               default=_ZERO)


# ---- the table -------------------------------------------------------------------------------

_ELEMENTWISE = ELEMENTWISE - {"copy"}  # XLA charges copy its bytes only
# no work of their own: names for values that exist already, markers, the second halves of
# asynchronous pairs, and the token and rng state
_FREE = (PASS_THROUGH | ASYNC_DONES
         | {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
            "rng-get-and-update-state", "async-update"})

_RULES: dict[str, Rule] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    **dict.fromkeys(sorted(_FREE), _free),
    **dict.fromkeys(sorted(SLICES), _slice),
    "transpose": _transpose,
    "dynamic-update-slice": _dynamic_update_slice,
    "scatter": _scatter,
    "reduce": _reduce,
    "reduce-window": _reduce_window,
    "select-and-scatter": _select_and_scatter,
    "map": _map,
    "sort": _sort,
    "topk": _top_k,
    **dict.fromkeys(("all-reduce", "all-reduce-start", "reduce-scatter"), _all_reduce),
    "dot": _dot,
    "convolution": _convolution,
    "fft": _fft,
    **dict.fromkeys(_BATCH_NORM, _batch_norm),
    **dict.fromkeys(sorted(RANDOM), _rng),
    "custom-call": _custom_call,
    **dict.fromkeys(("call", "async-start"), _call),
    "fusion": _fusion,
    "while": _while,
    "conditional": _conditional,
}
