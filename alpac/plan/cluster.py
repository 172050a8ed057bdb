"""The cluster a plan is made for: devices, their speed and memory, and the links between them.

A cluster file (YAML) has these keys, all required unless marked optional:

    name: aws-p3.16xlarge-x8
    nodes: 8                        # whole number, 1 to DEVICES_MAX (with devices_per_node)
    devices_per_node: 8             # whole number, 1 to DEVICES_MAX
    device:
      name: V100-SXM2-16GB
      memory: 16GiB                 # size
      flops: {f32: 15.7e12, f16: 125T}   # peak FLOP/s per HLO element type (plus tf32)
      memory_bandwidth: 900GB/s     # optional: the device's own memory (HBM)
    links:
      intra_node: {bandwidth: 150GB/s, latency: 5us}
      inter_node: {bandwidth: 25Gbit/s, latency: 20us}   # optional when nodes is 1
    efficiency:                     # optional: the share of each peak programs get, 0.001-1
      dot: 0.75                     #   matmuls and convolutions, of device.flops
      memory: 0.85                  #   fused elementwise and reduce kernels, of memory_bandwidth
      intra_node: 0.8               #   collectives and sends, of that link's bandwidth
      inter_node: 0.8               #   (each key optional; a missing one is 1: the peak)
    calibration: ...                # optional: measured tables (alpac calibrate;
                                    # alpac/plan/calibration.py)

Units (a plain number is in base units: bytes, bytes/s, seconds, FLOP/s; a space may separate
number and unit):
- size: B, KB, MB, GB, TB, PB (powers of 1000), KiB, MiB, GiB, TiB, PiB (powers of 1024);
- bandwidth: a size per second (150GB/s, 1.5GiB/s) or bits per second (bit/s, Kbit/s, Mbit/s,
  Gbit/s, Tbit/s, Gbps, Mbps);
- latency: ns, us (or µs), ms, s;
- flops: a prefix K, M, G, T or P, alone or followed by FLOP/s or FLOPS (125T, 15.7 TFLOP/s).

Each figure must lie in its physical range (FIGURE_RANGES), and the file within the bounds of
a cluster file (CLUSTER_BYTES_MAX, YAML_DEPTH_MAX, YAML_VALUES_MAX).

Devices are numbered node-major: device d is on node d // devices_per_node.
Mistakes raise `UserError` naming the file, the line of the offending key and its key path.

Without a cluster file alpac plans for the local machine as XLA's virtual CPU devices
(`default_cluster`); the environment variable ALPAC_CLUSTER=path replaces that default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, NoReturn

import yaml

from alpac.errors import UserError
from alpac.plan.calibration import Calibration, read_calibration

#: Number of virtual CPU devices alpac plans for by default (XLA's
#: --xla_force_host_platform_device_count=8).
DEFAULT_CPU_DEVICES = 8
#: Per-device f32 throughput of the default cluster: a fixed estimate of one core's vectorized
#: throughput, not a measurement, so that plans are the same on every run on a machine.
DEFAULT_CPU_FLOPS = 20e9
#: The default cluster's devices are threads in one process: links are in-memory copies.
DEFAULT_CPU_LINK_BANDWIDTH = 10e9
DEFAULT_CPU_LINK_LATENCY = 2e-6

# Bounds on a cluster file, far past any real one (a calibrated file is ~10 kB, ~2,000 values,
# 6 levels deep): a small hostile file is refused in one line, not expanded without end.
CLUSTER_BYTES_MAX = 1 << 20
YAML_DEPTH_MAX = 64
YAML_VALUES_MAX = 100_000  # with aliases expanded
# Physical ranges of its figures, far outside any real hardware but finite, so that no absurd
# number (1e-300, 1e300) reaches the ILP solver: kind: (least, most, base unit).
FIGURE_RANGES = {"size": (1e6, 1e16, "bytes"), "bandwidth": (1e3, 1e18, "bytes/s"),
                 "latency": (0.0, 10.0, "s"), "flops": (1e6, 1e18, "FLOP/s")}
DEVICES_MAX = 1_000_000  # nodes, devices per node, and both multiplied
EFFICIENCY_MIN = 1e-3  # the least share of a peak programs get


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s
    latency: float  # s


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory: int  # bytes
    flops: dict[str, float]  # peak FLOP/s per element type
    memory_bandwidth: float | None = None  # bytes/s


@dataclass(frozen=True)
class Efficiency:
    """What programs get of each datasheet peak (from published measurements, where a file
    describes hardware nobody here has calibrated): large matmuls run at a fraction of peak
    FLOP/s, fused kernels at a fraction of the memory bandwidth, collectives at a fraction of
    the link. 1 is the peak itself."""

    dot: float = 1.0
    memory: float = 1.0
    intra_node: float = 1.0
    inter_node: float = 1.0


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: Link
    inter_node: Link
    calibration: Calibration | None = None  # measured tables (`alpac calibrate`), if any
    efficiency: Efficiency = Efficiency()

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def is_cpu(self) -> bool:
        """Whether the devices are XLA's CPU devices (named `cpu`, as in the default cluster
        and the files `alpac calibrate` writes on CPUs): XLA's CPU backend fuses otherwise
        than its GPU backend (alpac.analysis.fusion)."""
        return self.device.name.lower() == "cpu"

    def cut(self, devices: int) -> Cluster | None:
        """The first `devices` devices as a cluster of their own (part of the first node, or
        whole nodes), or None where they are neither: what a plan that leaves the rest idle
        runs on."""
        per = self.devices_per_node
        if devices == self.num_devices:
            return self
        if devices < 1 or devices > self.num_devices or (devices > per and devices % per):
            return None
        return dataclasses.replace(self, nodes=max(1, devices // per),
                                   devices_per_node=min(devices, per))

    def node_of(self, device_id: int) -> int:
        if not 0 <= device_id < self.num_devices:
            raise ValueError(f"device {device_id} out of range 0..{self.num_devices - 1}")
        return device_id // self.devices_per_node

    def link_kind(self, a: int, b: int) -> str:
        """"intra_node" between devices of one node, else "inter_node"."""
        return "intra_node" if self.node_of(a) == self.node_of(b) else "inter_node"

    def link(self, a: int, b: int) -> Link:
        return getattr(self, self.link_kind(a, b))

    def effective_link(self, kind: str) -> Link:
        """The intra_node or inter_node link at the bandwidth programs get."""
        link = getattr(self, kind)
        return Link(link.bandwidth * getattr(self.efficiency, kind), link.latency)

    def dot_flops(self, dtype: str) -> float:
        """FLOP/s a large matmul of `dtype` gets."""
        return self.peak_flops(dtype) * self.efficiency.dot

    @property
    def memory_throughput(self) -> float | None:
        """Bytes/s a fused kernel gets from device memory, if the file gives the bandwidth."""
        bandwidth = self.device.memory_bandwidth
        return bandwidth * self.efficiency.memory if bandwidth else None

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for an HLO element type. A type the file does not list borrows the
        figure of the type the hardware would run it as; failing that, the smallest figure
        listed, so that an estimate is never optimistic."""
        flops = self.device.flops
        if dtype in ("bf16", "f16"):
            similar = ("bf16", "f16")
        elif dtype.startswith(("f8", "f4")):
            similar = ("f16", "bf16")
        elif dtype in ("pred", "c64") or dtype.startswith(("s", "u")):
            similar = ("f32",)
        else:
            similar = ()
        for name in (dtype, *similar):
            if name in flops:
                return flops[name]
        return min(flops.values())

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers in base units (bytes, bytes/s, seconds, FLOP/s); `from_dict` reads it."""
        device: dict[str, Any] = {"name": self.device.name, "memory": self.device.memory,
                                  "flops": dict(self.device.flops)}
        if self.device.memory_bandwidth is not None:
            device["memory_bandwidth"] = self.device.memory_bandwidth
        out = {"name": self.name, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
               "device": device,
               "links": {"intra_node": _link_dict(self.intra_node),
                         "inter_node": _link_dict(self.inter_node)}}
        if self.efficiency != Efficiency():
            out["efficiency"] = dict(vars(self.efficiency))
        if self.calibration is not None:
            out["calibration"] = self.calibration.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Any, path: str = "<dict>") -> Cluster:
        return _Reader(path, {}).cluster(d)


def load_cluster(path: str | Path) -> Cluster:
    data, marks = read_cluster_file(path)
    return _Reader(str(path), marks).cluster(data)


def read_cluster_file(path: str | Path) -> tuple[Any, dict[tuple[str, ...], tuple[int, int]]]:
    """The YAML of a cluster file, unchecked, and the (line, column) of each key path in it;
    UserError if it is unreadable, not YAML, or past the bounds of a cluster file (its size,
    depth, values with aliases expanded: `_BoundedLoader`)."""
    p = Path(path)
    if not p.exists():
        raise UserError("no such file; expected a cluster spec (YAML)", path=str(path))
    if p.is_dir():
        raise UserError("is a directory; expected a cluster spec file (YAML)", path=str(path))
    try:
        with open(p, "rb") as f:
            raw = f.read(CLUSTER_BYTES_MAX + 1)
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError("not UTF-8 text; expected a cluster spec (YAML)", path=str(path)) from None
    except OSError as e:
        raise UserError(f"cannot read: {e.strerror}", path=str(path)) from None
    if len(raw) > CLUSTER_BYTES_MAX:
        raise UserError(f"larger than {CLUSTER_BYTES_MAX >> 20} MiB, the most a cluster file "
                        f"may be", path=str(path))
    try:
        loader = _BoundedLoader(text, str(path))
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else _line_col(text, e)
        problem = ": ".join(filter(None, [getattr(e, "context", None),
                                          getattr(e, "problem", None)]))
        raise UserError(f"invalid YAML: {problem or str(e).splitlines()[0]}", path=str(path),
                        line=line, col=col) from None
    if node is None:
        raise UserError(f"empty file; expected a cluster spec with keys {', '.join(_TOP)}",
                        path=str(path), line=1, col=1)
    marks: dict[tuple[str, ...], tuple[int, int]] = {(): (node.start_mark.line + 1,
                                                          node.start_mark.column + 1)}
    _collect_marks(node, (), marks, str(path))
    return data, marks


class _BoundedLoader(yaml.SafeLoader):
    """YAML's safe loader within the bounds of a cluster file: at most YAML_DEPTH_MAX levels
    and YAML_VALUES_MAX values with aliases expanded (a few hundred bytes of aliases of
    aliases expand to billions), and no alias inside its own anchor. Each node's expanded
    size is known as it is composed, so nothing is expanded to measure it."""

    def __init__(self, text: str, path: str):
        super().__init__(text)
        self.path, self.depth = path, 0
        self.expanded: dict[int, tuple[int, int]] = {}  # id of a node: (values, levels)

    def compose_node(self, parent, index):
        is_alias = self.check_event(yaml.AliasEvent)
        mark = self.peek_event().start_mark
        self.depth += 1
        if self.depth > YAML_DEPTH_MAX:
            self.refuse(mark, f"YAML nested more than {YAML_DEPTH_MAX} levels deep, the most a "
                        f"cluster file may nest")
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if is_alias:
            if id(node) not in self.expanded:
                self.refuse(mark, "recursive YAML alias (inside its own anchor); expected "
                            "an alias of a value defined before it")
            return node
        children = (node.value if isinstance(node, yaml.SequenceNode) else
                    [n for pair in node.value for n in pair]
                    if isinstance(node, yaml.MappingNode) else [])
        values = 1 + sum(self.expanded[id(c)][0] for c in children)
        levels = 1 + max((self.expanded[id(c)][1] for c in children), default=0)
        if levels > YAML_DEPTH_MAX:
            self.refuse(mark, f"YAML nested more than {YAML_DEPTH_MAX} levels deep with its "
                        f"aliases expanded, the most a cluster file may nest")
        if values > YAML_VALUES_MAX:
            self.refuse(mark, f"YAML of more than {YAML_VALUES_MAX:,} values with its aliases "
                        f"expanded, the most a cluster file may hold")
        self.expanded[id(node)] = (values, levels)
        return node

    def refuse(self, mark, message: str) -> NoReturn:
        raise UserError(message, path=self.path, line=mark.line + 1, col=mark.column + 1)

    def construct_yaml_int(self, node):
        """An integer, or a YAML error where Python refuses its thousands of digits."""
        try:
            return super().construct_yaml_int(node)
        except ValueError as e:
            raise yaml.constructor.ConstructorError(None, None, str(e).split(";")[0],
                                                    node.start_mark) from None


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def default_cluster() -> Cluster:
    """The cluster of ALPAC_CLUSTER if set, else the local machine as DEFAULT_CPU_DEVICES virtual
    CPU devices sharing its physical memory equally."""
    override = os.environ.get("ALPAC_CLUSTER")
    if override:
        try:
            return load_cluster(override)
        except UserError as e:
            raise UserError(f"ALPAC_CLUSTER: {e}") from None
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = Link(DEFAULT_CPU_LINK_BANDWIDTH, DEFAULT_CPU_LINK_LATENCY)
    return Cluster("local-cpu", 1, DEFAULT_CPU_DEVICES,
                   DeviceSpec("cpu", memory // DEFAULT_CPU_DEVICES, {"f32": DEFAULT_CPU_FLOPS}),
                   link, link)


def parse_size(text: str, option: str) -> int:
    """A byte count given on the command line (`12GiB`, `3.5e9`); UserError naming `option`."""
    return int(round(_Reader("command line", {}).quantity(text, (option,), "size")))


def _line_col(text: str, e: yaml.YAMLError) -> tuple[int | None, int | None]:
    """Position of a reader error (a bad character), which has an offset instead of a mark."""
    pos = getattr(e, "position", None)
    if pos is None:
        return None, None
    return text.count("\n", 0, pos) + 1, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _link_dict(link: Link) -> dict[str, float]:
    return {"bandwidth": link.bandwidth, "latency": link.latency}


def _collect_marks(node: yaml.Node, keys: tuple[str, ...],
                   marks: dict[tuple[str, ...], tuple[int, int]], path: str) -> None:
    """Record where each key starts, so errors found after construction can point at it; also
    reject duplicate keys, which YAML loaders silently resolve to the last one."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        sub = keys + (str(key_node.value),)
        where = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
        if sub in marks:
            raise UserError(f"{'.'.join(sub)}: duplicate key (first at line {marks[sub][0]})",
                            path=path, line=where[0], col=where[1])
        marks[sub] = where
        _collect_marks(value_node, sub, marks, path)


