"""The split of a step into per-microbatch, accumulated and once-per-step parts (`StepSplit`).

From the batch classes (`dataflow.analyse`):

- the **prologue** computes, once per step on the whole batch, the batch-only statistics that
  the per-example computation needs (BERT's number of masked tokens): they then count as
  independent of the batch;
- the **per-microbatch** part is every split or batch-sum instruction, plus the independent
  instructions they need (recomputed per microbatch);
- the **accumulated** tensors are the batch sums the rest needs (gradients, the loss,
  metrics); split values the rest needs whole (forward outputs) are **concatenated**;
- the **once-per-step** part (epilogue) is everything else the outputs need: the optimizer
  update and whatever uses a batch sum non-linearly.

The exactness guard refuses (with the instruction and the reason) a step where a per-example
computation needs a whole-batch value that is not batch-only (batch-norm statistics), or an
instruction the rewrite cannot shrink exactly. `alpac compile` then plans with B = 1.

Forward instructions are the per-microbatch ones that the loss (the scalar float batch-sum
outputs) depends on; the other per-microbatch instructions are backward. While loops (a scan
over layers) are analysed to a fixed point and stay whole in one part.
"""

from __future__ import annotations

from alpac.analysis.step.batch import BatchInfo, output_sources
from alpac.analysis.step.dataflow import analyse, batch_only
from alpac.analysis.step.lattice import Cls, leaves
from alpac.analysis.step.oprules import reducer_kind
from alpac.analysis.step.wiring import SinkKind
from alpac.hlo.ir import Instruction, Module
from alpac.hlo.opcodes import CONTRACTIONS, ELEMENTWISE, SLICES, VALUE_COPIES, VIEWS, \
    WINDOW_REDUCTIONS
from alpac.plan.program import Role

# Opcodes the microbatch rewrite can shrink along the batch.
REWRITABLE = (ELEMENTWISE | VIEWS | SLICES | WINDOW_REDUCTIONS
              | {"broadcast", "concatenate", "convolution", "dot", "dynamic-update-slice", "fft",
                 "get-tuple-element", "map", "opt-barrier", "pad", "reduce", "reverse",
                 "scatter", "sort", "topk", "tuple", "batch-norm-inference"})

PARTS = ("prologue", "microbatch", "epilogue")
# Linear ops of batch sums that the once-per-step part may recompute from their operands.
_PUSHABLE = (VIEWS | VALUE_COPIES
             | {"broadcast", "multiply", "divide", "negate", "add", "subtract", "select",
                "concatenate"})


