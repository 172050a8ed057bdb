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

import numpy as np

from alpac.analysis.layerloops import recomputes
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
    checkpointed = checkpointed_layers(stage)
    if checkpointed is None:
        return set()
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


def checkpointed_layers(stage) -> set[int] | None:
    """The layers of the stage the program recomputes itself (an opt-barrier, as
    jax.checkpoint writes it, or a layer loop kept for the stage whose body holds one); None
    when a barrier sits outside every layer (then alpac recomputes nothing in the stage)."""
    layers = {stage.layer_of.get(x.name) for x in stage.module.entry.instructions
              if x.opcode == "opt-barrier" or x.opcode == "while" and
              recomputes(x.called("body"))}
    return None if None in layers else layers


def _layer_output(x, layer: int, users, stage) -> bool:
    """Read by the forward of another layer, or by another stage: the layer's checkpoint."""
    return any(u is stage.module.entry.root or (
        stage.role.get(u.name) == Role.FORWARD and stage.layer_of.get(u.name) != layer)
        for u in users)


def split_for_backward(stage, again_allowed: set[str]) -> RematSplit:
    """The forward nodes the backward keeps and recomputes when the nodes in `again_allowed`
    may be recomputed: walking back from the backward's operands, an allowed node is
    recomputed (and its operands walked), any other forward node is kept, and so is a
    microbatch's input (what the stage received: held from its forward to its backward). An
    element of a tuple that is kept (a loop's results) is kept itself: values, not tuples,
    pass from the forward to the backward."""
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
        if x.name in again_allowed and not (x.opcode == "get-tuple-element" and
                                            x.operands[0].name not in again_allowed):
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


# ---- the per-layer choice ---------------------------------------------------------------------

class RematMenu:
    """The cheapest per-layer recomputation that brings a range of layers under an activation
    limit (Mist's per-layer choice, not one switch for the model).

    Each layer's modes are points (extra seconds, bytes kept); on their lower convex hull a
    move from one mode to the next saves bytes at a price per byte that only rises. Taking
    the moves of all layers in order of that price, cheapest first, until the limit is met is
    then optimal up to the last move (a layer is recomputed whole, not in part). The order
    does not depend on the range, so it is sorted once per mesh config and microbatch count.
    """

    def __init__(self, seconds: np.ndarray, kept: np.ndarray):
        """`seconds`, `kept`: per layer (rows) and mode (columns, in REMAT_MODES order)."""
        moves = []  # (seconds per byte saved, layer, mode after, extra seconds, bytes saved)
        for layer in range(len(seconds)):
            hull = _hull([(float(seconds[layer, k]), float(kept[layer, k]), k)
                          for k in range(len(REMAT_MODES))])
            for (t0, a0, _), (t1, a1, k) in zip(hull, hull[1:]):
                moves.append(((t1 - t0) / (a0 - a1), layer, k, t1 - t0, a0 - a1))
        moves.sort(key=lambda m: (m[0], m[1]))
        self.base_seconds, self.base_kept = seconds[:, 0], kept[:, 0]
        self.layer = np.array([m[1] for m in moves], dtype=np.int64)
        self.mode = np.array([m[2] for m in moves], dtype=np.int64)
        self.extra = np.array([m[3] for m in moves], dtype=np.float64)
        self.saved = np.array([m[4] for m in moves], dtype=np.float64)

    def choose(self, first: int, last: int, limit: float, modes: bool = True
               ) -> tuple[float, float, dict | None] | None:
        """(extra seconds, bytes kept, layer -> Remat) of the cheapest choice for layers
        first..last keeping at most `limit` bytes; None when even the most does not. Without
        `modes` the choice per layer is left out (None): the stage DP asks for the price of
        some 10^6 stages and needs the layers' modes of its answer only."""
        kept = float(self.base_kept[first:last + 1].sum())
        if kept <= limit:
            return 0.0, kept, {}
        picks = np.flatnonzero((self.layer >= first) & (self.layer <= last))
        saved = np.cumsum(self.saved[picks])
        n = int(np.searchsorted(saved, kept - limit)) + 1  # moves to take
        if n > len(picks):
            return None
        taken = picks[:n]
        chosen = None
        if modes:  # later moves of a layer go further
            chosen = {int(layer): REMAT_MODES[int(mode)]
                      for layer, mode in zip(self.layer[taken], self.mode[taken])}
        return float(self.extra[taken].sum()), kept - float(saved[n - 1]), chosen


def _hull(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """From keeping everything (the first point), the modes on the lower convex hull of
    (seconds, bytes): each keeps fewer bytes than the one before, at a higher price per byte.
    A mode that keeps fewer bytes for no more time than another leaves that one out."""
    start = points[0]
    rest = sorted((p for p in points[1:] if p[1] < start[1]), key=lambda p: (p[1], p[0]))
    useful, fastest = [], float("inf")
    for p in rest:  # from the fewest bytes kept up
        if p[0] < fastest:
            useful.append((max(p[0], start[0]), p[1], p[2]))
            fastest = p[0]
    hull = [start]
    for p in reversed(useful):  # from the most bytes kept down
        while len(hull) >= 2 and _price(hull[-2], hull[-1]) >= _price(hull[-1], p):
            hull.pop()
        hull.append(p)
    return hull


def _price(a, b) -> float:
    return (b[0] - a[0]) / (a[1] - b[1])
