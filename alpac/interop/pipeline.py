"""From a step split into microbatches and a choice of stages to per-stage modules.

The microbatched step (prologue, per-microbatch module, accumulation, update) is first joined
into one graph whose nodes know their role (prologue, forward, backward, accumulate, apply)
and how often they run per step (the per-microbatch part B times). Each stage then takes its
nodes:

- forward and backward nodes go to the stage of their layer (backward ones to the layer they
  differentiate); the accumulation of a gradient goes with the node that produces it;
- update nodes go where the value they mostly read lives (a parameter's or a gradient's
  stage); the prologue runs on the first stage;
- nodes that depend on nothing placed (weight transposes, constants, the step counter) are
  recomputed in every stage that needs them;
- a value one stage computes and another needs moves between their meshes.

A stage's nodes form one module for the sharding ILP, so a value keeps one sharding across
its forward, backward and update; the sharded module is then cut by role into the modules
the runtime runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alpac.analysis.step.wiring import MicrobatchedStep, SinkKind, SourceKind
from alpac.errors import UserError
from alpac.hlo.extract import callee_order, extract
from alpac.hlo.ir import Computation, Instruction, Module, UniqueNames
from alpac.hlo.opcodes import GENERATORS
from alpac.hlo.shape import Shape
from alpac.interop.layers import layer_owned
from alpac.interop.remat import remat_split
from alpac.plan.program import Role, input_value

PER_MICROBATCH = frozenset({Role.FORWARD, Role.BACKWARD, Role.ACCUMULATE})


@dataclass
class StepGraph:
    """The whole step as one module; `values` names what each parameter stands for."""

    module: Module
    role: dict[str, Role]  # node name -> prologue | forward | backward | accumulate | apply
    param_values: dict[str, tuple[str, str, int | None]]  # param name -> (value, scope, batch dim)
    outputs: list[tuple[list[int], Instruction, int | None]]  # (output index, node, concat dim)
    accumulators: dict[str, str]  # accumulate node name -> accumulator value name
    aliases: list = field(default_factory=list)  # the source module's input_output_alias
    layer_of: dict[str, int] = field(default_factory=dict)

    def value_of(self, instr: Instruction) -> str:
        """The program value an instruction of this graph defines."""
        if instr.opcode == "parameter":
            return self.param_values[instr.name][0]
        return self.accumulators.get(instr.name) or f"v:{instr.name}"

    def layer_owned(self) -> set[str]:
        """Names of the nodes layers own (`alpac.interop.layers.layer_owned`)."""
        owned = layer_owned(self.module.entry,
                            lambda p: self.param_values[p.name][1] == "microbatch")
        return {x.name for x in owned if x.name in self.role}

    def scope_of(self, instr: Instruction) -> str:
        if instr.opcode == "parameter":
            return self.param_values[instr.name][1]
        if instr.name in self.accumulators:
            return "step"
        return "microbatch" if self.role.get(instr.name) in PER_MICROBATCH else "step"


def step_graph(step: MicrobatchedStep, forward_names: set[str], layer_of: dict[str, int],
               aliases=()) -> StepGraph:
    """Join the prologue, the per-microbatch module, the accumulation and the update."""
    comp = Computation("step", is_entry=True)
    unique = UniqueNames().fresh
    role: dict[str, Role] = {}
    param_values: dict[str, tuple[str, str, int | None]] = {}
    by_value: dict[str, Instruction] = {}

    def param(value: str, shape: Shape, scope: str, dim=None) -> Instruction:
        if value not in by_value:
            p = comp.append(Instruction(unique(value), "parameter", shape, (), {},
                                        str(len(by_value))))
            by_value[value] = p
            param_values[p.name] = (value, scope, dim)
        return by_value[value]

    def copy_part(part: Module, sources, resolve, node_role) -> dict[int, Instruction]:
        mapping: dict[int, Instruction] = {}
        for p, src in zip(part.entry.parameters, sources):
            mapping[id(p)] = resolve(src, p.shape)
        for x in part.entry.instructions:
            if x.opcode == "parameter" or x is part.entry.root:
                continue
            clone = comp.append(Instruction(unique(x.name), x.opcode, x.shape,
                                            [mapping[id(o)] for o in x.operands],
                                            dict(x.attrs), x.payload, x.line))
            role[clone.name] = node_role(x)
            mapping[id(x)] = clone
        return mapping

    prologue_out: list[Instruction] = []
    accumulated: dict[int, Instruction] = {}
    concatenated: dict[int, tuple[Instruction, int]] = {}

    def resolve(src, shape: Shape) -> Instruction:
        if src.kind == SourceKind.PARAM:
            return param(input_value(src.index), shape, "step")
        if src.kind == SourceKind.BATCH_SLICE:  # a microbatch's slice: not the whole batch input
            return param(f"{input_value(src.index)}.mb", shape, "microbatch", src.dim)
        if src.kind == SourceKind.MICROBATCH_INDEX:
            return param("microbatch_index", shape, "microbatch")
        if src.kind == SourceKind.PROLOGUE:
            return prologue_out[src.index]
        if src.kind == SourceKind.ACCUMULATED:
            return accumulated[src.index]
        if src.kind == SourceKind.CONCATENATED:
            raise UserError("a pipelined step whose update reads a forward output over all "
                            "microbatches is not supported")
        raise AssertionError(src.kind)

    if step.prologue is not None:
        mapping = copy_part(step.prologue, step.prologue_inputs, resolve,
                            lambda x: Role.PROLOGUE)
        prologue_out = [mapping[id(x)] for x in _elements(step.prologue.entry)]
    mapping = copy_part(step.microbatch, step.microbatch_inputs, resolve,
                        lambda x: Role.FORWARD if x.name in forward_names else Role.BACKWARD)
    accumulators: dict[str, str] = {}
    for x, sink in zip(_elements(step.microbatch.entry), step.microbatch_outputs):
        value = mapping[id(x)]
        if sink.kind == SinkKind.ACCUMULATE:
            name = f"acc{sink.index}"
            acc_in = param(name, x.shape, "step")
            add = comp.append(Instruction(unique(f"accumulate{sink.index}"), "add", x.shape,
                                          [acc_in, value]))
            role[add.name] = Role.ACCUMULATE
            accumulators[add.name] = name
            accumulated[sink.index] = add
        else:
            concatenated[sink.index] = (value, sink.dim)
    ep = copy_part(step.epilogue, step.epilogue_inputs, resolve, lambda x: Role.APPLY)
    outputs = []
    root = step.epilogue.entry.root
    leaves = root.operands if root.opcode == "tuple" else [root]
    source_of = dict(zip(step.epilogue.entry.parameters, step.epilogue_inputs))
    for k, x in enumerate(leaves):
        src = source_of.get(x)
        if src is not None and src.kind == SourceKind.CONCATENATED:
            node, dim = concatenated[src.index]
            outputs.append(([k], node, dim))
        else:
            outputs.append(([k], ep[id(x)], None))
    keep = [node for _, node, _ in outputs] + list(accumulated.values())
    comp.append(Instruction(unique("step.outputs"), "tuple",
                            Shape.tuple_of(n.shape for n in keep), keep))
    comp.root = comp.instructions[-1]
    module = Module("step", callee_order(comp) + [comp], comp)
    graph = StepGraph(module, role, param_values, outputs, accumulators, list(aliases))
    graph.layer_of = {n: layer_of[n] for n in role if n in layer_of}
    return graph


def _elements(comp: Computation) -> list[Instruction]:
    root = comp.root
    return list(root.operands) if root.opcode == "tuple" else [root]


# ---- stages -------------------------------------------------------------------------------------

@dataclass
class StageModule:
    """One stage's nodes as a module for the ILP, with how it connects to the program."""

    index: int
    module: Module
    repeats: dict[str, float]  # node name -> runs per step
    role: dict[str, Role]  # node name -> role, for nodes computed in one role only
    param_values: list[str]  # per parameter: the program value it takes
    output_values: list[str]  # per root-tuple element: the program value it defines
    output_roles: list[Role]  # per root-tuple element: the role module that gives it
    scope: dict[str, str]  # program value -> step | microbatch
    layer_of: dict[str, int] = field(default_factory=dict)  # node name -> layer
    remat: dict = field(default_factory=dict)  # layer -> Remat (missing: keep everything)
    # accumulate node -> an update node of this stage reading it, where no other stage reads
    # the accumulated gradient: those the ILP may reduce once per step (intraop.deferral)
    accumulations: dict[str, str] = field(default_factory=dict)


