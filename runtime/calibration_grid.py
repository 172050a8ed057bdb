"""What `alpac calibrate` measures: the points of its grid (a row of a table each) and the
sizes they take; `alpac.runtime.probes` times them."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.plan.calibration import SCALARS

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
COMBINED = "combined-all-reduce"
# an operand of a combined all-reduce is timed to this size (each execution moves
# several of them twice: larger ones take seconds on a CPU); the table extrapolates
COMBINED_MAX_BYTES = 256 << 10
# the largest message under multi-process jax in the full grid: gloo on CPU takes seconds
# per collective of 16 MiB (a 5-minute budget for 4 ranks on 2 cores); the tables
# extrapolate past it
ACROSS_MAX_BYTES = {"cpu": 4 << 20, "gpu": 16 << 20}
# the largest dot timed on one device alone: a plan leaves devices idle only where its work
# is small (the table extrapolates past it)
ALONE_MAX_SIDE = 512


@dataclass(frozen=True)
class Point:
    """One row to measure: `table` is its key path under `calibration:`, `size` the row's
    FLOPs or bytes; `shape` is (m, k, n) for a dot, (ranks, devices per rank) for a
    collective's group; `phase` "inter" measures it under multi-process jax."""
    table: tuple[str, ...]
    size: int
    shape: tuple[int, ...] = ()
    phase: str = "local"

    def describe(self) -> str:
        what = ".".join(self.table)
        if self.table[0] == "concurrency":
            return f"a dot on {self.size} device(s) at once"
        if "dot" in self.table:
            return f"{what} {'x'.join(map(str, self.shape))}"
        return what if self.table[0] in SCALARS else f"{what} {self.size:,} B"


def collective_phase(ranks: int) -> str:
    """Where a calibration of `ranks` ranks measures its collectives, a rank's own included:
    as alpa-run runs them. With several ranks that is multi-process jax, where XLA's CPU
    client sends even the collectives among one process's devices through gloo (5-20x
    dearer than in one process)."""
    return "inter" if ranks > 1 else "local"


# ---- the grid ------------------------------------------------------------------------------

def dot_shapes(side: int) -> list[tuple[int, int, int]]:
    """Three shapes of 2*side^3 FLOPs: square, tall with a narrow output, a small batch."""
    return [(side, side, side), (4 * side, side, side // 4), (side // 16, 4 * side, 4 * side)]


def dot_side(flops: float) -> int:
    return max(16, round((flops / 2) ** (1 / 3) / 16) * 16)


def group_sizes(n: int) -> list[int]:
    """Powers of two up to n, and n."""
    return sorted({2 ** i for i in range(1, n.bit_length()) if 2 ** i <= n} | ({n} - {1}))


def collective_bytes(nbytes: float, group: int) -> int:
    """The row size of a collective near `nbytes`: whole f32 elements that split evenly."""
    return 4 * max(group, round(nbytes / 4 / group) * group)


def _kinds(link: str, ranks: int, nodes: int) -> tuple[str, ...]:
    """The collectives a group is timed in: K groups at once across the ranks in those of
    data parallelism (the others are priced as one group carrying their bytes); the combined
    form where a step's gradients are all-reduced (inside a rank, across all ranks; groups
    across fewer ranks take the nearest one's figure, `Calibration.collective_seconds`).
    Each more kind costs the 4-rank calibration here ~20 s of its 5 minutes."""
    kinds = COLLECTIVES[:3] if link == "inter_node_shared" else COLLECTIVES
    return kinds + ((COMBINED,) if link == "intra_node" or ranks == nodes else ())


def grid(nodes: int, k: int, quick: bool, gpu: bool = False) -> list[Point]:
    """Every point of a calibration of `nodes` ranks of `k` devices. A GPU reaches its peak
    only on far larger work than a CPU core (a dot of side 4096, arrays of 100s of MB), so its
    grid goes on up to there: the tables interpolate inside, and only extrapolate past it."""
    if quick:
        sides, bf16_top = (32, 128, 512), 256
        arrays, messages = [4096 * 16 ** i for i in range(3)], [1024 * 32 ** i for i in range(3)]
    elif gpu:
        sides = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
        bf16_top, arrays = sides[-1], [4096 * 4 ** i for i in range(10)]
        messages = [1024 * 4 ** i for i in range(11)]
    else:
        sides = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
        bf16_top, arrays = 512, [4096 * 4 ** i for i in range(8)]
        messages = [1024 * 4 ** i for i in range(9)]
    points = [Point((name,), 1) for name in SCALARS]
    for dtype, top in (("f32", sides[-1]), ("bf16", bf16_top)):
        points += [Point(("dot", dtype), 2 * s ** 3, shape) for s in sides if s <= top
                   for shape in dot_shapes(s)]
    points += [Point(("elementwise",), 2 * b) for b in arrays]
    points += [Point(("reduce",), b) for b in arrays]
    groups = [("intra_node", (1, g)) for g in group_sizes(k)]
    groups += [("inter_node", (g, 1)) for g in group_sizes(nodes)]
    if nodes > 1 and k > 1 and not quick:  # all N·K devices; K groups of N ranks at once
        groups += [("inter_node", (nodes, k)), ("inter_node_shared", (nodes, k))]
    phase = collective_phase(nodes)
    for link, (ranks, per) in groups:
        for kind in _kinds(link, ranks, nodes):
            g = ranks if link == "inter_node_shared" else ranks * per
            points += [Point(("collectives", link, kind, str(g)), collective_bytes(b, g),
                             (ranks, per), phase)
                       for b in (messages[::2] if kind == COMBINED and not quick else messages)
                       if phase == "local" or b <= ACROSS_MAX_BYTES["gpu" if gpu else "cpu"]
                       if kind != COMBINED or b <= COMBINED_MAX_BYTES * (64 if gpu else 1)]
    for link, present in (("intra_node", k > 1), ("inter_node", nodes > 1)):
        points += [Point(("send", link), b) for b in messages] if present else []
    total = nodes * k
    points += [Point(("concurrency",), busy) for busy in [1] + group_sizes(total)] \
        if total > 1 else []
    if total > 1 and not gpu:  # devices that share a host's cores: the compute tables alone
        # every other size, but all of --quick's three (a dot's work per kernel makes the
        # smallest row's time a floor: two rows 4000x apart interpolate poorly between them)
        points += [Point(("alone", "dot"), 2 * s ** 3, shape)
                   for s in (sides if quick else sides[::2])
                   if s <= ALONE_MAX_SIDE for shape in dot_shapes(s)]
        points += [Point(("alone", name), unit * b) for b in arrays[::2]
                   for name, unit in (("elementwise", 2), ("reduce", 1))]
    return points