# Factors are exact fractions so that 5us is 5e-06 s, not 4.9999999999999996e-06.
_DECIMAL = {"": 1, "K": 10**3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_SIZE = {p + "B": f for p, f in (_DECIMAL | _BINARY).items()}
_BANDWIDTH = ({u + "/s": f for u, f in _SIZE.items()}
              | {p + "bit/s": Fraction(f, 8) for p, f in _DECIMAL.items()}
              | {p + "bps": Fraction(f, 8) for p, f in _DECIMAL.items()})
_LATENCY = {"s": 1, "ms": Fraction(1, 10**3), "us": Fraction(1, 10**6), "µs": Fraction(1, 10**6),
            "μs": Fraction(1, 10**6), "ns": Fraction(1, 10**9)}
_FLOPS = {p + s: f for p, f in _DECIMAL.items() for s in ("", "FLOP/s", "FLOPS", "flop/s", "flops")}
# kind: (units, what it is called, how to write it)
_KINDS = {
    "size": (_SIZE, "size", "like 16GiB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; a plain "
             "number is bytes)"),
    "bandwidth": (_BANDWIDTH, "bandwidth", "like 150GB/s (units B/s, MB/s, GB/s, GiB/s, Mbit/s, "
                  "Gbit/s, Gbps; a plain number is bytes/s)"),
    "latency": (_LATENCY, "latency", "like 5us (units ns, us, µs, ms, s; a plain number is "
                "seconds)"),
    "flops": (_FLOPS, "FLOP/s figure", "like 125T, 15.7 TFLOP/s, 312 TFLOPS or 15.7e12 (prefixes "
              "K, M, G, T, P)"),
}
_NUMBER = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*$")

# HLO element types, commonest first for messages, and tf32 (NVIDIA's tensor-core mode for f32)
_FLOPS_TYPES = tuple("f32 bf16 f16 tf32 f8e4m3fn f8e5m2 f64 s8 s32 s4 s16 s64 u8 u4 u16 u32 u64 "
                     "u2 s2 pred c64 c128 f8e4m3fnuz f8e5m2fnuz f8e4m3b11fnuz f8e4m3 f8e3m4 "
                     "f8e8m0fnu f4e2m1fn".split())
_TOP = ("name", "nodes", "devices_per_node", "device", "links")
_OPTIONAL_TOP = ("efficiency", "calibration")
_EFFICIENCY_KEYS = ("dot", "memory", "intra_node", "inter_node")


class _Reader:
    """Checks a loaded cluster spec, turning each mistake into a one-line UserError."""

    def __init__(self, path: str, marks: dict[tuple[str, ...], tuple[int, int]]):
        self.path, self.marks = path, marks

    def cluster(self, d: Any) -> Cluster:
        self.mapping(d, (), _TOP, _OPTIONAL_TOP)
        nodes = self.count(d["nodes"], ("nodes",))
        dev = self.mapping(d["device"], ("device",), ("name", "memory", "flops"),
                           ("memory_bandwidth",))
        flops = self.mapping(dev["flops"], ("device", "flops"), (), _FLOPS_TYPES)
        if not flops:
            self.fail(("device", "flops"),
                      "expected at least one element type, e.g. {f32: 15.7e12}")
        bandwidth = dev.get("memory_bandwidth")
        device = DeviceSpec(
            self.string(dev["name"], ("device", "name")),
            round(self.figure(dev["memory"], ("device", "memory"), "size")),
            {str(t): self.figure(v, ("device", "flops", str(t)), "flops")
             for t, v in flops.items()},
            None if bandwidth is None else self.figure(bandwidth, ("device", "memory_bandwidth"),
                                                       "bandwidth"))
        links = self.mapping(d["links"], ("links",), ("intra_node",), ("inter_node",))
        intra = self.link(links["intra_node"], ("links", "intra_node"))
        if "inter_node" in links:
            inter = self.link(links["inter_node"], ("links", "inter_node"))
        elif nodes == 1:
            inter = intra
        else:
            self.fail(("links", "inter_node"), f"missing key (required when nodes is {nodes})")
        calibration = read_calibration(d["calibration"], self.fail) \
            if "calibration" in d else None
        per_node = self.count(d["devices_per_node"], ("devices_per_node",))
        if nodes * per_node > DEVICES_MAX:
            self.fail(("devices_per_node",), f"{nodes} nodes of {per_node} devices are "
                      f"{nodes * per_node:,} devices; a cluster may have at most {DEVICES_MAX:,}")
        return Cluster(self.string(d["name"], ("name",)), nodes, per_node, device, intra, inter,
                       calibration, self.efficiency(d.get("efficiency", {})))

    def efficiency(self, d: Any) -> Efficiency:
        self.mapping(d, ("efficiency",), (), _EFFICIENCY_KEYS)
        shares = {}
        for key, v in d.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not EFFICIENCY_MIN <= v <= 1:
                self.fail(("efficiency", key), f"expected a share of the peak from "
                          f"{EFFICIENCY_MIN:g} to 1, like 0.8, got {_describe(v)}")
            shares[key] = float(v)
        return Efficiency(**shares)

    def link(self, d: Any, keys: tuple[str, ...]) -> Link:
        self.mapping(d, keys, ("bandwidth", "latency"))
        return Link(self.figure(d["bandwidth"], keys + ("bandwidth",), "bandwidth"),
                    self.figure(d["latency"], keys + ("latency",), "latency"))

    def mapping(self, d: Any, keys: tuple[str, ...], required: tuple[str, ...],
                optional: tuple[str, ...] = ()) -> dict:
        allowed = tuple(dict.fromkeys(required + optional))
        if not isinstance(d, dict):
            self.fail(keys, f"expected a mapping with keys {', '.join(allowed)}, "
                      f"got {_describe(d)}")
        for k in d:
            if k not in allowed:
                self.fail(keys + (str(k),), f"unknown key '{k}'; allowed keys here: "
                          + ", ".join(allowed[:8]) + (", ..." if len(allowed) > 8 else ""))
        for k in required:
            if k not in d:
                self.fail(keys + (k,), "missing key")
        return d

    def string(self, v: Any, keys: tuple[str, ...]) -> str:
        if not isinstance(v, str) or not v.strip():
            self.fail(keys, f"expected a non-empty string, got {_describe(v)}")
        return v

    def count(self, v: Any, keys: tuple[str, ...]) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= DEVICES_MAX:
            self.fail(keys, f"expected a whole number from 1 to {DEVICES_MAX:,}, got "
                      f"{_describe(v)}")
        return v

    def figure(self, v: Any, keys: tuple[str, ...], kind: str) -> float:
        """A quantity within the physical range of its kind (FIGURE_RANGES)."""
        value = self.quantity(v, keys, kind)
        least, most, unit = FIGURE_RANGES[kind]
        if not least <= value <= most:
            self.fail(keys, f"expected a {_KINDS[kind][1]} from {least:g} to {most:g} {unit}, "
                      f"got {_describe(v)}")
        return value

    def quantity(self, v: Any, keys: tuple[str, ...], kind: str) -> float:
        units, noun, hint = _KINDS[kind]
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            value = float(v)
        else:
            m = _NUMBER.fullmatch(v) if isinstance(v, str) else None
            if m is None:
                self.fail(keys, f"expected a {noun} {hint}, got {_describe(v)}")
            number, unit = m.groups()
            if unit and unit not in units:
                self.fail(keys, f"unknown unit '{unit}' in '{v}'; expected a {noun} {hint}")
            try:
                value = float(Fraction(number) * units.get(unit, 1))
            except OverflowError:
                value = math.inf
        if kind == "latency":
            if not math.isfinite(value) or value < 0:
                self.fail(keys, f"expected a non-negative latency, got {_describe(v)}")
        elif not math.isfinite(value) or value <= 0 or (kind == "size" and round(value) < 1):
            self.fail(keys, f"expected a positive {noun}, got {_describe(v)}")
        return value

    def fail(self, keys: tuple[str, ...], message: str) -> NoReturn:
        where = keys
        while where not in self.marks and where:
            where = where[:-1]
        line, col = self.marks.get(where, (None, None))
        raise UserError(f"{'.'.join(keys) or '(top level)'}: {message}", path=self.path,
                        line=line, col=col)


def _describe(v: Any) -> str:
    if v is None:
        return "nothing (null)"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, int) and v.bit_length() > 128:  # (repr refuses thousands of digits)
        return f"an integer of {v.bit_length()} bits"
    if isinstance(v, (int, float, str)):
        return repr(v)
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return f"a {type(v).__name__}"
