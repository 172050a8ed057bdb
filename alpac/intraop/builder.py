"""From an HLO module on a logical mesh to a `StrategyGraph`, and from the ILP's answer back to
a sharding per instruction.

Walks the entry computation in order (loop bodies and conditional branches where they are
called, their costs multiplied by the trip count). Sources get an ILP node; followers add
their costs to the node they follow; every operand whose sharding differs from what its user
needs adds an edge priced as the resharding XLA will do. Values that XLA materialises
(parameters, outputs, results of dots, reduces, ...) are live from their birth to their last
use; alpac.intraop.memory turns that (or a pipeline stage's `StageMemory`) into the ILP's
memory points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from alpac.analysis.costmodel import CostModel
from alpac.analysis.costs import CostTable, transposed_batch
from alpac.analysis.fusion import KernelShare, kernel_shares
from alpac.errors import UserError
from alpac.hlo.ir import Computation, Instruction, Module
from alpac.hlo.opcodes import COLLECTIVE_OPS, CONTRACTIONS, LOOP_FUSIBLE, REDUCTIONS
from alpac.hlo.shape import Shape
from alpac.intraop.collectives import Collective, reshard
from alpac.intraop.deferral import reduced_once
from alpac.intraop.memory import StageMemory, liveness_points, stage_point
from alpac.intraop.problem import StrategyGraph
from alpac.intraop.receiving import Receive, receive_seconds
from alpac.intraop.space import array_shardings
from alpac.intraop.strategies import MATERIALIZED, UNSUPPORTED_OPS, Strategy, follow, \
    followed_operand, is_transparent, replicated_strategy, rule_strategies, source_strategies, \
    transparent_operand_needs
from alpac.plan.mesh import LogicalMesh
from alpac.plan.sharding import Sharding


@dataclass
class Value:
    """An array leaf with a sharding per strategy of its node (node None: one fixed sharding)."""

    node: int | None
    shardings: list[Sharding]
    shape: Shape
    producer: Instruction
    leaf: tuple[int, ...] = ()

    def sharding(self, choice) -> Sharding:
        return self.shardings[0 if self.node is None else choice[self.node]]


@dataclass
class Use:
    """A value flowing into a place that needs some sharding, per strategy of `node`: an
    operand slot of `user`, or (slot None) a loop's state or an aliased output at `index` of
    `user`'s result. `value` is None when the operand is transparent (cloned when written)."""

    value: Value | None
    user: Instruction
    slot: int | None
    index: tuple[int, ...]
    node: int | None
    required: list[Sharding]
    multiplier: float

    def required_sharding(self, choice) -> Sharding:
        return self.required[0 if self.node is None else choice[self.node]]


@dataclass
class InstrPlan:
    node: int | None
    strategies: list[Strategy]  # per strategy of `node` (one when node is None)
    multiplier: float

    def strategy(self, choice) -> Strategy:
        return self.strategies[0 if self.node is None else choice[self.node]]


@dataclass
class ShardingGraph:
    """The ILP problem plus everything needed to read its answer back."""

    module: Module
    mesh: LogicalMesh
    model: CostModel
    graph: StrategyGraph
    costs: CostTable
    plans: dict[Instruction, InstrPlan] = field(default_factory=dict)
    values: dict[tuple[Instruction, tuple], Value] = field(default_factory=dict)
    uses: list[Use] = field(default_factory=list)
    outputs: dict[tuple[int, ...], Value] = field(default_factory=dict)  # entry result leaves
    node_instr: list[Instruction] = field(default_factory=list)
    kernels: dict[Computation, dict] = field(default_factory=dict)  # kernel_shares per comp
    # contraction -> share of its runs its all-reduce is priced at (alpac.intraop.deferral)
    reduced_once: dict[Instruction, float] = field(default_factory=dict)
    # node -> per strategy, the seconds receiving that parameter costs (in the objective)
    receiving: dict[int, np.ndarray] = field(default_factory=dict)

    def receive_seconds(self, choice) -> float:
        """What receiving the parameters costs at `choice` (`Receive`): the objective holds
        it, the stage's own time does not."""
        return sum(float(costs[choice[node]]) for node, costs in self.receiving.items())

    def kernel_share(self, instr: Instruction) -> KernelShare | None:
        """The instruction's share of the fused kernel it runs in (None: a contraction, or a
        cost model that prices instructions)."""
        if not self.model.prices_kernels or self.costs is None:
            return None
        comp = instr.parent
        if comp not in self.kernels:
            self.kernels[comp] = kernel_shares(comp, self.costs, cpu=self.model.cluster.is_cpu)
        return self.kernels[comp].get(instr)