# Made from at most a scalar: each stage that reads one makes its own rather than receive a
# weight-sized array every step (XLA shares one broadcast of Adam's β among all weights of a
# shape, whichever layers they belong to).
_MADE_LOCALLY = GENERATORS


def assign_stages(graph: StepGraph, stage_of_layer: list[int]
                  ) -> tuple[dict[str, set[int]], set[str]]:
    """node name -> the stages that compute it; and the names of the nodes placed in one
    stage (the others are recomputed wherever they are needed)."""
    entry = graph.module.entry
    where: dict[str, set[int]] = {}
    placed: dict[str, int] = {}
    owned = graph.layer_owned()
    for x in entry.instructions:
        role = graph.role.get(x.name)
        if x.opcode == "tuple":
            continue  # an aggregate: made wherever it is used
        if x.opcode == "get-tuple-element" and x.operands[0].name in placed:
            placed[x.name] = placed[x.operands[0].name]  # stays with its tuple
        elif role in (Role.FORWARD, Role.BACKWARD) and x.name in graph.layer_of and \
                x.name in owned:
            placed[x.name] = stage_of_layer[graph.layer_of[x.name]]
        elif role == Role.PROLOGUE:
            placed[x.name] = 0
        elif role == Role.ACCUMULATE:
            producer = x.operands[1]
            placed[x.name] = placed.get(producer.name, 0)
    _split_accumulations(graph, placed)
    # parameters live with the first stage whose placed node reads them
    param_stage: dict[str, int] = {}
    for x in entry.instructions:
        if x.name in placed:
            for o in x.operands:
                if o.opcode == "parameter":
                    param_stage[o.name] = min(param_stage.get(o.name, placed[x.name]),
                                              placed[x.name])
    # update nodes: each output lives with the parameter it becomes (or, for outputs with no
    # such parameter, where the heaviest value it reads lives); every update node goes to
    # the earliest stage whose outputs need it, so update values only move to later stages
    located = {**placed, **param_stage}
    for x in entry.instructions:
        if graph.role.get(x.name) == Role.APPLY:
            reads = [o for o in x.operands if o.name in located]
            if reads:
                located[x.name] = located[max(reads, key=lambda o: o.shape.byte_size).name]
    aliases = {tuple(a.output_index): a.parameter_number for a in graph.aliases}
    param_of_value = {value: name for name, (value, _, _) in graph.param_values.items()}
    demand: dict[str, int] = {}
    for index, node, _ in graph.outputs:
        param = aliases.get(tuple(index))
        home = param_stage.get(param_of_value.get(input_value(param))) if param is not None \
            else None
        stage = home if home is not None else located.get(node.name, 0)
        demand[node.name] = min(demand.get(node.name, stage), stage)
    for x in reversed(entry.instructions):
        if x.name in demand:
            for o in x.operands:
                if graph.role.get(o.name) == Role.APPLY:
                    demand[o.name] = min(demand.get(o.name, demand[x.name]), demand[x.name])
    local = _step_scalars(graph)
    for x in entry.instructions:
        if graph.role.get(x.name) == Role.APPLY and x.name in demand and \
                x.opcode not in _MADE_LOCALLY and x.name not in local:
            placed[x.name] = demand[x.name]
    _finish_where_accumulated(graph, placed)
    _check_order(entry, graph, placed)

    def need(x: Instruction, s: int) -> None:
        if x.opcode == "parameter" or s in where.get(x.name, ()):
            return
        if x.name in placed and placed[x.name] != s:
            return  # computed in its own stage, moved here
        where.setdefault(x.name, set()).add(s)
        for o in x.operands:
            need(o, s)

    for x in entry.instructions:
        if x.name in placed:
            need(x, placed[x.name])
    for _, node, _ in graph.outputs:
        if node.name not in where and node.opcode != "parameter":
            need(node, 0)
    return where, set(placed)