class StepSplit:
    """How one step splits into microbatches (see the module docstring).

    Attributes (instructions of the module's entry, in instruction order):
    `prologue_values`, `accumulated`, `concatenated` ((instr, dim) pairs), `loss`,
    `forward`, `backward`, `parts` (part name -> instructions), `refusal` (None or why
    microbatching would not be exact), `sizes` (part -> instructions, FLOPs, bytes).
    """

    def __init__(self, module: Module, batch: BatchInfo, costs=None):
        self.module = module
        self.batch = batch
        self.costs = costs  # the CostTable given, else made when first needed (cost_table)
        self.refusal: str | None = None
        self.refused_at: Instruction | None = None
        self.flow = None
        self.prologue_values: list[Instruction] = []
        self.accumulated: list[Instruction] = []
        self.concatenated: list[tuple[Instruction, int]] = []
        self.outputs = output_sources(module)
        self.loss: list[Instruction] = []
        self.parts: dict[str, list[Instruction]] = {p: [] for p in PARTS}
        self.forward: list[Instruction] = []
        self.backward: list[Instruction] = []
        self.inputs: dict[str, list[Instruction]] = {p: [] for p in PARTS}
        self.sizes: dict[str, dict] = {}
        if not batch.args:
            self._refuse(None, f"no batch inputs: {batch.reason or 'none found'}")
            self._sizes()
            return
        only = batch_only(module, batch.dims)
        self._only = only
        self.flow, self.prologue_values = analyse(module, batch.dims, batch.size, only)
        self._guard()
        self._partition()
        self._mark()
        self._check_rewritable()
        self._sizes()

    # ---- classes ---------------------------------------------------------------------------
    def cls(self, instr: Instruction):
        return self.flow.of(instr) if self.flow is not None else None

    def _per_microbatch(self, instr: Instruction) -> bool:
        if instr in self._pre:
            return False
        return any(leaf.kind in "SP" for leaf in leaves(self.flow.of(instr)))

    def _refuse(self, at: Instruction | None, reason: str) -> None:
        if self.refusal is None:
            self.refusal = reason
            self.refused_at = at

    # ---- exactness guard -------------------------------------------------------------------
    def _guard(self) -> None:
        df = self.flow
        self._pre = set(self.prologue_values)
        for x, reason in df.blockers:
            self._refuse(x, f"{reason}; microbatching would change the result")
        for u, i in df.full_uses:
            v = u.operands[i]
            origin = df.root_origin(v)
            what = _describe(origin, df)
            via = f" (through %{v.name})" if v is not origin else ""
            self._refuse(origin, f"batch statistic %{origin.name} ({what}) is used per "
                                 f"example by %{u.name}{via}; microbatching would change "
                                 f"the result")

    # ---- parts -----------------------------------------------------------------------------
    def _partition(self) -> None:
        entry = self.module.entry
        df = self.flow
        pre = self._pre
        order = {x: k for k, x in enumerate(entry.instructions)}
        # Accumulate as few bytes as possible: a batch sum the once-per-step part needs that
        # is a linear view of other batch sums (the gradient scaled for the optimizer's
        # moment, the mean = sum / N) is recomputed there from the sums it is made of when
        # those are no bigger.
        pushed: set[Instruction] = set()
        for _ in range(64):
            ep, ep_in, acc, cat = self._epilogue_walk(pushed)
            grow = False
            for x in sorted(acc, key=order.__getitem__, reverse=True):
                if x.opcode not in _PUSHABLE:
                    continue
                kinds = [df.of(o) for o in x.operands]
                if any(not isinstance(c, Cls) or c.kind in "SF" for c in kinds):
                    continue
                sums = {o for o, c in zip(x.operands, kinds) if c.kind == "P"}
                if sum(o.shape.byte_size for o in sums if o not in acc) <= x.shape.byte_size:
                    pushed.add(x)
                    acc |= sums
                    grow = True
            if not grow:
                break
        else:
            ep, ep_in, acc, cat = self._epilogue_walk(pushed)
        self._pushed = pushed
        # per-microbatch part: what the accumulated and concatenated values need
        mb, mb_in = set(), set()
        stack = [x for x in ep_in if x in acc or x in cat]
        while stack:
            x = stack.pop()
            if x in mb or x in mb_in:
                continue
            if x.opcode == "parameter" or x in pre:
                mb_in.add(x)
                continue
            c = df.of(x)
            if any(leaf.kind == "F" for leaf in leaves(c)) and self.refusal is None:
                self._refuse(x, f"%{x.name} ({x.opcode}) needs the whole batch but feeds the "
                                f"per-microbatch part")
            mb.add(x)
            stack.extend(x.operands)
        # prologue: the batch-only statistics either part uses
        roots = [x for x in self.prologue_values if x in mb_in or x in ep_in]
        self.prologue_values = roots
        pro, pro_in = set(), set()
        stack = list(roots)
        while stack:
            x = stack.pop()
            if x in pro or x in pro_in:
                continue
            if x.opcode == "parameter":
                pro_in.add(x)
                continue
            pro.add(x)
            stack.extend(x.operands)
        order = entry.instructions
        self.parts = {"prologue": [x for x in order if x in pro],
                      "microbatch": [x for x in order if x in mb],
                      "epilogue": [x for x in order if x in ep]}
        self.inputs = {"prologue": [x for x in order if x in pro_in],
                       "microbatch": [x for x in order if x in mb_in],
                       "epilogue": [x for x in order if x in ep_in]}
        self.accumulated = [x for x in order if x in acc]
        self.concatenated = [(x, cat[x]) for x in order if x in cat]

    def _epilogue_walk(self, pushed):
        """What the outputs need, stopping at per-microbatch values (except `pushed` ones):
        (epilogue instructions, its inputs, accumulated, concatenated {instr: dim})."""
        df = self.flow
        pre = self._pre
        ep, ep_in = set(), set()
        acc, cat = set(), {}
        stack = list(self.outputs)
        while stack:
            x = stack.pop()
            if x in ep or x in ep_in:
                continue
            if x.opcode == "parameter" or x in pre:
                ep_in.add(x)
            elif self._per_microbatch(x) and x not in pushed:
                c = df.of(x)
                if isinstance(c, Cls) and c.kind == "P":
                    acc.add(x)
                elif isinstance(c, Cls) and c.kind == "S":
                    cat[x] = c.dim
                else:
                    self._refuse(x, f"the once-per-step part needs the whole tuple %{x.name} "
                                    f"({x.opcode}), whose elements are "
                                    f"{_class_counts(c)}{self._full_reason(x)}: only batch "
                                    f"sums and values split along one dim can cross from "
                                    f"the microbatches")
                ep_in.add(x)
            else:
                ep.add(x)
                stack.extend(x.operands)
        return ep, ep_in, acc, cat

    def _full_reason(self, x: Instruction) -> str:
        """'; the first full-batch element comes from ...' for a tuple-valued value."""
        df = self.flow
        c = df.of(x)
        if isinstance(c, Cls):
            return ""
        idx = next((i for i, leaf in enumerate(c) if isinstance(leaf, Cls)
                    and leaf.kind == "F"), None)
        if idx is None:
            return ""
        src = x
        if x.opcode == "while" and x.called("body") is not None and \
                x.called("body").root.opcode == "tuple":
            src = x.called("body").root.operands[idx]
        elif x.opcode == "tuple":
            src = x.operands[idx]
        origin = df.root_origin(src)
        if origin is x or origin is src and src not in df.why and src.opcode != "reduce":
            return ""
        return f" (element {idx} needs the whole batch because of %{origin.name}: " \
               f"{_describe(origin, df)})"

    def _mark(self) -> None:
        self.loss = [x for x in dict.fromkeys(self.outputs)
                     if not x.shape.is_tuple and x.shape.rank == 0 and x.shape.is_float
                     and self.flow.of(x).kind == "P"]
        if not self.loss:
            self.forward = list(self.parts["microbatch"])
            self.backward = []
            return
        seen, stack = set(), list(self.loss)
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            stack.extend(x.operands)
        for x in self.parts["microbatch"]:  # an element of a forward tuple goes with it
            if x.opcode == "get-tuple-element" and x.operands[0] in seen:
                seen.add(x)
        self.forward = [x for x in self.parts["microbatch"] if x in seen]
        self.backward = [x for x in self.parts["microbatch"] if x not in seen]

    def _check_rewritable(self, instrs=None) -> None:
        for x in self.parts["microbatch"] if instrs is None else instrs:
            if self.refusal is not None:
                return
            if x.opcode == "parameter" or not self._per_microbatch(x):
                continue
            if x.opcode == "while" and x.called("body") is not None and \
                    x.called("condition") is not None:
                self._check_rewritable(x.called("body").instructions)
                self._check_rewritable(x.called("condition").instructions)
                continue
            ok = x.opcode in REWRITABLE or x.is_identity_call
            if x.opcode == "map" and x.called("to_apply") is None:
                ok = False
            if not ok:
                what = x.opcode + (f" {x.custom_call_target}" if x.opcode == "custom-call"
                                   else "")
                where = "" if x.parent is self.module.entry else f" in {x.parent.name}"
                self._refuse(x, f"%{x.name} ({what}){where} carries batch data and the "
                                f"microbatch rewrite cannot shrink it (calls, conditionals and "
                                f"custom-calls other than annotations are not rewritten)")
                return

    # ---- sizes -------------------------------------------------------------------------------
    def cost_table(self):
        """The step's CostTable, or None where it cannot be made: costs are figures for the
        report, never a reason to fail."""
        if self.costs is None:
            try:
                from alpac.analysis.costs import CostTable
                self.costs = CostTable(self.module)
            except Exception:
                return None
        return self.costs

    def _sizes(self) -> None:
        costs = self.cost_table()
        for part in PARTS:
            instrs = self.parts[part]
            flops = bytes_ = 0.0
            if costs is not None:
                for x in instrs:
                    if x in costs:
                        c = costs[x]
                        flops += c.flops
                        bytes_ += c.bytes_accessed
            self.sizes[part] = {"instructions": len(instrs), "flops": flops, "bytes": bytes_}
        self.sizes[SinkKind.ACCUMULATE] = {
            "tensors": len(self.accumulated),
            "bytes": sum(x.shape.byte_size for x in self.accumulated)}
        self.sizes[SinkKind.CONCATENATE] = {
            "tensors": len(self.concatenated),
            "bytes": sum(x.shape.byte_size for x, _ in self.concatenated)}

    # ---- rewrite -------------------------------------------------------------------------------
    def microbatch(self, num_microbatches: int):
        """The step as prologue / per-microbatch / once-per-step modules for B microbatches
        (`rewrite.MicrobatchedStep`); raises `MicrobatchRefused` when it cannot be exact."""
        from alpac.analysis.step.rewrite import build_microbatched
        return build_microbatched(self, num_microbatches)

    # ---- forward/backward pairing ----------------------------------------------------------
    def backward_layers(self, forward_layer: dict[Instruction, int]) -> dict[Instruction, int]:
        """A layer for every backward instruction, given one for forward instructions.

        layer(b) = min(layers of b's backward operands, and for each forward operand f (or
        batch input) the largest layer among f's forward users — the layer that consumes
        f — or f's own layer if it has none). Backward instructions without such operands (independent values
        only the backward uses, e.g. transposed weights) take the largest layer of their
        users. Only operands that depend on the batch count (activations and their
        gradients, which stages pass to each other); weights, constants and masks can be
        copied to any stage. Along every backward edge u -> b, layer(b) <= layer(u): the
        backward pass runs from the last layer to the first.
        """
        users = self.module.entry.users()
        fwd = set(self.forward)
        consumer: dict[Instruction, int] = {}

        def consumed_in(f: Instruction) -> int | None:
            if f not in consumer:
                ls = [forward_layer[u] for u in users.get(f, ()) if u in fwd
                      and u in forward_layer]
                consumer[f] = max(ls) if ls else forward_layer.get(f)
            return consumer[f]

        layer: dict[Instruction, int] = {}
        pending = []
        touched = self.flow.touched
        for b in self.backward:
            cands = []
            for o in b.operands:
                if not touched(o):
                    continue  # weights, constants, masks: any stage can have its own copy
                if o in layer:
                    cands.append(layer[o])
                elif o in forward_layer or o.opcode == "parameter":
                    # a forward value (or a batch input): where the forward consumes it
                    at = consumed_in(o)
                    if at is not None:
                        cands.append(at)
            if cands:
                layer[b] = min(cands)
            else:
                pending.append(b)
        top = max(forward_layer.values(), default=0)
        for b in reversed(pending):
            ls = [layer[u] for u in users.get(b, ()) if u in layer]
            layer[b] = max(ls) if ls else top
        return layer

    # ---- report ----------------------------------------------------------------------------------
    def summary(self, forward_layer: dict[Instruction, int] | None = None) -> dict:
        """JSON-ready description for `alpac inspect --json` and the plan."""
        out = {
            "batch": self.batch.to_dict(),
            "refusal": self.refusal,
            "refused_at": self.refused_at.name if self.refused_at is not None else None,
            "sizes": self.sizes,
            "prologue_values": [x.name for x in self.prologue_values],
            "accumulated": [{"name": x.name, "shape": str(x.shape.without_layout())}
                            for x in self.accumulated],
            "concatenated": [{"name": x.name, "dim": d, "shape": str(x.shape.without_layout())}
                             for x, d in self.concatenated],
            "loss": [x.name for x in self.loss],
            "forward_instructions": len(self.forward),
            "backward_instructions": len(self.backward),
            "outputs": self._output_roles(),
        }
        if self.flow is not None:
            out["assumptions"] = [f"%{x.name}: {why}" for x, why in self.flow.assumed]
        if forward_layer is not None:
            out["layers"] = self.layer_table(forward_layer)
        return out

    def _output_roles(self) -> list[str]:
        """Per output, where its value comes from (looked up in sets: a step may have as many
        outputs as accumulated values)."""
        accumulated = set(self.accumulated)
        concatenated = {x for x, _ in self.concatenated}
        return ["accumulated" if x in accumulated else "concatenated" if x in concatenated
                else "parameter" if x.opcode == "parameter" else "once-per-step"
                for x in self.outputs]

    def layer_table(self, forward_layer: dict[Instruction, int]) -> list[dict]:
        """Per layer: forward and backward instruction counts and FLOPs."""
        back = self.backward_layers(forward_layer)
        costs = self.cost_table()
        rows: dict[int, dict] = {}
        for kind, mapping in ((Role.FORWARD, {x: forward_layer[x] for x in self.forward
                                              if x in forward_layer}), (Role.BACKWARD, back)):
            for x, layer in mapping.items():
                row = rows.setdefault(layer, {"layer": layer, "forward_instructions": 0,
                                              "forward_flops": 0.0, "backward_instructions": 0,
                                              "backward_flops": 0.0})
                row[f"{kind}_instructions"] += 1
                if costs is not None and x in costs:
                    row[f"{kind}_flops"] += costs[x].flops
        return [rows[k] for k in sorted(rows)]


def _class_counts(c) -> str:
    counts: dict[str, int] = {}
    for leaf in leaves(c):
        key = {"I": "independent", "Z": "independent", "P": "batch sums", "F": "full-batch",
               "S": "split"}[leaf.kind]
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def _describe(x: Instruction, df) -> str:
    if x.opcode == "reduce":
        kind = reducer_kind(x.called("to_apply")) or "custom"
        src = x.operands[0]
        return (f"{'sum' if kind == 'add' else kind} over the batch dim of %{src.name} "
                f"{src.shape.without_layout()}, dims {list(x.dims('dimensions'))}")
    if x.opcode in CONTRACTIONS:
        return f"a {x.opcode} contracting the batch"
    if x in df.why:
        return df.why[x]
    return f"{x.opcode} over the batch"
