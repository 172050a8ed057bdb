"""Measured cost tables of a cluster (the `calibration:` section of cluster.yaml, written by
`alpac calibrate`): what programs get, not what the hardware promises.

Peak FLOP/s and link bandwidth overstate what a program gets: large matmuls run at a fraction
of peak, small ones are bound by launching them, elementwise work by memory, collectives by a
size-dependent share of the link. Each table is [size, seconds] rows (size ascending: FLOPs
for dots, devices working at once for `concurrency`, bytes otherwise) of work inside one
module execution (launching the module is `launch_s`, counted per execution). A size between
two rows is interpolated in log-log space (a power law between neighbours), a size past the
last row costs the last row's throughput (seconds grow in proportion), and one below the
first row follows the first segment's power law, its exponent kept within [0, 1] (never
cheaper per byte than larger work, never below zero).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

# combined-all-reduce: one operand of an all-reduce of COMBINED_OPERANDS, as XLA's combiner
# merges a step's independent all-reduces (the bytes are the operand's)
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute", "combined-all-reduce")
COMBINED_OPERANDS = 8
LINK_KINDS = ("intra_node", "inter_node")
# the collective tables' links: inter_node_shared is groups across nodes, one per device of a
# node, all at once (data parallelism across nodes beside tensor parallelism inside them)
COLLECTIVE_LINKS = LINK_KINDS + ("inter_node_shared",)
# one figure each (the field comments)
SCALARS = ("launch_s", "flop_s", "transcendental_s", "array_s", "launch_alone_s",
           "array_alone_s", "feed_s", "free_s", "launch_cpu_s", "launch_cpu_alone_s",
           "pause_cpu_s", "pause_s", "argument_s", "argument_alone_s", "matrix_s")
# How alpa-run's ranks wait for a message (alpac.runtime.comm): polled, sleeping between two
# polls, the first sleep this long, each next one longer by this factor up to the longest.
POLL_FIRST_S, POLL_GROWTH, POLL_LONGEST_S = 2e-5, 1.5, 1e-3


HOST_COUNTS = ("ranks_per_host", "host_cores")
# Ranges of the section's figures, far outside any measurement but finite, so that no absurd
# number (1e300) reaches the ILP solver: seconds of a figure or a row; a row's size (FLOPs,
# bytes or devices); a host count or a collective's group size.
SECONDS_MAX = 1e4
SIZE_MIN, SIZE_MAX = 1.0, 1e30
COUNT_MAX = 1_000_000
# the compute tables measured again on one device alone (`Calibration.alone`)
ALONE_TABLES = ("dot", "elementwise", "reduce")


@dataclass(frozen=True)
class Table:
    """Seconds against a size, from measured rows."""

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __call__(self, size: float) -> float:
        if size <= 0:
            return 0.0
        xs, ys = self.sizes, self.seconds
        if len(xs) == 1 or size >= xs[-1]:
            return ys[-1] * size / xs[-1]
        if size <= xs[0]:
            slope = min(max(_slope(xs[0], ys[0], xs[1], ys[1]), 0.0), 1.0)
            return ys[0] * (size / xs[0]) ** slope
        k = bisect.bisect_right(xs, size) - 1
        slope = _slope(xs[k], ys[k], xs[k + 1], ys[k + 1])
        return ys[k] * (size / xs[k]) ** slope

    def to_rows(self) -> list[list[float]]:
        return [[x, y] for x, y in zip(self.sizes, self.seconds)]


def _slope(x0: float, y0: float, x1: float, y1: float) -> float:
    return math.log(y1 / y0) / math.log(x1 / x0)


@dataclass(frozen=True)
class Calibration:
    """Every table `alpac calibrate` measures; any may be missing (then the roofline and the
    alpha-beta links price that work)."""

    source: str = ""
    launch_s: float = 0.0  # launching one module execution and waiting for it
    flop_s: float = 0.0  # one elementwise arithmetic op on one element, in cache
    transcendental_s: float = 0.0  # one exp, log, sqrt, ... on one element, in cache
    array_s: float = 0.0  # beyond launch_s, each array an execution returns (`host_seconds`)
    # the same two on one device of one rank, every other device idle (`host_seconds`)
    launch_alone_s: float = 0.0
    array_alone_s: float = 0.0
    feed_s: float = 0.0  # an input copied from the host onto a rank's devices
    free_s: float = 0.0  # an array freed as alpa-run frees them, between modules
    # CPU time, all of a rank's threads, of launching a module execution after the rank sat
    # idle (as a pipeline's ranks launch each module after a wait), on its devices and on one
    # device alone; a shared CPU pays it, and only there does it price anything
    # (`host_cores_seconds`)
    launch_cpu_s: float = 0.0
    launch_cpu_alone_s: float = 0.0
    pause_cpu_s: float = 0.0  # CPU time of one of the polling's sleeps (POLL_FIRST_S long)
    pause_s: float = 0.0  # how long that sleep lasts
    # beyond launch_s, each argument an execution takes as alpa-run hands it over; every
    # device working, and on one alone (0 in files before it: their array_s has one in it)
    argument_s: float = 0.0
    argument_alone_s: float = 0.0
    # beyond a dot's FLOPs, each matrix of a batched dot whose lhs holds its matrices
    # transposed (a backward pass's attention), which XLA's CPU backend runs in a loop of
    # its own (`dot_seconds`; 0 in files before it)
    matrix_s: float = 0.0
    dot: dict[str, Table] = field(default_factory=dict)  # element type -> FLOPs table
    elementwise: Table | None = None  # bytes read + written by a fused elementwise chain
    reduce: Table | None = None  # bytes read
    # link kind -> collective kind -> group size -> bytes table
    collectives: dict[str, dict[str, dict[int, Table]]] = field(default_factory=dict)
    send: dict[str, Table] = field(default_factory=dict)  # link kind -> bytes table
    # devices working at once -> seconds of one device's same dot: where devices share a
    # host's cores (virtual CPU devices), fewer at once are each faster; the other tables
    # were measured with every device working (the last row)
    concurrency: Table | None = None
    # the f32 dot, elementwise and reduce tables again on rank 0's first device, every other
    # device idle: where devices share cores, small kernels gain less from working alone than
    # the concurrency table's dot (`alone_tables`)
    alone: dict[str, Table] = field(default_factory=dict)
    # where several ranks share a host: how many ran on each (consecutive nodes of the
    # cluster), and the cores they shared (0: not recorded; `host_cores_seconds`)
    ranks_per_host: int = 0
    host_cores: int = 0

    @property
    def devices_share_cores(self) -> bool:
        """Whether a device works at least twice as fast alone (the concurrency table):
        virtual CPU devices share their host's cores, GPUs do not."""
        return self.concurrency is not None and self.compute_share(1) <= 0.5

    def compute_share(self, busy: int) -> float:
        """What one device's work costs when `busy` devices work at once, against the tables'
        every-device figures (1 without the table, or with as many devices busy)."""
        table = self.concurrency
        if table is None or busy >= table.sizes[-1]:
            return 1.0
        return min(1.0, table(busy) / table.seconds[-1])

    def host_seconds(self, arrays: int, busy: int, arguments: int = 0) -> float:
        """Launching a module execution that takes `arguments` arrays and returns `arrays`
        with `busy` devices working at once: measured with every device working and with one
        alone, in between as the compute share goes (`toward_every`; without the one-alone
        figures, the compute share of the every-device ones). The host's work does not speed
        up as devices' compute does: on this machine a one-device GPT step's 206 arrays took
        1.5 ms alone, 3.1 ms with all 8 devices working, and the compute share (6.3x) would
        have priced them at 0.49 ms."""
        every = self.launch_s + self.array_s * arrays + self.argument_s * arguments
        if not self.launch_alone_s:
            return every * self.compute_share(busy)
        alone = self.launch_alone_s + self.array_alone_s * arrays + \
            self.argument_alone_s * arguments
        return between(alone, every, self.toward_every(busy))

    def toward_every(self, busy: int) -> float:
        """Where `busy` devices working at once lie between one alone (0) and every device
        working (1), as the compute share goes (`between`)."""
        share = self.compute_share(busy)
        if share >= 1.0:
            return 1.0
        least = self.compute_share(1)
        return (share - least) / (1.0 - least)

    def alone_tables(self) -> Calibration | None:
        """These tables as one device working alone gets them (None where not measured): its
        dot, elementwise and reduce tables; another element type's dots and the per-op
        arithmetic at the f32 dot's speed-up at the same size (the concurrency share)."""
        if set(self.alone) != set(ALONE_TABLES):
            return None
        f32, alone = self.dot.get("f32"), self.alone["dot"]
        dot = {t: table if f32 is None or t == "f32" else
               Table(table.sizes, tuple(y * alone(x) / f32(x)
                                        for x, y in zip(table.sizes, table.seconds)))
               for t, table in self.dot.items()}
        least = self.compute_share(1)
        return replace(self, dot={**dot, "f32": alone}, elementwise=self.alone["elementwise"],
                       reduce=self.alone["reduce"], flop_s=self.flop_s * least,
                       transcendental_s=self.transcendental_s * least,
                       matrix_s=self.matrix_s * least, alone={})

    def dot_seconds(self, flops: float, dtype: str, matrices: float = 0.0) -> float | None:
        """A dot of `flops` FLOPs (None without a dot table), `matrices` of them the matrices
        of a batched dot whose lhs holds them transposed (`matrix_s` each)."""
        table = self.dot.get(dtype) or self.dot.get("f32")
        return None if table is None else table(flops) + matrices * self.matrix_s

    def collective_seconds(self, link: str, kind: str, group: int, nbytes: float,
                           ring) -> float | None:
        """From the table of this group size, or of the nearest measured one scaled by the
        ring formula `ring(n)` (the alpha-beta estimate for a group of n)."""
        by_group = self.collectives.get(link, {}).get(kind)
        if not by_group:
            return None
        if group in by_group:
            return by_group[group](nbytes)
        near = min(by_group, key=lambda n: (abs(math.log(n / group)), n))
        return by_group[near](nbytes) * ring(group) / ring(near)

    def shared_seconds(self, kind: str, group: int, nbytes: float, sharing: int,
                       per_node: int, ring) -> float | None:
        """A collective whose `sharing` groups of `group` cross the nodes' links at once,
        each carrying `nbytes`: the `inter_node_shared` table (`per_node` groups at once,
        one per device of a node) where `sharing` is all of them; fewer in between that and
        one group alone, as a power of `sharing` (None without both tables)."""
        every = self.collective_seconds("inter_node_shared", kind, group, nbytes, ring)
        if every is None or sharing >= per_node:
            return every
        alone = self.collective_seconds("inter_node", kind, group, nbytes, ring)
        if alone is None:
            return None
        return alone * (every / alone) ** (math.log(sharing) / math.log(per_node))

    def to_dict(self) -> dict:
        out: dict = {"source": self.source, "launch_s": self.launch_s}
        # launch_s always; the arithmetic figures where measured (files before them lack them)
        out.update({name: getattr(self, name) for name in SCALARS[1:] if getattr(self, name)})
        if self.dot:
            out["dot"] = {t: table.to_rows() for t, table in self.dot.items()}
        for name in ("elementwise", "reduce"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).to_rows()
        if self.collectives:
            out["collectives"] = {link: {kind: {n: t.to_rows() for n, t in groups.items()}
                                         for kind, groups in kinds.items()}
                                  for link, kinds in self.collectives.items()}
        if self.send:
            out["send"] = {link: t.to_rows() for link, t in self.send.items()}
        if self.concurrency is not None:
            out["concurrency"] = self.concurrency.to_rows()
        if self.alone:
            out["alone"] = {name: table.to_rows() for name, table in self.alone.items()}
        out.update({name: getattr(self, name) for name in HOST_COUNTS if getattr(self, name)})
        return out


