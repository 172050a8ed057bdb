"""What the stage DP pays for a stage: its layers' priced figures summed over a layer range on
a mesh config at a microbatch count, with the recomputation its variant asks for.

A variant either recomputes every layer alike (`--remat none|selective|full`) or, under
`--remat auto`, is the cheapest per-layer recomputation that lets the stage hold a target
number of microbatches in flight (`RematMenu`); targets run over the in-flight counts a
stage can have (1 .. stages), so the DP finds, wherever a stage sits in the pipeline, the
least recomputation that fits there.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from alpac.interop.pricing import LayerCost, RangeCosts
from alpac.interop.remat import REMAT_MODES, Remat, RematMenu
from alpac.interop.stage_dp import StageCost


class StageConfig(NamedTuple):
    """What the stage DP chooses for a stage on a submesh besides its layers: a priced mesh
    config (an index into the submesh's) and how its layers recompute: one mode for all, or
    (an int) the least recomputation that holds that many microbatches in flight."""

    config: int
    remat: Remat | int


def remat_variants(text: str, max_in_flight: int) -> tuple[Remat | int, ...]:
    """The recomputation variants of `--remat` (the first: keep everything, or the forced
    mode)."""
    if text != "auto":
        return (Remat(text),)
    targets, k = [], 1
    while k <= max_in_flight:
        targets.append(k)
        k = k + 1 if k < 4 else k * 3 // 2 if k & (k - 1) == 0 else k * 4 // 3  # 4, 6, 8, 12..
    return (Remat.NONE, *targets)


class StagePrices:
    """Stage costs for the DP from per-layer figures (`solved`: layer key -> figures per Remat
    at the reference microbatch count; `again`: key -> a second count and the same shardings'
    figures there), at the counts where each key's shardings divide (`dividing`)."""

    def __init__(self, hashes, solved, again, dividing, transfers, reference: int,
                 budget: float, launch: float, submesh_sizes: list[int], num_devices: int):
        self.hashes, self.solved, self.again, self.dividing = hashes, solved, again, dividing
        self.transfers = transfers  # (first, last, m, c, B) -> seconds received (TransferPrices)
        # per submesh: 1 + how many stages the other devices can form
        self.stages_from = [1 + (num_devices - size) // min(submesh_sizes)
                            for size in submesh_sizes]
        self.reference = reference
        self.budget, self.launch = budget, launch
        self.ranges: dict[tuple, RangeCosts] = {}  # (m, c, mode, B) -> every range
        self.menus: dict[tuple, RematMenu] = {}  # (m, c, B) -> per-layer choice
        self.undivided: dict[tuple, np.ndarray] = {}  # (m, c, B) -> layers before, not dividing

    def layers(self, m: int, c: int, mode: Remat, B: int) -> list[LayerCost]:
        out = []
        for h in self.hashes:
            second, figures = self.again.get((h, m, c), (self.reference, self.solved[(h, m, c)]))
            out.append(LayerCost.fit(self.reference, self.solved[(h, m, c)][mode], second,
                                     figures[mode], B))
        return out

    def divides(self, first: int, last: int, m: int, c: int, B: int) -> bool:
        """Whether the shardings priced for layers first..last on config c divide at B."""
        key = (m, c, B)
        if key not in self.undivided:
            self.undivided[key] = np.concatenate(([0], np.cumsum(
                [B not in self.dividing[(h, m, c)] for h in self.hashes])))
        return self.undivided[key][last + 1] == self.undivided[key][first]

    def uniform(self, first: int, last: int, m: int, c: int, mode: Remat, B: int) -> LayerCost:
        """Layers first..last all recomputing as `mode`, with their module launches and what
        they receive from other stages."""
        key = (m, c, mode, B)
        if key not in self.ranges:
            self.ranges[key] = RangeCosts(self.layers(m, c, mode, B))
        per_microbatch, per_step = self.transfers(first, last, m, c, B)
        # a forward and a backward module per microbatch, an update module per step
        return self.ranges[key](first, last).plus(2 * self.launch + per_microbatch,
                                                  self.launch + per_step)

    def priced(self, first: int, last: int, m: int, config: StageConfig, B: int,
               modes: bool = True) -> tuple[LayerCost, dict[int, Remat] | None] | None:
        """The stage's figures and (with `modes`) each layer's recomputation; None where the
        layers' shardings do not divide at B, or for a variant that holds no more than
        keeping everything would, or cannot hold its target."""
        c, remat = config
        if not self.divides(first, last, m, c, B):
            return None
        if isinstance(remat, Remat):
            return (self.uniform(first, last, m, c, remat, B),
                    {layer: remat for layer in range(first, last + 1)} if modes else None)
        if remat > self.most_in_flight(last, m, B):
            return None
        base = self.uniform(first, last, m, c, Remat.NONE, B)
        limit = (self.budget - base.held_bytes) / remat
        if limit < 0 or base.activation_bytes <= limit:
            return None
        chosen = self.menu(m, c, B).choose(first, last, limit, modes)
        if chosen is None:
            return None
        extra, kept, per_layer = chosen
        cost = LayerCost(base.t + extra, base.apply, base.static_bytes, kept,
                         base.transient_bytes)
        return cost, None if per_layer is None else {
            layer: per_layer.get(layer, Remat.NONE) for layer in range(first, last + 1)}

    def admissible(self, configs: list[list[StageConfig]]):
        """For the stage DP: whether stages (arrays first, last, submesh, config index) can
        ever need their recomputation target (`most_in_flight`, at any B)."""
        target = np.zeros((len(configs), max(map(len, configs), default=0)), dtype=np.int64)
        for m, cs in enumerate(configs):
            target[m, :len(cs)] = [k.remat if isinstance(k.remat, int) else 0 for k in cs]
        stages_from = np.array(self.stages_from)

        def admissible(first, last, m, c) -> np.ndarray:
            return target[m, c] <= np.minimum(len(self.hashes) - last, stages_from[m])

        return admissible

    def most_in_flight(self, last: int, m: int, B: int) -> int:
        """The most microbatches a stage ending at layer `last` on submesh m can hold under
        1F1B: one per stage from it to the end, and there are no more stages than layers
        after it or than the other devices can form."""
        return min(B, len(self.hashes) - last, self.stages_from[m])

    def menu(self, m: int, c: int, B: int) -> RematMenu:
        if (m, c, B) not in self.menus:
            per_mode = [self.layers(m, c, mode, B) for mode in REMAT_MODES]
            seconds = np.array([[x.t for x in col] for col in per_mode]).T
            kept = np.array([[x.activation_bytes for x in col] for col in per_mode]).T
            self.menus[(m, c, B)] = RematMenu(seconds, kept)
        return self.menus[(m, c, B)]

    def stage_cost(self, first: int, last: int, m: int, config: StageConfig, B: int
                   ) -> StageCost | None:
        priced = self.priced(first, last, m, config, B, modes=False)
        if priced is None:
            return None
        cost = priced[0]
        return StageCost(cost.t, cost.apply, cost.held_bytes, cost.activation_bytes,
                         self.budget)