def _step_scalars(graph: StepGraph) -> set[str]:
    """Update nodes that compute a scalar from scalar inputs of the step alone (Adam's bias
    corrections 1 - β^t from the step count): every stage whose update needs one computes it,
    rather than wait for the stage that would, and receive it, every step."""
    out: set[str] = set()
    for x in graph.module.entry.instructions:
        if graph.role.get(x.name) != Role.APPLY or x.shape.is_tuple or x.shape.dims:
            continue
        if all(o.name in out or o.opcode in _MADE_LOCALLY or (
                o.opcode == "parameter" and not o.shape.is_tuple and not o.shape.dims
                and graph.param_values[o.name][1] == "step")
               for o in x.operands):
            out.add(x.name)
    return out


def _finish_where_accumulated(graph: StepGraph, placed: dict[str, int]) -> None:
    """An update's copy of a gradient accumulated in an earlier stage (`_split_accumulations`)
    runs in that stage's update: the stage then finishes the sum itself (reducing it once per
    step, alpac.intraop.deferral) before it moves, as Megatron all-reduces a tied embedding's
    gradient over data parallelism and then between the first and last stages. A sum made in
    a later stage still moves unreduced: updates run in stage order, none waits for a later
    one's."""
    for x in graph.module.entry.instructions:
        if x.opcode == "copy" and x.name in placed and graph.role.get(x.name) == Role.APPLY:
            accumulated = x.operands[0]
            if graph.role.get(accumulated.name) == Role.ACCUMULATE and \
                    placed[accumulated.name] < placed[x.name]:
                placed[x.name] = placed[accumulated.name]


