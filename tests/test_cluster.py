"""Cluster spec: example files, units, validation messages, the local default."""

import copy
import json
import os
import re

import pytest
from conftest import TESTDATA

from alpac.errors import UserError
from alpac.plan.cluster import (Cluster, DeviceSpec, Efficiency, Link, default_cluster,
                                load_cluster)

CLUSTERS = TESTDATA / "clusters"

SPEC = """\
name: test
nodes: 2
devices_per_node: 4
device:
  name: gpu
  memory: 16GiB
  flops: {f32: 15.7e12, f16: 125e12}
links:
  intra_node: {bandwidth: 150GB/s, latency: 5us}
  inter_node:
    bandwidth: 25Gbit/s
    latency: 20us
"""

BASE = {"name": "t", "nodes": 2, "devices_per_node": 4,
        "device": {"name": "gpu", "memory": "16GiB", "flops": {"f32": "15.7e12"}},
        "links": {"intra_node": {"bandwidth": "150GB/s", "latency": "5us"},
                  "inter_node": {"bandwidth": "25Gbit/s", "latency": "20us"}}}


@pytest.mark.parametrize("name", ["aws-p3.16xlarge-x8", "dgx-a100-x4", "dgx-h100-x4",
                                  "local-cpu"])
def test_examples_load_and_round_trip(name):
    c = load_cluster(CLUSTERS / f"{name}.yaml")
    assert c.name == name
    d = c.to_dict()
    assert Cluster.from_dict(json.loads(json.dumps(d))) == c
    assert Cluster.from_dict(d).to_dict() == d


def test_paper_cluster():
    c = load_cluster(CLUSTERS / "aws-p3.16xlarge-x8.yaml")
    assert c.num_devices == 64
    assert c.device.memory == 16 * 2**30
    assert c.device.flops == {"f32": 15.7e12, "f16": 125e12}
    assert c.intra_node == Link(150e9, 5e-6)
    assert c.inter_node == Link(25e9 / 8, 20e-6)
    assert [c.node_of(i) for i in (0, 7, 8, 63)] == [0, 0, 1, 7]
    assert c.link(0, 7) is c.intra_node and c.link(7, 8) is c.inter_node
    with pytest.raises(ValueError):
        c.node_of(64)


def test_published_efficiency_scales_the_peaks():
    """The V100, A100 and H100 files carry the share of each peak published measurements got;
    a file without `efficiency:` prices at the peaks."""
    for name in ("aws-p3.16xlarge-x8", "dgx-a100-x4", "dgx-h100-x4"):
        c = load_cluster(CLUSTERS / f"{name}.yaml")
        shares = vars(c.efficiency)
        assert all(0.5 <= v < 1 for v in shares.values()), (name, shares)
        assert c.dot_flops("f16") == c.peak_flops("f16") * c.efficiency.dot
        assert c.memory_throughput == c.device.memory_bandwidth * c.efficiency.memory
        link = c.effective_link("inter_node")
        assert (link.bandwidth, link.latency) == (c.inter_node.bandwidth * c.efficiency.inter_node,
                                                  c.inter_node.latency)
    plain = Cluster.from_dict(BASE)
    assert plain.efficiency == Efficiency() and plain.dot_flops("f32") == 15.7e12
    assert plain.memory_throughput is None and "efficiency" not in plain.to_dict()
    partial = Cluster.from_dict(BASE | {"efficiency": {"inter_node": 0.5}})
    assert partial.efficiency == Efficiency(inter_node=0.5)
    assert partial.effective_link("intra_node") == partial.intra_node


@pytest.mark.parametrize("efficiency, message", [
    ({"dot": 1.5},
     r"efficiency\.dot: expected a share of the peak from 0\.001 to 1, like 0\.8, got 1\.5"),
    ({"dot": 0}, r"efficiency\.dot: expected a share"),
    ({"memory": "90%"}, r"efficiency\.memory: expected a share .* got '90%'"),
    ({"network": 0.5}, r"efficiency\.network: unknown key 'network'; allowed keys here: dot, "),
    ([0.5], r"efficiency: expected a mapping"),
])
def test_efficiency_errors(efficiency, message):
    with pytest.raises(UserError, match=message):
        Cluster.from_dict(BASE | {"efficiency": efficiency})


def test_peak_flops_fallbacks():
    c = load_cluster(CLUSTERS / "aws-p3.16xlarge-x8.yaml")
    assert c.peak_flops("f32") == 15.7e12
    assert c.peak_flops("bf16") == 125e12      # runs as f16
    assert c.peak_flops("f8e4m3fn") == 125e12  # upcast to f16
    assert c.peak_flops("s32") == 15.7e12
    assert c.peak_flops("pred") == 15.7e12
    assert c.peak_flops("f64") == 15.7e12      # unlisted: the smallest figure
    a100 = load_cluster(CLUSTERS / "dgx-a100-x4.yaml")
    assert a100.peak_flops("bf16") == 312e12
    bf16_only = Cluster.from_dict(BASE | {"device": BASE["device"] | {"flops": {"bf16": 1e12}}})
    assert bf16_only.peak_flops("f16") == 1e12


