"""Write the chosen shardings into the module for XLA's SPMD partitioner.

Every instruction gets a `sharding=`. Where a user needs an operand in another sharding than
the operand has, an explicit `copy` carrying the needed sharding is inserted: XLA then
reshards exactly there, with the collective the plan predicted, instead of choosing its own
way around a mismatched dot. Transparent values (constants, iota, broadcasts) are cloned once
per sharding their users need; a clone computed from constants alone is handed to its users
through a `Sharding` custom-call, because XLA folds such a value into one splat constant when it
reads the module (dropping its annotation and merging it with equal constants of other
shardings), and would otherwise partition a scatter or gather by whatever sharding its
propagation then infers. User shardings already in the module are replaced.
"""

from __future__ import annotations

from alpac.hlo.ir import Computation, ComputationRefs, Instruction
from alpac.hlo.shape import Shape
from alpac.hlo.transforms import replace_uses
from alpac.intraop.builder import ShardingGraph, Value
from alpac.intraop.strategies import is_transparent, transparent_operand_needs
from alpac.plan.sharding import Sharding


class _Emitter:
    def __init__(self, sg: ShardingGraph, choice: list[int], deferred=()):
        self.sg = sg
        self.choice = choice
        self.deferred = deferred
        self.mesh_shape = tuple(sg.mesh.shape)
        self.module = sg.module
        self.copies: dict[tuple[int, Sharding], Instruction] = {}
        self.clones: dict[tuple[int, Sharding], Instruction] = {}
        self.pins: dict[int, Instruction] = {}  # id(clone) -> its Sharding custom-call
        self.constant_only: dict[int, bool] = {}
        self.inserted: set[int] = set()  # copies and clones carry their own sharding
        self.channel: int | None = None

    def text(self, s: Sharding) -> str:
        return s.to_xla(self.mesh_shape)

    def value_sharding(self, instr: Instruction, idx=()) -> Sharding:
        v: Value | None = self.sg.values.get((instr, idx))
        shape = instr.shape.subshape(idx)
        return v.sharding(self.choice) if v is not None else Sharding.replicated(shape.rank)

    def leaf_texts(self, instr: Instruction, override=None) -> str:
        override = override or {}
        if not instr.shape.is_tuple:
            return self.text(override.get((), self.value_sharding(instr)))
        leaves = [self.text(override.get(idx, self.value_sharding(instr, idx)))
                  for idx, _ in instr.shape.leaves()]
        return "{" + ", ".join(leaves) + "}"

    # ---- inserted instructions ----------------------------------------------------------------
    def reshard_copy(self, operand: Instruction, target: Sharding) -> Instruction:
        key = (id(operand), target)
        copy = self.copies.get(key)
        if copy is None:
            copy = Instruction(self.module.unique_name(f"{operand.name}.reshard"), "copy",
                               operand.shape, [operand], {"sharding": self.text(target)})
            operand.parent.append(copy)
            self.inserted.add(id(copy))
            self.copies[key] = copy
        return copy

    def transparent_clone(self, instr: Instruction, target: Sharding) -> Instruction:
        key = (id(instr), target)
        clone = self.clones.get(key)
        if clone is not None:
            return clone
        needs = transparent_operand_needs(instr, target, self.mesh_shape)
        operands = [self.operand_in(o, n) for o, n in zip(instr.operands, needs)]
        attrs = {k: v for k, v in instr.attrs.items() if k != "sharding"}
        attrs["sharding"] = self.text(target)
        clone = Instruction(self.module.unique_name(f"{instr.name}.s"), instr.opcode, instr.shape,
                            operands, attrs, instr.payload, instr.line)
        instr.parent.append(clone)
        self.inserted.add(id(clone))
        self.clones[key] = clone
        return clone

    def operand_in(self, operand: Instruction, target: Sharding) -> Instruction:
        """`operand` as an instruction with sharding `target`."""
        if is_transparent(operand):
            return self.transparent_clone(operand, target)
        if self.value_sharding(operand) == target:
            return operand
        return self.reshard_copy(operand, target)

    def use_operand(self, operand: Instruction, target: Sharding) -> Instruction:
        """`operand` in sharding `target` for a user that is not itself transparent. A clone
        made of constants alone is pinned with a `Sharding` custom-call (what JAX writes for
        with_sharding_constraint): XLA folds the clone into a splat constant, losing its
        annotation, but keeps the custom-call."""
        new = self.operand_in(operand, target)
        if new is operand or not is_transparent(operand) or target.rank == 0 or \
                not self.is_constant_only(operand):
            return new
        pin = self.pins.get(id(new))
        if pin is None:
            pin = Instruction(self.module.unique_name(f"{new.name}.pin"), "custom-call",
                              new.shape, [new], {"custom_call_target": '"Sharding"',
                                                 "sharding": self.text(target)})
            new.parent.append(pin)
            self.inserted.add(id(pin))
            self.pins[id(new)] = pin
        return pin

    def is_constant_only(self, instr: Instruction) -> bool:
        """Whether `instr` is computed from constants and iotas alone (XLA may fold it)."""
        memo = self.constant_only
        stack = [(instr, False)]
        while stack:  # operands first, without recursion: constant DAGs can be deep
            i, ready = stack.pop()
            if id(i) in memo:
                continue
            if not ready:
                stack.append((i, True))
                stack.extend((o, False) for o in i.operands if id(o) not in memo)
                continue
            memo[id(i)] = i.opcode in ("constant", "iota") or (
                is_transparent(i) and bool(i.operands) and all(memo[id(o)] for o in i.operands))
        return self.constant_only[id(instr)]

    # ---- the whole module --------------------------------------------------------------------
    def run(self) -> None:
        for instr in self.module.instructions():
            instr.attrs.pop("sharding", None)
        root_overrides: dict[int, dict] = {}
        for use in self.sg.uses:
            required = use.required_sharding(self.choice)
            if use.slot is None:  # loop state, branch result or aliased output
                root_overrides.setdefault(id(use.user), {})[use.index] = required
                continue
            if is_transparent(use.user):
                continue  # handled when the transparent value is cloned
            operand = use.user.operands[use.slot]
            new = self.use_operand(operand, required)
            if new is not operand:
                use.user.operands[use.slot] = new
        for comp in self.module.computations:
            for instr in list(comp.instructions):
                if is_transparent(instr) or id(instr) in self.inserted or \
                        instr.opcode == "while":
                    continue  # transparent: cloned per use; while: below, from its state
                instr.attrs["sharding"] = self.leaf_texts(instr)
        self.pin_barrier_results()
        for instr in self.module.instructions():
            if instr.opcode == "while":
                self.while_shardings(instr, root_overrides)
            elif instr.opcode == "conditional":
                for comp in instr.called_computations:
                    self.fix_root(comp, root_overrides.get(id(comp.root), {}),
                                  self.leaf_texts(instr))
        entry = self.module.entry
        self.fix_root(entry, root_overrides.get(id(entry.root), {}), None)
        for instr, plan in list(self.sg.plans.items()):
            if plan.strategies:
                st = plan.strategy(self.choice)
                scatter = [c for c in st.collectives if c.kind == "reduce-scatter"]
                if scatter:
                    self.manual_reduce_scatter(instr, st, scatter[0])
        for d in self.deferred:
            self.defer_reduction(d)
        for comp in self.module.computations:
            comp.topological_sort()
        for instr in self.module.instructions():
            if is_transparent(instr) and "sharding" not in instr.attrs:
                instr.attrs["sharding"] = "{replicated}"
        for comp in self.module.computations:
            comp.remove_dead()

    def pin_barrier_results(self) -> None:
        """Hand each element taken from an opt-barrier on through a `Sharding` custom-call.
        XLA reads the module as StableHLO, where the barrier is one op with many results; a
        user it folds away (a reshape and its inverse) leaves a barrier result in its place,
        and XLA's conversion back then fails on shardings of another rank."""
        for comp in self.module.computations:
            for gte in [i for i in comp.instructions if i.opcode == "get-tuple-element"
                        and i.operands[0].opcode == "opt-barrier" and not i.shape.is_tuple]:
                pin = Instruction(self.module.unique_name(f"{gte.name}.pin"), "custom-call",
                                  gte.shape, [gte], {"custom_call_target": '"Sharding"',
                                                     "sharding": gte.attrs["sharding"]})
                replace_uses(comp, gte, pin)  # before the pin joins: it keeps its operand
                self.add(comp, pin)

    # ---- reduce-scatter in a manual region ------------------------------------------------------
    def manual_reduce_scatter(self, instr: Instruction, st, rs) -> None:
        """Rewrite `instr` (a dot, convolution or reduce whose partial sums are reduce-
        scattered) as: operands to per-device tiles, the op on the tiles, an explicit
        reduce-scatter, back to the full shape. XLA's SPMD partitioner leaves manual regions as
        written, so the collective is the one predicted (XLA's CPU pipeline would otherwise
        all-reduce and slice)."""
        comp = instr.parent
        out = st.outputs[0]
        scattered_dim = next(d for d, axes in enumerate(out.dim_axes)
                             if set(rs.axes) <= set(axes))
        local_sharding = Sharding(tuple(
            tuple(a for a in axes if a not in rs.axes) if d == scattered_dim else axes
            for d, axes in enumerate(out.dim_axes)))
        local = self.local_op(instr, st, local_sharding)
        reducer = instr.called("to_apply") or self.add_computation(instr.shape.dtype)
        scattered = self.add(comp, Instruction(
            self.module.unique_name(f"{instr.name}.reduce-scatter"), "reduce-scatter",
            self.tile(instr, out), [local],
            {"channel_id": str(self.next_channel()), "replica_groups": self.groups(rs.axes),
             "use_global_device_ids": "true", "dimensions": "{" + str(scattered_dim) + "}",
             "to_apply": ComputationRefs([reducer]), "sharding": "{manual}"}))
        full = self.to_full(scattered, instr, out)
        replace_uses(comp, instr, full)  # run() puts every computation in order afterwards

    def local_op(self, instr: Instruction, st, local_sharding: Sharding) -> Instruction:
        """`instr` in a manual region: its operands as the per-device tiles `st` takes them
        in, the op on the tiles (partial sums, where it contracts a split dimension)."""
        comp = instr.parent
        manual_ops = []
        for operand, need in zip(instr.operands, st.inputs):
            if operand.opcode == "get-tuple-element":
                # XLA partitions it as its tuple's element, whatever its own annotation (a
                # loop's result: the manual region then got another tile and XLA refused it)
                operand = self.reshard_copy(operand, need)
            manual_ops.append(self.to_manual(operand, need))
        return self.add(comp, Instruction(
            self.module.unique_name(f"{instr.name}.local"), instr.opcode,
            self.tile(instr, local_sharding), manual_ops,
            {**{k: v for k, v in instr.attrs.items() if k != "sharding"},
             "sharding": "{manual}"}, instr.payload, instr.line))

    def tile(self, instr: Instruction, sharding: Sharding):
        return instr.shape.with_dims(sharding.tile_dims(instr.shape.dims, self.mesh_shape))

    def to_manual(self, operand: Instruction, sharding: Sharding) -> Instruction:
        return self.add(operand.parent, Instruction(
            self.module.unique_name(f"{operand.name}.manual"), "custom-call",
            self.tile(operand, sharding), [operand],
            {"custom_call_target": '"SPMDFullToShardShape"', "sharding": "{manual}"}))

    def to_full(self, local: Instruction, like: Instruction, sharding: Sharding,
                name: str | None = None) -> Instruction:
        return self.add(local.parent, Instruction(
            name or self.module.unique_name(f"{like.name}.full"), "custom-call", like.shape,
            [local],
            {"custom_call_target": '"SPMDShardToFullShape"', "sharding": self.text(sharding)}))

    def groups(self, axes) -> str:
        groups = self.sg.mesh.groups(tuple(axes))
        return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"

    # ---- gradients reduced once per step (alpac.intraop.deferral) ---------------------------
    def defer_reduction(self, d) -> None:
        """The contraction and its chain on per-device tiles without their all-reduce, each
        device adding its partial sum to its own copy of the accumulator; the update's reads
        of the accumulator go through one all-reduce over the deferred axes."""
        comp = d.accumulate.parent
        st = self.sg.plans[d.contraction].strategy(self.choice)
        out = st.outputs[0]
        local = self.local_op(d.contraction, st, out)
        for x in d.chain:
            local = self.add(comp, Instruction(
                self.module.unique_name(f"{x.name}.local"), x.opcode, self.tile(x, out),
                [local], {**{k: v for k, v in x.attrs.items() if k != "sharding"},
                          "sharding": "{manual}"}, x.payload, x.line))
        summed = self.add(comp, Instruction(
            self.module.unique_name(f"{d.accumulate.name}.local"), "add",
            self.tile(d.accumulate, out), [self.to_manual(d.accumulator, out), local],
            {"sharding": "{manual}"}))
        # the sum keeps the accumulation's name: the backward module gives it, the update
        # module takes it as an input (alpac.interop.pipeline.role_modules, by name)
        name, d.accumulate.name = d.accumulate.name, self.module.unique_name(
            f"{d.accumulate.name}.deferred")
        full = self.to_full(summed, d.accumulate, out, name)
        replace_uses(comp, d.accumulate, full)
        reduced = self.add(comp, Instruction(
            self.module.unique_name(f"{d.accumulate.name}.all-reduce"), "all-reduce",
            self.tile(d.accumulate, out), [self.to_manual(full, out)],
            {"channel_id": str(self.next_channel()), "replica_groups": self.groups(d.axes),
             "use_global_device_ids": "true",
             "to_apply": ComputationRefs([self.add_computation(d.accumulate.shape.dtype)]),
             "sharding": "{manual}"}))
        whole = self.to_full(reduced, d.accumulate, out)
        for user in comp.instructions:
            if user is not comp.root and id(user) not in self.inserted and full in user.operands:
                user.operands = [whole if o is full else o for o in user.operands]

    def add(self, comp: Computation, instr: Instruction) -> Instruction:
        self.inserted.add(id(instr))
        return comp.append(instr)

    def next_channel(self) -> int:
        if self.channel is None:
            self.channel = max((int(str(i.attrs["channel_id"])) for i in
                                self.module.instructions() if "channel_id" in i.attrs),
                               default=0)
        self.channel += 1
        return self.channel

    def add_computation(self, dtype: str) -> Computation:
        """A scalar `add` reducer for the element type (one per type)."""
        name = f"alpac.add.{dtype}"
        for comp in self.module.computations:
            if comp.name == name:
                return comp
        scalar = Shape(dtype)
        x = Instruction("x", "parameter", scalar, (), {}, "0")
        y = Instruction("y", "parameter", scalar, (), {}, "1")
        comp = Computation(name, [x, y, Instruction("sum", "add", scalar, [x, y])])
        self.module.computations.insert(0, comp)
        return comp

    def while_shardings(self, loop: Instruction, root_overrides) -> None:
        body = loop.called("body")
        if _has_passthrough_state(body):
            # XLA's StableHLO path drops loop-invariant state but keeps the loop's tuple
            # sharding, which then no longer fits: leave the loop to XLA's propagation
            for instr in (loop, body.parameters[0], body.root,
                          loop.called("condition").parameters[0]):
                instr.attrs.pop("sharding", None)
            return
        state = self.leaf_texts(loop.operands[0])
        loop.attrs["sharding"] = state
        for comp in (loop.called("body"), loop.called("condition")):
            comp.parameters[0].attrs["sharding"] = state
        self.fix_root(body, root_overrides.get(id(body.root), {}), state)

    def fix_root(self, comp: Computation, needed: dict, sharding_text: str | None) -> None:
        """Make the root's leaves arrive in the needed shardings (inserting copies) and give the
        root its final sharding."""
        root = comp.root
        if needed and root.opcode == "tuple" and all(len(idx) == 1 for idx in needed):
            for (k,), target in needed.items():
                root.operands[k] = self.use_operand(root.operands[k], target)
        elif needed and not root.shape.is_tuple and () in needed:
            comp.root = self.use_operand(root, needed[()])
            root = comp.root
        elif needed:
            raise ValueError(f"cannot reshard the result of {comp.name}: root {root.name} is "
                             f"{root.opcode}")
        if sharding_text is None:
            sharding_text = self.leaf_texts(root, needed)
        root.attrs["sharding"] = sharding_text


def _has_passthrough_state(body: Computation) -> bool:
    root = body.root
    param = body.parameters[0]
    if root is param:
        return True
    return root.opcode == "tuple" and any(
        o.opcode == "get-tuple-element" and o.operands[0] is param and o.tuple_index == k
        for k, o in enumerate(root.operands))


def write_shardings(sg: ShardingGraph, choice: list[int], deferred=()) -> None:
    """Annotate `sg.module` in place with the shardings of `choice`, the all-reduces of the
    `deferred` accumulations (alpac.intraop.deferral) moved to the update."""
    _Emitter(sg, choice, deferred).run()