def _split_accumulations(graph: StepGraph, placed: dict[str, int]) -> None:
    """A gradient summed from contributions that different stages compute (a weight used in
    two stages, such as a tied embedding) gets one accumulator per contribution, added once
    per step by the update, instead of moving a contribution every microbatch. The update
    adds copies of the two sums, each made where its sum is (`_finish_where_accumulated`)."""
    entry = graph.module.entry
    users = entry.users()
    names = UniqueNames(i.name for i in entry.instructions)
    for acc in list(entry.instructions):
        if acc.name not in graph.accumulators or acc.opcode != "add":
            continue
        acc_in, grad = acc.operands
        if grad.opcode != "add" or len(users[grad]) != 1:
            continue
        a, b = grad.operands
        if placed.get(a.name) is None or placed.get(b.name) is None or \
                placed[a.name] == placed[b.name]:
            continue
        value = graph.accumulators[acc.name]
        second_in = Instruction(names.fresh(f"{acc_in.name}.part"), "parameter", acc.shape,
                                (), {}, str(len(entry.parameters)))
        entry.instructions.insert(0, second_in)
        second_in.parent = entry
        graph.param_values[second_in.name] = (f"{value}.part", "step", None)
        second = Instruction(names.fresh(f"{acc.name}.part"), "add", acc.shape, [second_in, b])
        sums = [Instruction(names.fresh(f"{x.name}.sum"), "copy", acc.shape, [x])
                for x in (acc, second)]
        total = Instruction(names.fresh(f"{acc.name}.total"), "add", acc.shape, sums)
        position = entry.instructions.index(acc)
        entry.instructions[position + 1:position + 1] = [second, *sums, total]
        for x in (second, *sums, total):
            x.parent = entry
        graph.role.update({x.name: Role.APPLY for x in (*sums, total)})
        acc.operands = [acc_in, a]
        for u in users[acc]:
            if u is not entry.root:
                u.operands = [total if o is acc else o for o in u.operands]
        entry.root.operands.append(second)
        entry.root.shape = Shape.tuple_of(o.shape for o in entry.root.operands)
        graph.role[second.name] = Role.ACCUMULATE
        graph.accumulators[second.name] = f"{value}.part"
        placed[acc.name] = placed[a.name]
        placed[second.name] = placed[b.name]
        entry.remove_dead()


def _check_order(entry: Computation, graph: StepGraph, placed: dict[str, int]) -> None:
    """Values may flow forward through the forward stages, from any forward to any backward,
    and backward through the backward stages; anything else would deadlock the pipeline."""
    for x in entry.instructions:
        if x.name not in placed:
            continue
        role, s = graph.role.get(x.name), placed[x.name]
        for o in x.operands:
            if o.name not in placed:
                continue
            orole, t = graph.role.get(o.name), placed[o.name]
            bad = (orole == Role.FORWARD and role == Role.FORWARD and t > s) or \
                  (orole in (Role.BACKWARD, Role.ACCUMULATE) and role == Role.BACKWARD
                   and t < s) or \
                  (orole in (Role.BACKWARD, Role.ACCUMULATE) and role == Role.FORWARD)
            if bad:
                raise UserError(f"this stage choice would need {o.name} ({orole}, stage {t}) "
                                f"in {x.name} ({role}, stage {s}) before it exists")