@pytest.mark.parametrize("key, text, expected", [
    ("memory", "16GiB", 16 * 2**30),
    ("memory", "16 GiB", 16 * 2**30),
    ("memory", "1.5GiB", 3 * 2**29),
    ("memory", "80GB", 80 * 10**9),
    ("memory", "512MiB", 2**29),
    ("memory", "2000KB", 2 * 10**6),
    ("memory", "3000KiB", 3072000),
    ("memory", "1TB", 10**12),
    ("memory", "1TiB", 2**40),
    ("memory", "100000000B", 10**8),
    ("memory", 17179869184, 17179869184),
    ("memory", "1e9", 10**9),
    ("memory_bandwidth", "150GB/s", 150e9),
    ("memory_bandwidth", "1.5GiB/s", 1.5 * 2**30),
    ("memory_bandwidth", "100MB/s", 100e6),
    ("memory_bandwidth", "25Gbit/s", 25e9 / 8),
    ("memory_bandwidth", "25 Gbit/s", 25e9 / 8),
    ("memory_bandwidth", "100Mbit/s", 100e6 / 8),
    ("memory_bandwidth", "1Tbit/s", 1e12 / 8),
    ("memory_bandwidth", "8Kbit/s", 1000.0),
    ("memory_bandwidth", "200Gbps", 25e9),
    ("memory_bandwidth", "800Mbps", 100e6),
    ("memory_bandwidth", 2e9, 2e9),
    ("latency", "5us", 5e-6),
    ("latency", "5 µs", 5e-6),
    ("latency", "100ns", 100e-9),
    ("latency", "1.5ms", 1.5e-3),
    ("latency", "2s", 2.0),
    ("latency", 0, 0.0),
    ("latency", "1e-5", 1e-5),
    ("f32", "15.7e12", 15.7e12),
    ("f32", 25e12, 25e12),
    ("f32", "125T", 125e12),
    ("f32", "15.7 TFLOP/s", 15.7e12),
    ("f32", "312 TFLOPS", 312e12),
    ("f32", "900G", 900e9),
    ("f32", "2PFLOP/s", 2e15),
])
def test_units(key, text, expected):
    d = copy.deepcopy(BASE)
    if key == "latency":
        d["links"]["intra_node"]["latency"] = text
        got = Cluster.from_dict(d).intra_node.latency
    elif key == "f32":
        d["device"]["flops"]["f32"] = text
        got = Cluster.from_dict(d).peak_flops("f32")
    else:
        d["device"][key] = text
        got = getattr(Cluster.from_dict(d).device, key)
    assert got == expected
    if key == "memory":
        assert isinstance(got, int)


def _edit(old, new):
    assert old in SPEC
    return SPEC.replace(old, new)


