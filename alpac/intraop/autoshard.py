"""Intra-operator parallelism: choose a sharding for every instruction of a module on a
logical mesh (strategies -> ILP -> annotated HLO for XLA's SPMD partitioner).

Meshes with up to two axes of size > 1 are solved in one ILP. Larger meshes are solved the
way XLA's auto-sharding does: the two most expensive axes first, then one axis more per
round, each round keeping the choices of the last on the axes it solved (so the answer is
optimal for the last round's restricted problem, and `iterative` says so).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

from alpac.analysis.costmodel import CostModel
from alpac.analysis.costs import CostTable
from alpac.hlo import Module
from alpac.intraop.annotate import write_shardings
from alpac.intraop.builder import Hint, ShardingGraph, build_graph, strategy_seconds
from alpac.intraop.collectives import collectives_of, reshard
from alpac.intraop.combine import savings
from alpac.intraop.deferral import Deferral, collective_index, find_deferrals, undeferred
from alpac.intraop.ilp import solve
from alpac.intraop.memory import StageMemory
from alpac.intraop.problem import Solution
from alpac.plan.mesh import LogicalMesh


@dataclass
class ShardingResult:
    module: Module  # the annotated copy
    graph: ShardingGraph
    solution: Solution
    collectives: list  # (instruction name, Collective, multiplier)
    rounds: list[tuple[int, ...]]  # axes solved in each round
    budget: float | None = None  # bytes per device the plan had to fit
    # accumulated gradients reduced once per step (their all-reduces in `collectives` count
    # once, not once per microbatch)
    deferred: list[Deferral] = dataclasses.field(default_factory=list)

    @property
    def iterative(self) -> bool:
        return len(self.rounds) > 1

    def collective_summary(self) -> dict[str, dict]:
        """kind -> {count, bytes, seconds} as they appear in the module (loop bodies once;
        seconds count every execution), the all-reduces XLA combines priced as combined
        (`combined_savings`)."""
        out: dict[str, dict] = defaultdict(lambda: {"count": 0, "bytes": 0, "seconds": 0.0})
        saved = self.combined_savings()
        for i, (_, c, mult) in enumerate(self.collectives):
            out[c.kind]["count"] += 1
            out[c.kind]["bytes"] += c.nbytes
            out[c.kind]["seconds"] += mult * c.seconds(self.graph.model) - saved.get(i, 0.0)
        return dict(sorted(out.items()))

    def communication_seconds(self) -> float:
        return sum(v["seconds"] for v in self.collective_summary().values())

    def combined_savings(self, group=None) -> dict[int, float]:
        """Index into `collectives` -> what its all-reduce costs less than the ILP prices it,
        where XLA combines it with others (alpac.intraop.combine; per `group` of
        instructions: one module of a pipeline stage; without, the module is one)."""
        if group is None:
            return self._whole_module_savings
        return self._not_deferred(savings(self.collectives, self._instructions, group,
                                          self.graph.model))

    def _not_deferred(self, saved: dict[int, float]) -> dict[int, float]:
        """Combining savings, but of the all-reduces deferred to the update (priced there)."""
        deferred = {collective_index(self.collectives, d) for d in self.deferred}
        return {i: v for i, v in saved.items() if i not in deferred}

    @cached_property
    def _whole_module_savings(self) -> dict[int, float]:
        """`combined_savings` of the module as one (the stage's time, its collectives'
        summary and the plan's communication each ask for it)."""
        return self._not_deferred(savings(self.collectives, self._instructions,
                                          lambda name: None, self.graph.model))

    @cached_property
    def _instructions(self) -> dict:
        """Instruction name -> instruction, in the order the program was walked."""
        return {instr.name: instr for instr in self.graph.plans}

    def seconds(self) -> float:
        """The stage's time as XLA runs it: the ILP's objective without receiving its
        parameters (the plan prices its transfers apart), the all-reduces XLA combines priced
        as combined, those the ILP priced once per step but that run every microbatch (not
        deferred) priced so."""
        return self.solution.objective - self.graph.receive_seconds(self.solution.choice) \
            - sum(self.combined_savings().values()) + sum(self._priced_once().values())

    def _priced_once(self) -> dict[str, float]:
        """What the ILP's objective leaves out of each all-reduce it priced once per step
        (`ShardingGraph.reduced_once`) but that is not deferred: by contraction name, once
        per microbatch but one."""
        deferred = {d.contraction for d in self.deferred}
        sg, out = self.graph, {}
        for instr in sg.reduced_once:
            plan = sg.plans.get(instr)
            if instr in deferred or plan is None or not plan.strategies:
                continue
            st = plan.strategy(self.solution.choice)
            once = sum(c.seconds(sg.model) for c in st.collectives if c.kind == "all-reduce")
            if once:
                out[instr.name] = (plan.multiplier - 1) * once
        return out

    def seconds_by(self, group) -> dict[str, float]:
        """The objective split by `group(instruction name) -> key`: each instruction's work and
        collectives at its chosen strategy, and each resharding of an operand (charged to its
        user), times how often they run."""
        sg, choice = self.graph, self.solution.choice
        out: dict[str, float] = defaultdict(float)
        for instr, plan in sg.plans.items():
            if plan.strategies:
                key = group(instr.name)
                st = plan.strategy(choice)
                out[key] += plan.multiplier * strategy_seconds(sg, instr, st)
        for use in sg.uses:
            if use.value is None:
                continue
            src, dst = use.value.sharding(choice), use.required_sharding(choice)
            if src != dst:
                seconds = sum(c.seconds(sg.model) for c in reshard(
                    use.value.shape.dims, use.value.shape.element_bits, src, dst,
                    tuple(sg.mesh.shape)))
                out[group(use.user.name)] += use.multiplier * seconds
        for i, saved in self.combined_savings(group).items():
            out[group(self.collectives[i][0])] -= saved
        for name, extra in self._priced_once().items():  # reduced every microbatch after all
            out[group(name)] += extra
        for d in self.deferred:  # reduced once, by the update
            once = self.collectives[collective_index(self.collectives, d)][1].seconds(sg.model)
            out[group(d.contraction.name)] -= once
            out[group(d.first_update)] += once
        return dict(out)

    def bytes_by(self, group) -> dict[str, float]:
        """Per-device bytes of the values of each group (`group(instruction name) -> key`,
        None to skip) at their chosen shardings: what a stage keeps for weights, optimizer
        state, accumulators and activations."""
        sg, choice = self.graph, self.solution.choice
        out: dict[str, float] = defaultdict(float)
        mesh_shape = tuple(sg.mesh.shape)
        for (instr, idx), value in sg.values.items():
            if value.producer is not instr or idx != value.leaf:
                continue
            key = group(instr.name)
            if key is not None:
                out[key] += value.sharding(choice).tile_bytes(
                    value.shape.dims, value.shape.element_bits, mesh_shape)
        return dict(out)

    def decisions(self) -> list[dict]:
        """Per instruction, in program order: the sharding chosen, the strategy, and the
        collectives it causes (its own, and resharding its result for its users)."""
        sg, choice = self.graph, self.solution.choice
        mesh_shape = tuple(sg.mesh.shape)
        caused = defaultdict(list)
        for name, c, mult in self.collectives:
            caused[name].append({"kind": c.kind, "axes": list(c.axes), "bytes": c.nbytes,
                                 "seconds": mult * c.seconds(sg.model)})
        rows = []
        for instr, plan in sg.plans.items():  # in the order the program was walked
            value = sg.values.get((instr, ()))
            if not plan.strategies or value is None:
                continue
            s = value.sharding(choice)
            rows.append({"instruction": instr.name, "computation": instr.parent.name,
                         "opcode": instr.opcode, "shape": str(instr.shape.without_layout()),
                         "sharding": str(s), "xla": s.to_xla(mesh_shape),
                         "strategy": plan.strategy(choice).name,
                         "collectives": caused.get(instr.name, [])})
        return rows

def solve_rounds(mesh: LogicalMesh, cluster) -> list[tuple[int, ...]]:
    """Axes to solve per round: all at once for up to two real axes, else the two most
    expensive (slowest link, then largest) first and one more per round."""
    real = [a for a, n in enumerate(mesh.shape) if n > 1]
    if len(real) <= 2:
        return [tuple(real)]
    model = CostModel(cluster, mesh)
    order = sorted(real, key=lambda a: (-model.collective("all-gather", 1 << 20, (a,)),
                                        -mesh.shape[a], a))
    return [tuple(sorted(order[:k])) for k in range(2, len(order) + 1)]


def auto_shard(module: Module, mesh: LogicalMesh, cluster, *, budget: float | None = None,
               time_limit: float = 60.0, gap_limit: float = 1e-4,
               allow=None, repeats: dict[str, float] | None = None,
               annotate: bool = True, reuse: Solution | None = None,
               memory: StageMemory | None = None,
               accumulations: dict[str, str] | None = None,
               received: dict | None = None) -> ShardingResult:
    """Shard a copy of `module` over `mesh`; the input module is left as it is. `allow`
    restricts source strategies (see build_graph); it sees the copy's instructions. Without
    `annotate` the copy keeps no shardings (enough for pricing: the choice is in the
    result). `reuse` is the solution for a module of the same structure (instructions
    matching by position) on a mesh of the same shape and links: taken, not solved again,
    when the graph is the same size. `memory` judges the budget as a pipeline stage's.
    `accumulations` (a pipeline stage's: accumulate instruction -> an update instruction that
    reads it) are reduced once per step where they can be (alpac.intraop.deferral).
    `received` (a pipeline stage's: parameter -> `receiving.Receive`) prices receiving them in
    the objective only: the plan prices its transfers apart."""
    work = module.clone()
    costs = CostTable(work)
    rounds = solve_rounds(mesh, cluster)

    def solved(accumulations, reuse) -> ShardingResult:
        sg, solution = _solve_rounds(work, mesh, cluster, costs, rounds, budget, time_limit,
                                     gap_limit, allow, repeats, memory, accumulations, reuse,
                                     received)
        deferred = find_deferrals(sg, solution.choice, accumulations) if accumulations else []
        collectives = collectives_of(sg, solution.choice)
        for d in deferred:  # once per step
            k = collective_index(collectives, d)
            collectives[k] = (*collectives[k][:2], 1.0)
        return ShardingResult(work, sg, solution, collectives, rounds, deferred=deferred)

    result = solved(accumulations, reuse)
    if failed := undeferred(result.graph, result.deferred, accumulations or {}):
        # the ILP priced their all-reduces once per step for shardings that cannot keep the
        # sum local: solved again with those priced every microbatch, the cheaper plan kept
        retry = solved({a: u for a, u in accumulations.items() if a not in failed}, None)
        if retry.seconds() < result.seconds():
            result = retry
    if annotate:
        write_shardings(result.graph, result.solution.choice, result.deferred)
    return result


def _solve_rounds(work, mesh, cluster, costs, rounds, budget, time_limit, gap_limit, allow,
                  repeats, memory, accumulations, reuse, received):
    """The sharding graph of the last round and its solution (`auto_shard`)."""
    hint = None
    for k, axes in enumerate(rounds):
        last = k == len(rounds) - 1
        partial = 1
        for a in axes:
            partial *= mesh.shape[a]
        round_budget = None if budget is None else budget * mesh.num_devices / partial
        sg = build_graph(work, mesh, cluster, costs, round_budget, axes, hint, allow, repeats,
                         memory, accumulations, received)
        if reuse is not None and len(rounds) == 1 and sg.graph.size == reuse.size_before:
            solution = dataclasses.replace(reuse, objective=sg.graph.objective(reuse.choice),
                                           solve_time=0.0,
                                           peak_memory=sg.graph.peak_memory(reuse.choice))
        else:
            solution = solve(sg.graph, time_limit=time_limit / len(rounds),
                             gap_limit=gap_limit)
        if not last:
            hint = Hint.from_solution(sg, solution.choice, axes)
    return sg, solution
