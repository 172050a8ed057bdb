"""Compiling and running sharded HLO through alpac.xla.bridge (8 virtual CPU devices).

Modules come from `jax.jit(...).lower(...).as_text(dialect="hlo")`; shardings are added by
editing alpac's IR, as alpac's own passes will.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpac.hlo import parse_hlo, print_module
from alpac.xla import bridge as xb

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def hlo(fn, *args, **jit_kwargs) -> str:
    return jax.jit(fn, **jit_kwargs).lower(*args).as_text(dialect="hlo")


def annotate(text: str, params: dict[int, str] | None = None, root: str | None = None,
             opcodes: dict[str, str] | None = None) -> str:
    """Set `sharding=` on entry parameters (by number), the root, or instructions by opcode."""
    module = parse_hlo(text)
    entry = module.entry
    for p in entry.parameters:
        if params and p.parameter_number in params:
            p.attrs["sharding"] = params[p.parameter_number]
    for instr in entry.instructions:
        if opcodes and instr.opcode in opcodes:
            instr.attrs["sharding"] = opcodes[instr.opcode]
    if root is not None:
        entry.root.attrs["sharding"] = root
    return print_module(module)


def collectives(exe: xb.Executable) -> dict[str, list[str]]:
    """opcode -> replica_groups of every collective in the compiled module (alpac's parser)."""
    module = parse_hlo(exe.compiled_text(), "compiled")
    out: dict[str, list[str]] = {}
    for instr in module.instructions():
        op = instr.opcode.removesuffix("-start")
        if op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                  "collective-permute"):
            out.setdefault(op, []).append(str(instr.attrs.get("replica_groups", "")))
    return out


def check(exe: xb.Executable, text: str, args, expected=None, rtol=1e-5, atol=1e-5):
    outs = exe.run(args)
    ref = xb.run_hlo_single_device(text, args)
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        np.testing.assert_allclose(o, r, rtol=rtol, atol=atol)
    if expected is not None:
        for o, e in zip(outs, expected):
            np.testing.assert_allclose(o, e, rtol=1e-4, atol=1e-4)
    return outs


@pytest.fixture(scope="module")
def devs():
    return xb.cpu_devices(8)


# ---- devices ------------------------------------------------------------------------------

def test_cpu_devices(devs):
    assert len(devs) == 8 and [d.id for d in devs] == sorted(d.id for d in devs)
    assert xb.cpu_devices(4) == devs[:4]
    with pytest.raises(RuntimeError, match="XLA_FLAGS=--xla_force_host_platform_device_count=9"):
        xb.cpu_devices(9)
    xb.ensure_host_device_count(8)  # already there: nothing to do
    with pytest.raises(RuntimeError, match="already started"):
        xb.ensure_host_device_count(16)


# ---- sharded execution --------------------------------------------------------------------

def test_batch_split_dot(devs):
    """lhs split on its batch (non-contracting) dim: no collective, per-device arguments."""
    x, w = rand(8, 1024), rand(1024, 4)
    text = annotate(hlo(lambda x, w: x @ w, x, w), {0: "{devices=[4,1]<=[4]}"})
    exe = xb.compile_hlo(text, devs[:4])
    check(exe, text, [x, w], [x @ w])
    assert exe.parameter_shardings() == ["{devices=[4,1]<=[4]}", None]
    assert exe.output_shardings() == ["{devices=[4,1]<=[4]}"]  # propagated
    assert collectives(exe) == {}
    mem = exe.memory_stats()
    assert mem["argument_bytes"] == 8 * 1024 * 4 // 4 + 1024 * 4 * 4  # 8192 + w replicated
    assert mem["output_bytes"] == 2 * 4 * 4
    full = xb.xla_cost_analysis(xb.strip_shardings(text))["flops"]
    assert exe.cost_analysis()["flops"] == pytest.approx(full / 4)


def test_contracting_split_all_reduce(devs):
    x, w = rand(8, 1024), rand(1024, 16)
    text = annotate(hlo(lambda x, w: jnp.tanh(x @ w), x, w),
                    {0: "{devices=[1,4]<=[4]}", 1: "{devices=[4,1]0,1,2,3}"})
    exe = xb.compile_hlo(text, devs[:4])
    check(exe, text, [x, w], [np.tanh(x @ w)])
    coll = collectives(exe)
    assert list(coll) == ["all-reduce"]
    assert coll["all-reduce"][0] in ("{{0,1,2,3}}", "[1,4]<=[4]")
    assert exe.memory_stats()["argument_bytes"] == 8192 + 1024 * 16 * 4 // 4
    assert "mesh[" not in exe.compiled_text()