# (file text, key path the message must name or None, line, part of the message)
ERRORS = [
    (_edit("nodes: 2\n", ""), "nodes", 1, "missing key"),
    (_edit("    latency: 20us\n", ""), "links.inter_node.latency", 10, "missing key"),
    (_edit("  name: gpu\n", "  name: gpu\n  colour: green\n"), "device.colour", 6,
     "allowed keys here: name, memory, flops, memory_bandwidth"),
    (_edit("f16:", "fp16:"), "device.flops.fp16", 7, "unknown key 'fp16'"),
    (_edit("25Gbit/s", "25Gbitps"), "links.inter_node.bandwidth", 11, "unknown unit 'Gbitps'"),
    (_edit("16GiB", "16Gigs"), "device.memory", 6, "GiB"),
    (_edit("5us", "5 fortnights"), "links.intra_node.latency", 9, "unknown unit"),
    (_edit("125e12", "125Q"), "device.flops.f16", 7, "TFLOP/s"),
    (_edit("16GiB", "-16GiB"), "device.memory", 6, "positive size"),
    (_edit("16GiB", "0"), "device.memory", 6, "positive size"),
    (_edit("25Gbit/s", "0Gbit/s"), "links.inter_node.bandwidth", 11, "positive bandwidth"),
    (_edit("20us", "-1us"), "links.inter_node.latency", 12, "non-negative latency"),
    (_edit("15.7e12", "-1"), "device.flops.f32", 7, "positive FLOP/s figure"),
    (_edit("nodes: 2", "nodes: 0"), "nodes", 2, "whole number from 1 to 1,000,000"),
    (_edit("devices_per_node: 4", "devices_per_node: -4"), "devices_per_node", 3,
     "whole number from 1 to 1,000,000"),
    (_edit("nodes: 2", "nodes: two"), "nodes", 2, "1,000,000, got 'two'"),
    (_edit("nodes: 2", "nodes: 2.5"), "nodes", 2, "whole number from 1 to 1,000,000"),
    (_edit("16GiB", "[16, GiB]"), "device.memory", 6, "got a list"),
    (_edit("name: gpu", "name: [gpu]"), "device.name", 5, "expected a non-empty string"),
    (_edit("  intra_node: {bandwidth: 150GB/s, latency: 5us}", "  intra_node: fast"),
     "links.intra_node", 9, "expected a mapping with keys bandwidth, latency"),
    (_edit("flops: {f32: 15.7e12, f16: 125e12}", "flops: {}"), "device.flops", 7,
     "at least one"),
    (_edit("  inter_node:\n    bandwidth: 25Gbit/s\n    latency: 20us\n", ""),
     "links.inter_node", 8, "required when nodes is 2"),
    (_edit("nodes: 2\n", "nodes: 2\nnodes: 3\n"), "nodes", 3, "duplicate key"),
    (_edit("memory: 16GiB", "memory: 16GiB: 2"), None, 6, "invalid YAML"),
    (_edit("  flops: {f32: 15.7e12, f16: 125e12}", "  flops: {f32: 15.7e12"), None, 8,
     "invalid YAML"),
    (_edit("name: gpu", "name: g\x07pu"), None, 5, "invalid YAML: unacceptable character"),
    (SPEC + "---\nname: second\n", None, 13, "invalid YAML"),
    ("- just\n- a list\n", "(top level)", 1, "expected a mapping with keys name, nodes"),
    ("", None, 1, "empty file"),
    ("# only a comment\n", None, 1, "empty file"),
]


@pytest.mark.parametrize("text, keys, line, what", ERRORS)
def test_errors(tmp_path, text, keys, line, what):
    f = tmp_path / "cluster.yaml"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(UserError) as e:
        load_cluster(f)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{f}:{line}:"), msg
    assert e.value.line == line
    if keys is not None:
        assert re.search(rf":\d+: {re.escape(keys)}: ", msg), msg
    assert what in msg, msg


def test_error_column_points_at_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(_edit("25Gbit/s", "25Gbitps"))
    with pytest.raises(UserError) as e:
        load_cluster(f)
    assert (e.value.line, e.value.col) == (11, 5)


def test_missing_path_and_directory(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(UserError, match=re.escape(f"{missing}: no such file")):
        load_cluster(missing)
    with pytest.raises(UserError, match=re.escape(f"{tmp_path}: is a directory")):
        load_cluster(tmp_path)


def test_from_dict_errors_name_the_key():
    d = copy.deepcopy(BASE)
    d["links"]["inter_node"]["bandwidth"] = "fast"
    with pytest.raises(UserError, match=r"^<dict>: links\.inter_node\.bandwidth: expected a "):
        Cluster.from_dict(d)


def test_single_node_may_omit_inter_node():
    d = copy.deepcopy(BASE)
    d["nodes"] = 1
    del d["links"]["inter_node"]
    c = Cluster.from_dict(d)
    assert c.inter_node == c.intra_node


def test_default_cluster(monkeypatch):
    monkeypatch.delenv("ALPAC_CLUSTER", raising=False)
    c = default_cluster()
    assert (c.name, c.nodes, c.devices_per_node, c.num_devices) == ("local-cpu", 1, 8, 8)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert c.device == DeviceSpec("cpu", physical // 8, {"f32": 20e9})
    assert c.intra_node == c.inter_node == Link(10e9, 2e-6)
    assert Cluster.from_dict(c.to_dict()) == c
    assert default_cluster() == c
    example = load_cluster(CLUSTERS / "local-cpu.yaml")
    assert example.to_dict() | {"device": None} == c.to_dict() | {"device": None}
    assert example.device == DeviceSpec("cpu", 3 * 2**30, {"f32": 20e9})


def test_alpac_cluster_overrides_default(monkeypatch, tmp_path):
    monkeypatch.setenv("ALPAC_CLUSTER", str(CLUSTERS / "dgx-a100-x4.yaml"))
    assert default_cluster() == load_cluster(CLUSTERS / "dgx-a100-x4.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(_edit("nodes: 2\n", ""))
    monkeypatch.setenv("ALPAC_CLUSTER", str(bad))
    with pytest.raises(UserError, match=re.escape(f"ALPAC_CLUSTER: {bad}:1:1: nodes: missing")):
        default_cluster()