def stage_modules(graph: StepGraph, where: dict[str, set[int]], placed: set[str],
                  num_stages: int, num_micro_batches: int,
                  only: list[int] | None = None, remat: list[dict] | None = None
                  ) -> list[StageModule]:
    """The module of every stage (or of the stages in `only`); `remat`: per stage, layer ->
    Remat."""
    entry = graph.module.entry
    users: dict[str, set[int]] = {}  # node name -> stages that read it
    held: dict[int, list[Instruction]] = {}  # stage -> its instructions, in order
    for x in entry.instructions:
        for s in where.get(x.name, ()):
            held.setdefault(s, []).append(x)
            for o in x.operands:
                users.setdefault(o.name, set()).add(s)
    program_outputs = {node.name for _, node, _ in graph.outputs}
    out = []
    for s in (range(num_stages) if only is None else only):
        members = held.get(s, [])
        if not members:
            raise UserError(f"stage {s} would compute nothing: fewer layers than stages")
        given = [x for x in members
                 if (users.get(x.name, set()) - where[x.name])  # read by another stage
                 or (x.name in program_outputs and min(where[x.name]) == s)
                 or x.name in graph.accumulators]
        module, params, outputs = extract(f"stage{s}", members, given, keep_attrs=False)
        repeats = {x.name: (num_micro_batches if graph.role.get(x.name) in PER_MICROBATCH
                            else 1.0) for x in members}
        scope = {graph.value_of(x): graph.scope_of(x) for x in params + outputs}
        out.append(StageModule(s, module, repeats,
                               {x.name: _module_role(graph.role[x.name]) for x in members
                                if x.name in placed},
                               [graph.value_of(p) for p in params],
                               [graph.value_of(x) for x in outputs],
                               [_module_role(graph.role[x.name]) for x in outputs], scope,
                               {x.name: graph.layer_of[x.name] for x in members
                                if x.name in graph.layer_of},
                               dict(remat[s]) if remat else {},
                               _accumulations(graph, module, members, users, where)))
    return out


def _accumulations(graph: StepGraph, module: Module, members, users, where) -> dict[str, str]:
    """`StageModule.accumulations` of a stage's module."""
    readers = module.entry.users()
    node = {x.name: x for x in module.entry.instructions}
    out = {}
    for x in members:
        if graph.role.get(x.name) != Role.ACCUMULATE or x.name not in node or \
                users.get(x.name, set()) - where[x.name]:
            continue
        update = next((u.name for u in readers[node[x.name]]
                       if graph.role.get(u.name) == Role.APPLY), None)
        if update is not None:
            out[x.name] = update
    return out


def _module_role(role: Role) -> Role:
    """The runtime module a node's role belongs to (accumulation runs with the backward)."""
    return Role.BACKWARD if role == Role.ACCUMULATE else role


# ---- role modules ---------------------------------------------------------------------------

ROLE_ORDER = (Role.PROLOGUE, Role.FORWARD, Role.BACKWARD, Role.APPLY)


@dataclass
class RoleModule:
    stage: int
    role: Role
    module: Module
    param_values: list[str]
    output_values: list[str]
    donated: list[int]
    scope: dict[str, str]  # values it gives to the stage's other roles -> scope


def role_modules(stage: StageModule, sharded: Module) -> list[RoleModule]:
    """Cut a sharded stage module into its prologue, forward, backward and update modules.
    Instructions computed for several roles (recomputable ones, those the stage recomputes in
    its backward, and the resharding copies the sharding pass inserted) are repeated in each."""
    entry = sharded.entry
    again = remat_split(stage).again
    fixed_role = {name: role for name, role in stage.role.items() if name not in again}
    params = {p.name: stage.param_values[p.parameter_number] for p in entry.parameters}
    root = entry.root
    given = {id(x): v for x, v in zip(root.operands, stage.output_values)}
    given_role = {id(x): r for x, r in zip(root.operands, stage.output_roles)}
    users = entry.users()
    roles: dict[int, set[Role]] = {}
    for x in reversed(entry.instructions):
        if x is root or x.opcode == "parameter":
            continue
        fixed = fixed_role.get(x.name)
        if fixed is not None:
            roles[id(x)] = {fixed}
            continue
        needed = set()
        for u in users[x]:
            needed |= roles.get(id(u), set())
        if id(x) in given_role:
            needed.add(given_role[id(x)])
        roles[id(x)] = needed
    def owner(x: Instruction) -> Role:
        """The one role module that gives x to others: its own role, the role of the stage
        output it is, or (recomputed in several roles) the last of them."""
        return fixed_role.get(x.name) or given_role.get(id(x)) or max(
            roles[id(x)], key=ROLE_ORDER.index)

    value_of: dict[int, str] = {}  # instruction -> program value it carries between modules
    for x in entry.instructions:
        if x.opcode == "parameter":
            value_of[id(x)] = params[x.name]
        elif id(x) in given:
            value_of[id(x)] = given[id(x)]
        elif x.name in fixed_role:
            value_of[id(x)] = f"s{stage.index}:{x.name}"
    out = []
    for role in ROLE_ORDER:
        members = [x for x in entry.instructions if role in roles.get(id(x), ())]
        if not members:
            continue
        # what this role gives: values other roles of the stage read, and the stage's outputs
        outputs = [x for x in members if owner(x) == role and (
            id(x) in given or (fixed_role.get(x.name) == role and any(
                roles.get(id(u), {role}) - {role} for u in users[x] if u is not root)))]
        if not outputs:
            continue
        module, inputs, outputs = extract(f"stage{stage.index}_{role}", members, outputs)
        pv = [value_of[id(i)] for i in inputs]
        ov = [value_of[id(o)] for o in outputs]
        donated = [k for k, v in enumerate(pv) if v in ov]  # accumulators, updated in place
        scope = {v: "microbatch" if role in (Role.FORWARD, Role.BACKWARD) else "step"
                 for v in ov if v.startswith(f"s{stage.index}:")}
        out.append(RoleModule(stage.index, role, module, pv, ov, donated, scope))
    return out


