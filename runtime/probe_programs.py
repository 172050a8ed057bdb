"""Programs `alpac.runtime.probes` times: the HLO text of modules it runs the way alpa-run
runs modules (through the XLA bridge), the collectives it times under jax, and alpa-run's
host work on arrays (feeding, freeing)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from alpac.plan.calibration import COMBINED_OPERANDS

SWEPT_BYTES = 8 << 20  # per device: more than a core's cache (4 MiB of L2 here)


def kernels_hlo(kind: str, count: int, d: int, rows: int, cols: int) -> str:
    """`count` kernels one after the other, each on an f32 array of [rows, cols] per device
    (split over `d` devices on axis 0), each returning its result in new memory: a fused
    chain of four elementwise ops (`kind` "elementwise") or a row sum ("reduce")."""
    array, split = _array("f32", [d * rows, cols]), f"sharding={_tiles(d, 2)}"
    if kind == "elementwise":
        result, out_tiles, header = array, _tiles(d, 2), "HloModule kernels\n"
        scalars = "".join(f"  {c} = f32[] constant({v})\n  {c}s = {array} broadcast({c}), "
                          f"dimensions={{}}\n" for c, v in
                          (("half", 0.5), ("quarter", 0.25), ("low", -1), ("rise", 1.5)))
        body = "".join(f"  m{i} = {array} multiply(p{i}, halfs)\n"
                       f"  a{i} = {array} add(m{i}, quarters)\n"
                       f"  x{i} = {array} maximum(a{i}, lows)\n"
                       f"  r{i} = {array} multiply(x{i}, rises), {split}\n"
                       for i in range(count))
    else:
        result, out_tiles = _array("f32", [d * rows]), _tiles(d, 1)
        scalars = "  zero = f32[] constant(0)\n"
        body = "".join(f"  r{i} = {result} reduce(p{i}, zero), dimensions={{1}}, "
                       f"to_apply=sum, sharding={out_tiles}\n" for i in range(count))
        header = ("HloModule kernels\nsum {\n  x = f32[] parameter(0)\n"
                  "  y = f32[] parameter(1)\n  ROOT s = f32[] add(x, y)\n}\n")
    params = "".join(f"  p{i} = {array} parameter({i}), {split}\n" for i in range(count))
    return _module(body, params, result, out_tiles, count, header, scalars)


def dots_hlo(count: int, d: int, dtype: str, batch: int, m: int, k: int, n: int,
             transposed: bool = False) -> str:
    """`count` dots one after the other over `d` devices, each of an lhs of its own (split on
    axis 0) with one shared rhs into a new result: [m,k] x [k,n] (the rhs replicated), or
    with `batch` a batched one, the rhs split like the lhs, whose lhs holds each matrix
    transposed ([k,m]: the form of a backward pass's batched dots) where `transposed`."""
    if batch:
        lhs = [d * batch] + ([k, m] if transposed else [m, k])
        rhs, out = [d * batch, k, n], [d * batch, m, n]
        dnums = (f"lhs_batch_dims={{0}}, lhs_contracting_dims={{{1 if transposed else 2}}}, "
                 "rhs_batch_dims={0}, rhs_contracting_dims={1}")
    else:
        lhs, rhs, out = [d * m, k], [k, n], [d * m, n]
        dnums = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"
    w_tiles = _tiles(d, len(rhs)) if batch else "{replicated}"
    params = "".join(f"  p{i} = {_array(dtype, lhs)} parameter({i}), "
                     f"sharding={_tiles(d, len(lhs))}\n" for i in range(count))
    params += f"  w = {_array(dtype, rhs)} parameter({count}), sharding={w_tiles}\n"
    result, out_tiles = _array(dtype, out), _tiles(d, len(out))
    body = "".join(f"  r{i} = {result} dot(p{i}, w), {dnums}, sharding={out_tiles}\n"
                   for i in range(count))
    return _module(body, params, result, out_tiles, count)


def _array(dtype: str, dims: list[int]) -> str:
    return f"{dtype}[{','.join(map(str, dims))}]"


def _tiles(d: int, rank: int) -> str:
    """The sharding of an array of `rank` dimensions split over `d` devices on axis 0."""
    return f"{{devices=[{d}{',1' * (rank - 1)}]<=[{d}]}}"


def _module(body: str, params: str, result: str, out_tiles: str, count: int,
            header: str = "HloModule kernels\n", scalars: str = "") -> str:
    """An entry of `params`, `scalars` and `body`, returning the `count` results r0, r1, ...
    (each `result` with sharding `out_tiles`) as a tuple, or r0 alone."""
    tuple_split = "{" + ", ".join([out_tiles] * count) + "}"
    root = f"  ROOT t = ({', '.join([result] * count)}) tuple(" \
        f"{', '.join(f'r{i}' for i in range(count))}), sharding={tuple_split}\n"
    if count == 1:
        body, root = body.replace("  r0 =", "  ROOT r0 ="), ""
    return f"{header}ENTRY e {{\n{params}{scalars}{body}{root}}}\n"


def collective_step(kind: str, g: int):
    """One collective over mesh axis "i" of size g, shaped so that it can repeat: its result
    has its operand's shape (a slice or tile where the collective changes it)."""
    import jax.numpy as jnp
    from jax import lax
    if kind == "all-reduce":
        return lambda y: lax.psum(y, "i") * (1.0 / g)
    if kind == "combined-all-reduce":  # one all-reduce of COMBINED_OPERANDS pieces of y
        return lambda y: jnp.concatenate(lax.psum(tuple(jnp.split(y, COMBINED_OPERANDS)),
                                                  "i")) * (1.0 / g)
    if kind == "all-gather":
        return lambda y: lax.all_gather(y, "i", tiled=True)[: y.shape[0]]
    if kind == "reduce-scatter":
        return lambda y: jnp.tile(lax.psum_scatter(y, "i", tiled=True), g)
    if kind == "all-to-all":
        return lambda y: lax.all_to_all(y.reshape(g, -1), "i", 0, 0, tiled=True).reshape(-1)
    return lambda y: lax.ppermute(y, "i", [(j, (j + 1) % g) for j in range(g)])


def _split(jax, devices):
    """Axis 0 split over `devices`."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    return NamedSharding(Mesh(np.array(devices), ("d",)), P("d"))


def feeding(jax, devices):
    """`run(r)`: r small inputs fed from the host onto `devices` the way alpa-run feeds a
    microbatch of an input (each device's piece copied, in one batched copy), waited for."""
    from alpac.xla.bridge import host_to_devices
    data, sharding = np.ones((len(devices), 64), np.float32), _split(jax, devices)

    def run(r):
        for _ in range(r):
            host_to_devices(data.shape, sharding,
                            lambda i: np.array(data[i], copy=True)).block_until_ready()
    return run


def freeing(jax, devices, count: int, rounds: int) -> float:
    """Seconds per array of freeing small arrays the way alpa-run frees a module's results
    that no task reads any more: popped from its table of arrays, checked, deleted, `count`
    at a time (a task's frees) after a module that went through more memory than a core's
    cache holds (a plan's modules run between its frees); the median of `rounds`. Here that
    measured 4-7 µs where back to back a free took 2.1; inside a two-stage GPT pipeline of
    4 ranks alpa-run's frees took 8 µs of CPU each."""
    sharding = _split(jax, devices)
    x = jax.device_put(np.ones((len(devices), 64), np.float32), sharding)
    make = jax.jit(lambda x: [x + i for i in range(count)], out_shardings=[sharding] * count)
    w = jax.device_put(np.ones((len(devices) * SWEPT_BYTES // 4,), np.float32), sharding)
    sweep = jax.jit(lambda w: w * 1.0001, out_shardings=sharding)

    def once() -> float:
        table = dict(enumerate(make(x)))
        for a in table.values():
            a.block_until_ready()
        sweep(w).block_until_ready()
        t0 = time.perf_counter()
        for key in range(count):
            a = table.pop(key)
            if not a.is_deleted():
                a.delete()
        return (time.perf_counter() - t0) / count
    once()  # compiles
    return statistics.median(once() for _ in range(rounds))