class _Builder:
    def __init__(self, module: Module, mesh: LogicalMesh, cluster, costs: CostTable,
                 budget: float | None, axes: tuple[int, ...] | None, hint: "Hint | None",
                 allow=None, repeats: dict[str, float] | None = None,
                 memory: StageMemory | None = None, accumulations: dict | None = None,
                 received: dict[str, Receive] | None = None):
        self.model = CostModel(cluster, mesh)
        self.received = received or {}  # parameter name -> what receiving it costs
        self.stage_memory = memory
        # axes not being solved count as size 1: nothing is split over them (yet)
        self.mesh_shape = tuple(n if axes is None or a in axes else 1
                                for a, n in enumerate(mesh.shape))
        self.hint = hint
        self.allow = allow
        self.repeats = repeats or {}  # entry instruction name -> executions per step
        self.costs = costs
        self.out = ShardingGraph(module, mesh, self.model, StrategyGraph(budget=budget), costs)
        self.out.reduced_once = reduced_once(module, accumulations or {}, self.repeats)
        self.graph = self.out.graph
        self.position = 0
        self.birth: dict[int, int] = {}  # id(value) -> position
        self.death: dict[int, int] = {}
        self.live_values: dict[int, Value] = {}
        self._reshard_cache: dict = {}
        self._matrix_cache: dict = {}
        self._transparent_done: set = set()  # (id(operand), node, required, mult) priced
        self.values = self.out.values  # one environment: instructions are unique objects
        self.users = {i: u for c in module.computations for i, u in c.users().items()}

    # ---- costs ---------------------------------------------------------------------------
    def strategy_seconds(self, instr: Instruction, st: Strategy) -> float:
        return strategy_seconds(self.out, instr, st)

    def reshard_seconds(self, shape: Shape, src: Sharding, dst: Sharding) -> float:
        key = (shape.dims, shape.element_bits, src, dst)
        t = self._reshard_cache.get(key)
        if t is None:
            t = sum(c.seconds(self.model)
                    for c in reshard(shape.dims, shape.element_bits, src, dst, self.mesh_shape))
            self._reshard_cache[key] = t
        return t

    def reshard_matrix(self, shape: Shape, srcs: list[Sharding], dsts: list[Sharding]
                       ) -> np.ndarray:
        """Seconds of resharding from each of `srcs` to each of `dsts` (read-only: cached, as
        the identical layers of a deep model ask for the same matrices again and again)."""
        key = (shape.dims, shape.element_bits, tuple(srcs), tuple(dsts))
        matrix = self._matrix_cache.get(key)
        if matrix is None:
            src_ids, distinct_srcs = _index(srcs)
            dst_ids, distinct_dsts = _index(dsts)
            table = np.array([[self.reshard_seconds(shape, a, b) if a != b else 0.0
                               for b in distinct_dsts] for a in distinct_srcs])
            matrix = self._matrix_cache[key] = table[np.ix_(src_ids, dst_ids)]
            matrix.flags.writeable = False
        return matrix

    # ---- values ---------------------------------------------------------------------------
    def new_value(self, node, shardings, instr, leaf, shape) -> Value:
        v = Value(node, shardings, shape, instr, leaf)
        self.out.values[(instr, leaf)] = v
        if self.materialized(instr):
            self.birth[id(v)] = self.position
            self.death[id(v)] = self.position
            self.live_values[id(v)] = v
        return v

    def materialized(self, instr: Instruction) -> bool:
        """Whether XLA keeps this value in a buffer of its own: results of heavy ops, and of
        any op with a user it cannot fuse into (loop fusion absorbs elementwise chains)."""
        if instr.opcode in MATERIALIZED:
            return True
        if instr.opcode in ("tuple", "get-tuple-element"):
            return False
        users = self.users.get(instr, ())
        return not users or any(u.opcode not in LOOP_FUSIBLE for u in users) or len(users) > 1

    def touch(self, v: Value) -> None:
        if id(v) in self.death:
            self.death[id(v)] = self.position

    # ---- computations ----------------------------------------------------------------------
    def build(self) -> ShardingGraph:
        module = self.out.module
        for instr in module.instructions():
            if instr.opcode in COLLECTIVE_OPS:
                raise UserError(f"instruction '{instr.name}' is an {instr.opcode} collective: "
                                f"the module is already partitioned; alpac needs the module "
                                f"before SPMD partitioning")
            if instr.opcode in UNSUPPORTED_OPS:
                raise UserError(f"instruction '{instr.name}' ({instr.opcode}) is "
                                f"{UNSUPPORTED_OPS[instr.opcode]}")
            if instr.opcode == "rng-bit-generator" and instr.operands[0].shape.is_tuple:
                raise UserError(f"instruction '{instr.name}' is an rng-bit-generator whose state "
                                f"is a tuple; XLA (StableHLO) needs an array state, so the "
                                f"module cannot be compiled")
            target = instr.custom_call_target if instr.opcode == "custom-call" else None
            if target in ("SPMDFullToShardShape", "SPMDShardToFullShape"):
                raise UserError(f"instruction '{instr.name}' is a custom-call {target} "
                                f"(manual partitioning, shard_map); alpac cannot plan "
                                f"manually partitioned regions")

        for p in module.entry.parameters:
            for idx, shape in p.shape.leaves():
                strategies = self.hinted(p, [
                    Strategy(str(s), (s,), (), s.num_tiles(self.mesh_shape))
                    for s in array_shardings(shape.dims, self.mesh_shape)], idx)
                node = self.add_node(p, strategies, 1.0)
                if node is not None and p.name in self.received:
                    self.out.receiving[node] = np.array([
                        receive_seconds(self.model, self.received[p.name], st.outputs[0])
                        for st in strategies])
                    self.graph.node_costs[node] = self.graph.node_costs[node] \
                        + self.out.receiving[node]
                self.values[(p, idx)] = self.new_value(
                    node, [st.outputs[0] for st in strategies], p, idx, shape)
                if not p.shape.is_tuple:
                    self.out.plans[p] = InstrPlan(node, strategies, 1.0)
        self.walk(module.entry, 1.0)
        self.outputs(module)
        self.position += 1
        if self.stage_memory is None:
            self.graph.memory_points.extend(liveness_points(
                list(self.live_values.values()), self.birth, self.death, self.mesh_shape))
        else:
            self.graph.memory_points.append(stage_point(
                self.values, module.entry.parameters, self.stage_memory, self.mesh_shape))
        return self.out

    def hinted(self, instr: Instruction, strategies: list[Strategy], idx=(),
               filtered: bool = True) -> list[Strategy]:
        """Only the strategies that agree with an earlier round's choice on its axes, and that
        the caller's `allow(instr, idx, strategy)` accepts (when one is given and
        `filtered`)."""
        if self.allow is not None and filtered:
            strategies = [st for st in strategies if self.allow(instr, idx, st)] or strategies
        if self.hint is None:
            return strategies
        wanted = self.hint.get(instr, idx)
        if wanted is None:
            return strategies
        keep = [st for st in strategies if self.hint.agrees(st, wanted)]
        return keep or strategies

    def add_node(self, instr: Instruction, strategies: list[Strategy], mult: float) -> int | None:
        if len(strategies) == 1:
            self.out.plans.setdefault(instr, InstrPlan(None, strategies, mult))
            self.graph.constant += mult * self.strategy_seconds(instr, strategies[0])
            return None
        node = self.graph.add_node([mult * self.strategy_seconds(instr, st)
                                    for st in strategies])
        self.out.node_instr.append(instr)
        return node

    def walk(self, comp: Computation, mult: float) -> None:
        for instr in comp.instructions:
            if instr.opcode == "parameter":
                continue  # bound by the caller
            self.position += 1
            self.instruction(instr, mult * self.repeats.get(instr.name, 1.0)
                             if comp.is_entry else mult)

    def instruction(self, instr: Instruction, mult: float) -> None:
        op = instr.opcode
        if is_transparent(instr):
            return
        if op == "tuple":
            for k, o in enumerate(instr.operands):
                for idx, _ in o.shape.leaves():
                    self.values[(instr, (k,) + idx)] = self.leaf(o, idx)
            return
        if op == "get-tuple-element":
            src = instr.operands[0]
            for idx, _ in instr.shape.leaves():
                self.values[(instr, idx)] = self.leaf(src, (instr.tuple_index,) + idx)
            return
        if op == "opt-barrier" and instr.operands and instr.operands[0].shape.is_tuple:
            # a barrier (rematerialization) hands its tuple on as it is: every leaf keeps the
            # sharding it has, as XLA keeps it (a replicated barrier would gather each one)
            src = instr.operands[0]
            for idx, _ in instr.shape.leaves():
                self.values[(instr, idx)] = self.leaf(src, idx)
            return
        if op == "while":
            self.while_loop(instr, mult)
            return
        if op == "conditional":
            self.conditional(instr, mult)
            return
        base = followed_operand(instr, is_transparent)
        strategies = self.following(instr, base)
        if strategies is not None:
            node = self.values[(instr.operands[base], ())].node
            seconds = np.array([mult * self.strategy_seconds(instr, st) for st in strategies])
            if node is not None:
                self.graph.node_costs[node] = self.graph.node_costs[node] + seconds
            else:
                self.graph.constant += float(seconds[0])
            plan = InstrPlan(node, strategies, mult)
        else:
            detached = base is not None and (instr.operands[base], ()) in self.values
            strategies = self.hinted(instr, self.source_choices(instr, base),
                                     filtered=not detached)
            if not strategies:
                strategies = [replicated_strategy(instr)]
            plan = InstrPlan(self.add_node(instr, strategies, mult), strategies, mult)
        self.out.plans[instr] = plan
        self.connect(instr, plan)
        for k, (idx, shape) in enumerate(instr.shape.leaves()):
            self.values[(instr, idx)] = self.new_value(
                plan.node, [st.outputs[k] for st in plan.strategies], instr, idx, shape)

    def following(self, instr: Instruction, base: int | None) -> list[Strategy] | None:
        """The strategies of a follower, one per sharding of the operand it follows; None
        for a source, or for a follower that the filter forbids every one of them. Such a
        follower is detached: it may take any sharding, its operand's or (resharding the
        operand once) another. A stage's ILP meets one at a seam between layers: the
        follower hinted by its layer's ILP, its operand by the neighbour's; following would
        pass the neighbour's sharding on, and each of its users would reshard (GPT-760M on
        two V100s: 206 all-to-alls, 1.8% of the step). Forced splits of the weight update
        meet another: a weight's convert hinted replicated when the weight must be split."""
        v = None if base is None else self.values.get((instr.operands[base], ()))
        if v is None:
            return None
        strategies = [follow(instr, base, s, self.mesh_shape) for s in v.shardings]
        if self.allow is not None and not any(self.allow(instr, (), st) for st in strategies):
            return None
        return strategies

    def source_choices(self, instr: Instruction, base: int | None) -> list[Strategy]:
        """The strategies of an instruction that follows no priced value. One that would
        follow an operand but does not (a transparent operand, made from constants in any
        sharding for free: a slice of a large mask need not be replicated; or a follower the
        filter detached, see `following`) may take any sharding of that operand."""
        if base is not None:
            shardings = array_shardings(instr.operands[base].shape.dims, self.mesh_shape)
            unique = {}
            for s in shardings:
                st = follow(instr, base, s, self.mesh_shape)
                unique.setdefault((st.outputs, st.inputs), st)
            return list(unique.values())
        if instr.opcode == "custom-call":
            return rule_strategies(instr, self.mesh_shape)
        return source_strategies(instr, self.mesh_shape)

    def leaf(self, instr: Instruction, idx: tuple) -> Value:
        v = self.values.get((instr, idx))
        if v is None:  # a transparent value put in a tuple (a loop's zero-initialised state)
            shape = instr.shape.subshape(idx)
            if instr.shape.is_tuple or shape.rank == 0:
                v = Value(None, [Sharding.replicated(shape.rank)], shape, instr, idx)
                self.values[(instr, idx)] = v
                return v
            strategies = self.hinted(instr, [
                Strategy(str(s), (s,), (), s.num_tiles(self.mesh_shape))
                for s in array_shardings(shape.dims, self.mesh_shape)])
            node = self.add_node(instr, strategies, 1.0)
            self.out.plans[instr] = InstrPlan(node, strategies, 1.0)
            v = self.new_value(node, [st.outputs[0] for st in strategies], instr, idx, shape)
        return v

    # ---- operands and edges ---------------------------------------------------------------
    def connect(self, instr: Instruction, plan: InstrPlan) -> None:
        for k, operand in enumerate(instr.operands):
            if operand.shape.is_tuple:
                continue
            required = [st.inputs[k] for st in plan.strategies]
            self.require(operand, required, plan.node, plan.multiplier, instr, k)

    def require(self, operand: Instruction, required: list[Sharding], node: int | None,
                mult: float, user: Instruction, k: int) -> None:
        """Price giving `operand` the sharding `required[i]` for strategy i of `node`."""
        if is_transparent(operand):
            self.out.uses.append(Use(None, user, k, (), node, required, mult))
            # a transparent value is built once per sharding; reached again (a DAG of
            # constant arithmetic, e.g. an RNG's bit mixing), it is already priced
            key = (id(operand), node, tuple(required), mult)
            if key in self._transparent_done:
                return
            self._transparent_done.add(key)
            needs = [transparent_operand_needs(operand, r, self.mesh_shape) for r in required]
            for j, inner in enumerate(operand.operands):
                self.require(inner, [n[j] for n in needs], node, mult, operand, j)
            return
        v = self.values[(operand, ())]
        self.out.uses.append(Use(v, user, k, (), node, required, mult))
        self.flow(v, required, node, mult)

    def flow(self, v: Value, required: list[Sharding], node: int | None, mult: float) -> None:
        """Edge (or node cost) for resharding value `v` into `required[i]`."""
        self.touch(v)
        if v.node is None and node is None:
            if v.shardings[0] != required[0]:
                self.graph.constant += mult * self.reshard_seconds(v.shape, v.shardings[0],
                                                                   required[0])
            return
        matrix = mult * self.reshard_matrix(v.shape, v.shardings, required)
        if v.node is None:
            self.graph.node_costs[node] = self.graph.node_costs[node] + matrix[0]
        elif node is None:
            self.graph.node_costs[v.node] = self.graph.node_costs[v.node] + matrix[:, 0]
        else:
            self.graph.add_edge(v.node, node, matrix)

    # ---- control flow -----------------------------------------------------------------------
    def while_loop(self, instr: Instruction, mult: float) -> None:
        init = instr.operands[0]
        trip = self.costs.trip_counts.get(instr, 1) if self.costs is not None else 1
        state = {idx: self.leaf(init, idx) for idx, _ in init.shape.leaves()}
        for v in state.values():
            self.touch(v)
        inner = mult * trip
        for comp in (instr.called("condition"), instr.called("body")):
            param = comp.parameters[0]
            for idx, v in state.items():
                self.values[(param, idx)] = v
            self.walk(comp, inner)
            if comp is instr.called("body"):
                root = comp.root
                for idx, v in state.items():
                    out = self.leaf(root, idx)
                    self.loop_back(out, v, inner, root, idx)
        for idx, v in state.items():
            self.values[(instr, idx)] = v
        self.out.plans[instr] = InstrPlan(None, [], mult)

    def loop_back(self, out: Value, state: Value, mult: float, user: Instruction, idx) -> None:
        """`out` must arrive in `state`'s sharding: a loop body's result at the back edge (every
        iteration), another branch's result, or an output aliased with a parameter."""
        self.out.uses.append(Use(out, user, None, idx, state.node, state.shardings, mult))
        self.flow(out, state.shardings, state.node, mult)

    def conditional(self, instr: Instruction, mult: float) -> None:
        branches = instr.called_computations
        outputs = None
        for b, comp in enumerate(branches):
            operand = instr.operands[b + 1]
            if comp.parameters:
                param = comp.parameters[0]
                for idx, _ in operand.shape.leaves():
                    self.values[(param, idx)] = self.leaf(operand, idx)
                    self.touch(self.values[(param, idx)])
            self.walk(comp, mult)
            leaves = {idx: self.leaf(comp.root, idx) for idx, _ in comp.root.shape.leaves()}
            if outputs is None:
                outputs = leaves
            else:
                for idx, v in leaves.items():
                    self.loop_back(v, outputs[idx], mult, comp.root, idx)
        for idx, v in outputs.items():
            self.values[(instr, idx)] = v
        self.out.plans[instr] = InstrPlan(None, [], mult)

    # ---- outputs and memory -----------------------------------------------------------------
    def outputs(self, module: Module) -> None:
        root = module.entry.root
        aliases = {a.output_index: a for a in module.input_output_alias}
        params = module.entry.parameters
        for idx, shape in root.shape.leaves():
            v = self.leaf(root, idx)
            self.touch(v)
            self.death[id(v)] = 10 ** 9  # outputs live to the end
            alias = aliases.get(idx)
            if alias is not None:
                pv = self.values[(params[alias.parameter_number], alias.parameter_index)]
                self.loop_back(v, pv, 1.0, root, idx)
                self.out.outputs[idx] = pv
            else:
                self.out.outputs[idx] = v
        donated = {a.parameter_number for a in module.input_output_alias} | {
            p for p, _ in module.buffer_donors}
        for p in params:
            if p.parameter_number not in donated:
                for idx, _ in p.shape.leaves():
                    self.death[id(self.values[(p, idx)])] = 10 ** 9