def pauses():
    """The sleeps of a rank's wait in alpa-run, one after another: POLL_FIRST_S, each
    POLL_GROWTH times the one before, to POLL_LONGEST_S (a waiting rank leaves the cores to
    the ranks that compute, and still sees a message soon)."""
    pause = POLL_FIRST_S
    while True:
        yield pause
        pause = min(pause * POLL_GROWTH, POLL_LONGEST_S)


def polls(wait: float, late: float) -> int:
    """How many sleeps a rank's wait of `wait` seconds takes (`pauses`), each sleep lasting
    `late` seconds more than asked (a shared CPU's wake-up)."""
    count, slept = 0, 0.0
    for pause in pauses():
        if slept >= wait:
            return count
        count, slept = count + 1, slept + pause + late


def between(alone: float, every: float, toward_every: float) -> float:
    """A figure measured with one device alone and with every device working, for devices
    `toward_every` of the way from the one to the other (`Calibration.toward_every`)."""
    return every if toward_every >= 1.0 else alone + (every - alone) * toward_every


def read_calibration(d, fail) -> Calibration:
    """The section as loaded from YAML; `fail(keys, message)` reports a mistake."""
    keys = ("calibration",)
    _mapping(d, keys, ("source",) + SCALARS + ("dot", "elementwise", "reduce", "collectives",
                                               "send", "concurrency", "alone") + HOST_COUNTS,
             fail)
    scalars = [_seconds(d, name, fail) for name in SCALARS]
    dot = {str(t): _table(rows, keys + ("dot", str(t)), fail)
           for t, rows in _mapping(d.get("dot", {}), keys + ("dot",), None, fail).items()}
    collectives = {}
    for link, kinds in _mapping(d.get("collectives", {}), keys + ("collectives",),
                                COLLECTIVE_LINKS,
                                fail).items():
        where = keys + ("collectives", link)
        collectives[link] = {
            kind: {_group(n, where + (kind, str(n)), fail): _table(rows, where + (kind, str(n)),
                                                                   fail)
                   for n, rows in _mapping(groups, where + (kind,), None, fail).items()}
            for kind, groups in _mapping(kinds, where, COLLECTIVE_KINDS, fail).items()}
    send = {link: _table(rows, keys + ("send", link), fail)
            for link, rows in _mapping(d.get("send", {}), keys + ("send",), LINK_KINDS,
                                       fail).items()}
    alone = {name: _table(rows, keys + ("alone", name), fail)
             for name, rows in _mapping(d.get("alone", {}), keys + ("alone",), ALONE_TABLES,
                                        fail).items()}
    return Calibration(str(d.get("source", "")), *scalars, dot,
                       _optional_table(d, "elementwise", fail),
                       _optional_table(d, "reduce", fail), collectives, send,
                       _optional_table(d, "concurrency", fail), alone,
                       *(_count(d, name, fail) for name in HOST_COUNTS))