# ---- the program -----------------------------------------------------------------------------

def assemble(graph: StepGraph, stages: list[StageModule], roles: list[RoleModule], meshes,
             source: Module, num_micro_batches: int, schedule: str = "1f1b"):
    """The Program for the role modules, and the module texts by file name."""
    from alpac.hlo import print_module
    from alpac.plan.program import InputSpec, MeshSpec, ModuleSpec, OutputSpec, Param, Program, \
        Transfer, ValueSpec, module_signature

    scope = {}
    for st in stages:
        scope.update(st.scope)
    for rm in roles:
        scope.update(rm.scope)
    produced: dict[str, tuple[int, str]] = {}  # value -> (mesh, sharding as produced)
    specs, files = [], {}
    for rm in roles:
        file = f"stage{rm.stage}.{rm.role}.hlo"
        files[file] = print_module(rm.module)
        p_shard, o_shard = module_signature(rm.module)
        for value, sharding in zip(rm.output_values, o_shard):
            produced.setdefault(value, (rm.stage, sharding))
        specs.append(ModuleSpec(f"stage{rm.stage}.{rm.role}", file, rm.stage, rm.role, rm.stage,
                                [Param(v, sh) for v, sh in zip(rm.param_values, p_shard)],
                                [Param(v, sh) for v, sh in zip(rm.output_values, o_shard)],
                                rm.donated))
    shapes: dict[str, Shape] = {}
    for rm in roles:
        for p, v in zip(rm.module.entry.parameters, rm.param_values):
            shapes.setdefault(v, p.shape)
        for o, v in zip(rm.module.entry.root.operands, rm.output_values):
            shapes.setdefault(v, o.shape)
    # values nobody produces are fed: they live where they are first taken
    for spec in specs:
        for p in spec.parameters:
            produced.setdefault(p.value, (spec.mesh, p.sharding))
    values = {v: ValueSpec(list(shapes[v].dims), shapes[v].dtype, mesh, sharding,
                           scope.get(v, "step"), shapes[v].byte_size)
              for v, (mesh, sharding) in sorted(produced.items())}
    transfers, seen = [], set()
    for spec in specs:
        for p in spec.parameters:
            src_mesh, src_sharding = produced[p.value]
            if src_mesh != spec.mesh and (p.value, spec.mesh) not in seen:
                seen.add((p.value, spec.mesh))
                transfers.append(Transfer(p.value, src_mesh, spec.mesh, src_sharding,
                                          p.sharding, shapes[p.value].byte_size,
                                          values[p.value].scope))
    inputs = [InputSpec(int(v[3:].removesuffix(".mb")), v, dim)
              for v, _, dim in graph.param_values.values()
              if v.startswith("arg") and v in values]
    inputs.sort(key=lambda i: (i.parameter, i.value))
    outputs = [OutputSpec(index, graph.value_of(node), dim) for index, node, dim in graph.outputs]
    program = Program([MeshSpec(list(m.devices), list(m.shape)) for m in meshes], values,
                      inputs, outputs, specs, sorted({v for v in graph.accumulators.values()}),
                      transfers,
                      [(list(a.output_index), a.parameter_number)
                       for a in source.input_output_alias],
                      num_micro_batches, schedule,
                      "microbatch_index" if "microbatch_index" in values else None)
    return program, files