def strategy_seconds(sg: ShardingGraph, instr: Instruction, st: Strategy) -> float:
    """One run of `instr` at strategy `st`: its share of the work (a roofline of FLOPs and
    bytes over the ways the work is split) plus the collectives it performs itself."""
    cost = sg.costs[instr] if instr in sg.costs else None
    compute = 0.0
    if cost is not None:
        dtype = instr.shape.dtype if not instr.shape.is_tuple else "f32"
        share = sg.kernel_share(instr)
        if share is not None:
            compute = sg.model.compute(cost.flops / st.divisor, share.own / st.divisor, dtype,
                                       share.kind, share.kernel / st.divisor,
                                       cost.transcendentals / st.divisor)
        else:
            compute = sg.model.compute(cost.flops / st.divisor, cost.bytes_accessed / st.divisor,
                                       dtype, _work_kind(instr),
                                       matrices=_transposed_matrices(instr, st, sg.mesh.shape))
    once = sg.reduced_once.get(instr, 1.0)
    return compute + sum(c.seconds(sg.model) * (once if c.kind == "all-reduce" else 1.0)
                         for c in st.collectives)


def _transposed_matrices(instr: Instruction, st: Strategy, mesh_shape) -> int:
    """A device's matrices of a batched dot whose lhs holds them transposed, at strategy `st`
    (`transposed_batch`; 0 for other instructions)."""
    batch = transposed_batch(instr)
    if not batch:
        return 0
    return math.prod(st.outputs[0].tile_dims(instr.shape.dims, mesh_shape)[:batch])