def _seconds(d: dict, name: str, fail) -> float:
    try:
        value = _number(d.get(name, 0.0))
    except (TypeError, ValueError):
        value = -1.0
    if not 0 <= value <= SECONDS_MAX:
        fail(("calibration", name), f"expected non-negative seconds up to {SECONDS_MAX:g}, got "
             f"{d[name]!r}")
    return float(value)


def _count(d: dict, name: str, fail) -> int:
    value = d.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= COUNT_MAX:
        fail(("calibration", name), f"expected a whole number >= 0 and <= {COUNT_MAX:,}, got "
             f"{value!r}")
    return value


def _mapping(d, keys, allowed, fail) -> dict:
    if not isinstance(d, dict):
        fail(keys, "expected a mapping")
    for k in d:
        if allowed is not None and k not in allowed:
            fail(keys + (str(k),), f"unknown key '{k}'; allowed: {', '.join(allowed)}")
    return d


def _group(n, keys, fail) -> int:
    """A group size: an integer >= 2 (a string of digits in plan.json's JSON copy)."""
    digits = isinstance(n, str) and n.isascii() and n.isdigit() and len(n) <= len(str(COUNT_MAX))
    size = int(n) if digits else n
    if isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= COUNT_MAX:
        fail(keys, f"expected a group size (an integer from 2 to {COUNT_MAX:,}), got {n!r}")
    return size


def _optional_table(d: dict, name: str, fail) -> Table | None:
    return _table(d[name], ("calibration", name), fail) if name in d else None


def _table(rows, keys, fail) -> Table:
    """[[size, seconds], ...], sizes strictly ascending, every figure positive."""
    try:
        pairs = [(_number(r[0]), _number(r[1])) for r in rows if len(r) == 2]
    except (TypeError, ValueError, KeyError):
        pairs = []
    if not pairs or len(pairs) != len(rows) or not all(
            SIZE_MIN <= x <= SIZE_MAX and 0 < y <= SECONDS_MAX for x, y in pairs):
        fail(keys, f"expected a list of [size, seconds] rows, sizes from {SIZE_MIN:g} to "
             f"{SIZE_MAX:g}, seconds above 0 up to {SECONDS_MAX:g}")
    if any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:])):
        fail(keys, "sizes must be strictly ascending")
    return Table(tuple(x for x, _ in pairs), tuple(y for _, y in pairs))


def _number(v) -> float:
    """A YAML number, or a string YAML 1.1 leaves unparsed (`1e6`, `2.5e9`)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TypeError(v)
    return float(v)