def megatron():
    """relu(x @ w1) @ w2 on a 2x2 mesh (a, b): x on a, w1 columns and w2 rows on b."""
    x, w1, w2 = rand(8, 16), rand(16, 32), rand(32, 12)
    text = hlo(lambda x, w1, w2: jax.nn.relu(x @ w1) @ w2, x, w1, w2)
    text = annotate(text, {0: "{devices=[2,1,2]<=[4] last_tile_dim_replicate}",
                           1: "{devices=[1,2,2]<=[2,2]T(1,0) last_tile_dim_replicate}",
                           2: "{devices=[2,1,2]<=[2,2]T(1,0) last_tile_dim_replicate}"},
                    root="{devices=[2,1,2]<=[4] last_tile_dim_replicate}")
    return text, [x, w1, w2], np.maximum(x @ w1, 0) @ w2


def test_megatron_2x2(devs):
    text, args, expected = megatron()
    exe = xb.compile_hlo(text, devs[:4])
    check(exe, text, args, [expected])
    coll = collectives(exe)
    assert list(coll) == ["all-reduce"]  # the row-split dot's partial sums, over b
    assert coll["all-reduce"] == ["{{0,1},{2,3}}"] or coll["all-reduce"] == ["[2,2]<=[4]"]
    assert exe.output_shardings() == ["{devices=[2,1,2]<=[4] last_tile_dim_replicate}"]
    mem = exe.memory_stats()
    assert mem["argument_bytes"] == (8 * 16 // 2 + 16 * 32 // 2 + 32 * 12 // 2) * 4


def test_permuted_devices(devs):
    text, args, expected = megatron()
    base = xb.compile_hlo(text, devs[:4]).run(args)
    for order in ([2, 3, 0, 1], [7, 5, 6, 4]):
        exe = xb.compile_hlo(text, [devs[i] for i in order])
        outs = check(exe, text, args, [expected])
        np.testing.assert_allclose(outs[0], base[0], rtol=1e-6)
        # partition ids index the device list: rows 0:4 live on partitions 0 and 1
        (y,) = exe.run_sharded(exe.shard_args(args))
        rows = {s.device.id: s.index[0] for s in y.addressable_shards}
        assert rows[devs[order[0]].id] == rows[devs[order[1]].id] == slice(0, 4)
        assert rows[devs[order[2]].id] == slice(4, 8)


def test_iota_and_all_gather_8_devices(devs):
    """2x4 tiling of x by an iota sharding; the replicated root needs an all-gather."""
    x = rand(16, 32)
    text = annotate(hlo(lambda x: jnp.exp(x) * 2.0, x),
                    {0: "{devices=[2,4]<=[8]}"}, root="{replicated}")
    exe = xb.compile_hlo(text, devs)
    check(exe, text, [x], [np.exp(x) * 2.0])
    assert "all-gather" in collectives(exe)
    assert exe.memory_stats()["argument_bytes"] == 16 * 32 * 4 // 8
    assert exe.output_shardings() == [None]


def test_tuple_root_sharding_and_dtypes(devs):
    """A tuple sharding on ROOT; explicit device list with a transposed order; int output."""
    x, i = rand(8, 8), np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
    text = hlo(lambda x, i: (x @ x.T, i * 3, x.sum(1)), x, i)
    text = annotate(text, {0: "{devices=[2,2,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"},
                    root="{{devices=[2,4]<=[8]}, {devices=[4,1,2]<=[8] "
                         "last_tile_dim_replicate}, {replicated}}")
    exe = xb.compile_hlo(text, devs)
    outs = check(exe, text, [x, i], [x @ x.T, i * 3, x.sum(1)])
    assert [o.dtype for o in outs] == [np.float32, np.int32, np.float32]
    assert exe.output_shardings() == ["{devices=[2,4]<=[8]}",
                                      "{devices=[4,1,2]<=[8] last_tile_dim_replicate}", None]
    assert len(exe.output_types) == 3


def test_jax_emitted_sharded_hlo(devs):
    """HLO that jax itself emits for a sharded jit (sdy frontend attributes, a Sharding
    custom-call) compiles through the same route."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("a", "b"))

    def f(x, w):
        h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("a", "b")))
        return jnp.tanh(h).sum(0)

    x, w = rand(8, 16), rand(16, 12)
    text = hlo(f, x, w, in_shardings=(NamedSharding(mesh, P("a", None)),
                                      NamedSharding(mesh, P(None, "b"))))
    assert "sharding=" in text
    exe = xb.compile_hlo(text, devs[:4])
    check(exe, text, [x, w], [np.tanh(x @ w).sum(0)])


def test_compiled_text_parses(devs):
    text, args, _ = megatron()
    exe = xb.compile_hlo(text, devs[:4])
    compiled = exe.compiled_text()
    module = parse_hlo(compiled, "compiled")
    assert module.attrs.get("num_partitions") == "4"
    # the per-device shapes: x is [4,16] on each device
    assert [str(p.shape).split("{")[0] for p in module.entry.parameters] == \
        ["f32[4,16]", "f32[16,16]", "f32[16,12]"]
    assert re.search(r"all-reduce", compiled)


# ---- donation / aliasing ------------------------------------------------------------------

def donating_module():
    x, w = rand(8, 1024), rand(4)
    text = hlo(lambda x, w: (x + 1.0, w * 2.0), x, w, donate_argnums=(0,))
    assert "input_output_alias" in text
    return annotate(text, {0: "{devices=[4,1]<=[4]}"}), x, w


def test_run_never_donates_callers_arrays(devs):
    text, x, w = donating_module()
    exe = xb.compile_hlo(text, devs[:4])
    assert exe.donated_parameters == (0,)
    assert exe.memory_stats()["alias_bytes"] == 8192
    x0, w0 = x.copy(), w.copy()
    for _ in range(2):
        out = check(exe, text, [x, w], [x0 + 1.0, w0 * 2.0])
        np.testing.assert_array_equal(x, x0)
        np.testing.assert_array_equal(w, w0)
    assert out[0] is not x


def test_run_sharded_consumes_donated_arrays(devs):
    text, x, w = donating_module()
    exe = xb.compile_hlo(text, devs[:4])
    args = exe.shard_args([x, w])
    y, v = exe.run_sharded(args)
    np.testing.assert_allclose(np.asarray(y), x + 1.0)
    assert args[0].is_deleted() and not args[1].is_deleted()
    # a second run on a donated array would crash XLA; the bridge raises instead
    with pytest.raises(ValueError, match="argument 0 was deleted"):
        exe.run_sharded(args)
    # outputs are global arrays sharded as reported; they can be fed back in
    assert y.sharding.is_equivalent_to(exe.shard_args([x, w])[0].sharding, 2)
    y2, _ = exe.run_sharded([y, v])
    np.testing.assert_array_equal(np.asarray(y2), x + 1.0 + 1.0)


# ---- errors -------------------------------------------------------------------------------

def test_malformed_module(devs):
    bad = "HloModule m\nENTRY e {\n  p = f32[4] parameter(0)\n  ROOT r = f32[4] add(p, q)\n}\n"
    with pytest.raises(ValueError) as info:
        xb.compile_hlo(bad, devs[:2])
    msg = str(info.value)
    assert "\n" not in msg and "4:26" in msg, msg


def test_bad_sharding_device_count(devs):
    x = rand(8, 4)
    text = annotate(hlo(lambda x: x * 2, x), {0: "{devices=[8,1]<=[8]}"})
    with pytest.raises(ValueError) as info:
        xb.compile_hlo(text, devs[:4])
    assert "\n" not in str(info.value)


def test_run_sharded_rejects_wrong_layout(devs):
    text, args, _ = megatron()
    exe = xb.compile_hlo(text, devs[:4])
    wrong = [jax.device_put(a, devs[0]) for a in args]
    with pytest.raises(ValueError, match="argument 0: expected sharding"):
        exe.run_sharded(wrong)
    with pytest.raises(ValueError, match="expected shape"):
        exe.run([args[0].T, args[1], args[2]])
    with pytest.raises(ValueError, match="takes 3 arguments"):
        exe.run(args[:2])


def test_single_device_reference_ignores_shardings():
    text, args, expected = megatron()
    stripped = xb.strip_shardings(text)
    assert "sharding=" not in stripped
    (out,) = xb.run_hlo_single_device(text, args)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_ensure_host_device_count_fresh_process():
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    code = ("import jax\n"  # imported, but the CPU backend has not started yet
            "from alpac.xla import bridge as xb\n"
            "xb.ensure_host_device_count(3)\n"
            "print(len(xb.cpu_devices(3)), len(xb.cpu_devices()))\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "3"]


def test_spmd_off_single_device(devs):
    x = rand(4, 4)
    text = hlo(lambda x: x @ x + 1.0, x)
    (out,) = xb.compile_hlo(text, devs[3:4], spmd=False).run([x])
    np.testing.assert_allclose(out, x @ x + 1.0, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one device"):
        xb.compile_hlo(text, devs[:2], spmd=False)


def test_corpus_module_compiles(devs):
    """A real JAX attention block (fwd+bwd, f16, batch split on 2 devices); compile only."""
    from pathlib import Path
    shared = Path(__file__).resolve().parent.parent.parent / "shared"
    text = (shared / "hlo-corpus" / "sharded_computation.hlo").read_text()
    exe = xb.compile_hlo(text, devs[:2])
    assert exe.parameter_shardings() == ["{devices=[2,1,1,1,1]<=[2]}"]
    ((shape, dtype),) = exe.parameter_types
    assert exe.memory_stats()["argument_bytes"] == np.prod(shape) * dtype.itemsize // 2
    assert "all-reduce" in collectives(exe)
