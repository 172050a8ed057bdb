"""Recomputation: which forward nodes of a pipeline stage its backward module computes again
instead of keeping them from the forward, chosen per layer.

  none       keep every activation the backward reads;
  selective  keep the outputs of the expensive instructions (contractions, library calls,
             loops, sorts) and recompute the cheap, memory-heavy ones between them (softmax,
             masks, elementwise chains);
  full       keep only the layer's outputs (its checkpoint: what the next layer reads) and
             recompute the rest of its forward.

A microbatch in flight then holds only what is kept; the backward module pays the recomputed
instructions once more. Never recomputed: what is not a pure function of its operands
(stateful random numbers, side effects, custom calls) and layers the program already
recomputes (an opt-barrier, as `jax.checkpoint` writes it): alpac never recomputes twice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from alpac.hlo.opcodes import (COLLECTIVE_OPS, CONTRACTIONS, CONTROL_FLOW, LIBRARY_CALLS,
                               PASS_THROUGH, SIDE_EFFECTING)
from alpac.plan.program import Role


class Remat(enum.StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


REMAT_MODES = tuple(Remat)

# not a pure function of the operands, or a checkpoint the program set itself
NEVER_RECOMPUTED = SIDE_EFFECTING | PASS_THROUGH | COLLECTIVE_OPS | {"custom-call", "parameter"}
# kept by selective recomputation: the work is in these, not in the bytes they make
KEPT_BY_SELECTIVE = CONTRACTIONS | LIBRARY_CALLS | CONTROL_FLOW | {"sort"}


@dataclass(frozen=True)
class RematSplit:
    """What the backward of one microbatch reads from its forward under a recomputation
    choice: `kept` forward nodes (held while the microbatch is in flight) and `again`, the
    forward nodes the backward module computes once more."""

    kept: frozenset[str]
    again: frozenset[str]


def recomputable(stage, choice: dict[int, Remat]) -> set[str]:
    """Names of the stage module's forward nodes that `choice` (layer -> mode; missing
    layers keep everything) lets the backward compute again."""
    if not any(mode != Remat.NONE for mode in choice.values()):
        return set()
    entry = stage.module.entry
    layer_of = stage.layer_of
    checkpointed = {layer_of.get(x.name) for x in entry.instructions
                    if x.opcode == "opt-barrier"}
    if None in checkpointed and checkpointed:
        return set()  # the program recomputes, in a part no layer owns: leave it as it is
    users = entry.users()
    out = set()
    for x in entry.instructions:
        layer = layer_of.get(x.name)
        mode = choice.get(layer, Remat.NONE)
        if mode == Remat.NONE or layer in checkpointed or \
                stage.role.get(x.name) != Role.FORWARD or x.opcode in NEVER_RECOMPUTED or \
                (mode == Remat.SELECTIVE and x.opcode in KEPT_BY_SELECTIVE) or \
                x is entry.root or _layer_output(x, layer, users[x], stage):
            continue
        out.add(x.name)
    return out


def _layer_output(x, layer: int, users, stage) -> bool:
    """Read by the forward of another layer, or by another stage: the layer's checkpoint."""
    return any(u is stage.module.entry.root or (
        stage.role.get(u.name) == Role.FORWARD and stage.layer_of.get(u.name) != layer)
        for u in users)


def split_for_backward(stage, again_allowed: set[str]) -> RematSplit:
    """The forward nodes the backward keeps and recomputes when the nodes in `again_allowed`
    may be recomputed: walking back from the backward's operands, an allowed node is
    recomputed (and its operands walked), any other forward node is kept, and so is a
    microbatch's input (what the stage received: held from its forward to its backward)."""
    entry = stage.module.entry
    kept, again = set(), set()
    users = entry.users()
    per_microbatch = {p.name for p in entry.parameters
                      if stage.scope.get(stage.param_values[p.parameter_number]) == "microbatch"
                      and any(stage.role.get(u.name) == Role.FORWARD for u in users[p])}
    todo = [o for x in entry.instructions if stage.role.get(x.name) == Role.BACKWARD
            for o in x.operands]
    while todo:
        x = todo.pop()
        if x.name in again_allowed:
            if x.name not in again:
                again.add(x.name)
                todo.extend(x.operands)
        elif stage.role.get(x.name) == Role.FORWARD or x.name in per_microbatch:
            kept.add(x.name)
    return RematSplit(frozenset(kept), frozenset(again))


def remat_split(stage, choice: dict[int, Remat] | None = None) -> RematSplit:
    """The split of the stage under `choice` (the stage's own choice when None)."""
    choice = stage.remat if choice is None else choice
    return split_for_backward(stage, recomputable(stage, choice))