def _work_kind(instr: Instruction) -> str:
    """Which measured table prices an instruction's work on a calibrated cluster."""
    if instr.opcode in CONTRACTIONS:
        return "dot"
    return "reduce" if instr.opcode in REDUCTIONS else "elementwise"


def _index(items: list) -> tuple[np.ndarray, list]:
    """Positions of each item in the list of distinct items (first-seen order)."""
    first: dict = {}
    ids = [first.setdefault(x, len(first)) for x in items]
    return np.array(ids, dtype=np.int64), list(first)


@dataclass
class Hint:
    """An earlier round's choices (on `axes`): the strategy of every source instruction."""

    axes: tuple[int, ...]
    chosen: dict[tuple[Instruction, tuple], Strategy]

    @staticmethod
    def from_solution(sg: ShardingGraph, choice: list[int], axes) -> "Hint":
        chosen = {}
        for instr in sg.node_instr:  # the sources (followers take their node's choice)
            if instr.opcode != "parameter":
                chosen[(instr, ())] = sg.plans[instr].strategy(choice)
        for (instr, idx), v in sg.values.items():
            if instr.opcode == "parameter" and instr.parent is sg.module.entry:
                s = v.sharding(choice)
                chosen[(instr, idx)] = Strategy(str(s), (s,), ())
        return Hint(tuple(axes), chosen)

    def get(self, instr: Instruction, idx=()) -> Strategy | None:
        return self.chosen.get((instr, idx))

    def project(self, s: Sharding | None) -> Sharding | None:
        if s is None:
            return None
        return Sharding(tuple(tuple(a for a in axes if a in self.axes) for axes in s.dim_axes))

    def agrees(self, st: Strategy, wanted: Strategy) -> bool:
        return (tuple(map(self.project, st.outputs)) == wanted.outputs
                and tuple(map(self.project, st.inputs)) == wanted.inputs)


def build_graph(module: Module, mesh: LogicalMesh, cluster, costs: CostTable,
                budget: float | None = None, axes: tuple[int, ...] | None = None,
                hint: Hint | None = None, allow=None,
                repeats: dict[str, float] | None = None,
                memory: StageMemory | None = None,
                accumulations: dict[str, str] | None = None,
                received: dict[str, Receive] | None = None) -> ShardingGraph:
    """The sharding problem of `module` on `mesh`, splitting only over `axes` (default all),
    keeping to `hint` on the axes an earlier round solved, and to the source strategies that
    `allow(instr, leaf index, strategy)` accepts (used to price fixed strategies such as pure
    data parallelism with the same model). `repeats` gives how many times per step an entry
    instruction runs (a pipeline stage runs its forward and backward once per microbatch and
    its update once). `memory`: judge the memory as a pipeline stage's (default: the peak of
    the values live at each point of the program); `accumulations` (alpac.intraop.deferral);
    `received`: the parameters a pipeline stage receives from other meshes (`Receive`)."""
    return _Builder(module, mesh, cluster, costs, budget, axes, hint, allow, repeats,
                    memory, accumulations, received).build()
