"""The one place that touches jaxlib internals.

Everything alpac asks of XLA itself goes through here: converting HloModuleProto binaries and
StableHLO text to HLO text, XLA's own parse and cost analysis of a module, and compiling and
running (sharded) HLO on a list of devices. jaxlib's private API moves between releases; the
pinned version is in pyproject.toml, and only this module has to follow it.

Compiling and running (checked with jax/jaxlib 0.10.2 on virtual CPU devices):

- `compile_hlo(text, devices)` parses the text with XLA, converts it to StableHLO and compiles
  it with XLA's SPMD partitioner: one replica, `len(devices)` partitions, device assignment in
  the order of `devices`. Device numbers inside `sharding={...}` are *partition ids*, i.e.
  indices into `devices`, not device ids. The partitioner is GSPMD (`use_shardy_partitioner`
  off): our modules carry GSPMD `sharding=` attributes, and with Shardy on XLA only prints
  "Disabling Shardy, falling back to GSPMD" and does the same thing. Unannotated parameters
  are replicated. If the ROOT has no sharding, the outputs' sharding is propagated (as
  `jax.jit` does when `out_shardings` is unspecified); if it has one, it is kept as written.
- Collectives: by default jaxlib 0.10.2's partitioner prints some replica groups in a new
  "mesh axes" form (`replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}`) that alpac's
  parser does not read. We set `xla_enable_rgv3_materialization=false`, so compiled text has
  only the explicit `{{0,1},{2,3}}` or the iota form `[2,2]<=[2,2]T(1,0)` (groups x size).
  Groups there are partition ids too (`use_global_device_ids=true`).
- Donation: the executable donates every parameter named in `input_output_alias` (may-alias
  and must-alias alike) or `buffer_donor`. `execute_sharded` then *deletes* those input
  `jax.Array`s, and passing a deleted array to it again crashes the process (SIGSEGV, not an
  exception), so `Executable.run_sharded` checks `is_deleted()` first and raises ValueError.
  Host numpy arrays are never written: a CPU device buffer may share the numpy memory
  (zero-copy `device_put` of aligned arrays), but XLA allocates a fresh output rather than
  write into a buffer it does not own. `Executable.run` copies its inputs anyway, so a
  caller's numpy arrays can never be aliased or invalidated, and can be passed again.
- Aliased outputs must have the sharding of the aliased parameter (same per-device size);
  otherwise compilation fails ("Expected aliased input ... to have the same size").
- Multi-process (later): `devices` may be a global device list spanning processes; the arrays
  `run_sharded` takes and returns are global `jax.Array`s that hold only the local shards, so
  the same calls work there. `run` needs every shard local (it reads whole arrays).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from functools import cache

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep XLA's C++ logging off the console

_COUNT_FLAG = "--xla_force_host_platform_device_count"


@cache
def _jaxlib():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax._src import xla_bridge
        from jax._src.lib import _jax, hlo, xla_client
    return _jax, hlo, xla_client, xla_bridge


def _xla_module(text: str):
    _, hlo, _, _ = _jaxlib()
    return hlo.hlo_module_from_text(text)


def hlo_text_from_proto(data: bytes) -> str:
    """HLO text of a serialized HloModuleProto (raises ValueError if it is not one)."""
    _, hlo, _, _ = _jaxlib()
    try:
        module = hlo.HloModule.from_serialized_hlo_module_proto(data)
        options = hlo.HloPrintOptions()
        options.print_large_constants = True  # the default prints big constants as {...}
        return module.to_string(options)
    except Exception as e:  # jaxlib raises its own XlaRuntimeError types
        raise ValueError(_first_line(e)) from None


def hlo_text_from_stablehlo(text: str) -> str:
    """HLO text of a StableHLO (or MHLO) MLIR module."""
    _jax, _, _, _ = _jaxlib()
    try:
        comp = _jax.mlir.mlir_module_to_xla_computation(text, use_tuple_args=False,
                                                        return_tuple=False)
    except Exception as e:
        raise ValueError(_first_line(e)) from None
    return comp.as_hlo_text(print_large_constants=True)


def xla_reprint(text: str) -> str:
    """XLA's own parse of HLO text, printed back by XLA (raises ValueError if XLA rejects it)."""
    try:
        return _xla_module(text).to_string()
    except Exception as e:
        raise ValueError(_first_line(e)) from None


def xla_cost_analysis(text: str) -> dict[str, float]:
    """XLA's HloCostAnalysis of a whole module on the CPU backend."""
    _jax, _, _, xla_bridge = _jaxlib()
    return dict(_jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), _xla_module(text)))


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _error_line(e: Exception) -> str:
    """The most telling line of an XLA error: its first `error:` line (parse errors put a
    useless 'Syntax error when trying to parse...' line first), else its first line."""
    for line in str(e).splitlines():
        if "error:" in line:
            return line.strip().removeprefix("was parsing ").strip().rstrip(":")
    return _first_line(e)


# ---- devices -------------------------------------------------------------------------------

def ensure_host_device_count(n: int) -> None:
    """Make the CPU backend have at least `n` devices: sets XLA_FLAGS if the backend has not
    started yet; raises RuntimeError if it has, with fewer devices."""
    started = "jax" in sys.modules and _backends_started()
    if started:
        have = len(_cpu_backend_devices())
        if have < n:
            raise RuntimeError(
                f"need {n} CPU devices but the CPU backend already started with {have}; set "
                f"XLA_FLAGS={_COUNT_FLAG}={n} before jax is imported")
        return
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(re.escape(_COUNT_FLAG) + r"=(\d+)", flags)
    if m and int(m.group(1)) >= n:
        return
    flags = re.sub(re.escape(_COUNT_FLAG) + r"=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()


def cpu_devices(n: int | None = None) -> list:
    """The first `n` (default: all) local devices of the CPU backend, in id order."""
    devices = _cpu_backend_devices()
    if n is None:
        return list(devices)
    if n < 1:
        raise ValueError(f"need at least one device, got n={n}")
    if len(devices) < n:
        raise RuntimeError(
            f"need {n} CPU devices but XLA has {len(devices)}; set "
            f"XLA_FLAGS={_COUNT_FLAG}={n} before jax is imported "
            f"(or call alpac.xla.bridge.ensure_host_device_count({n}) first)")
    return list(devices[:n])


def _cpu_backend_devices() -> list:
    import jax
    return sorted(jax.local_devices(backend="cpu"), key=lambda d: d.id)


def _backends_started() -> bool:
    _, _, _, xla_bridge = _jaxlib()
    try:
        return bool(xla_bridge.backends_are_initialized())
    except AttributeError:  # older/newer jax: assume the worst
        return True


# ---- compile -------------------------------------------------------------------------------

_WIDE_TYPES = re.compile(r"\b(s64|u64|f64|c128)\[")


def _allow_64bit_types(text: str) -> None:
    """jax turns 64-bit host arrays into 32-bit ones unless x64 is on: a module with 64-bit
    types (PyTorch/XLA's s64 token ids, f64 scalars) needs it to take and return them."""
    if _WIDE_TYPES.search(text):
        import jax
        jax.config.update("jax_enable_x64", True)


def _initialize_lapack(text: str) -> None:
    """jaxlib's LAPACK custom-call targets (`lapack_spotrf_ffi`, ... which jax emits for
    linear algebra on CPU) call through function pointers that jax sets up only when it lowers
    such an op itself; a module read from a file needs them set up here (else XLA crashes)."""
    if 'custom_call_target="lapack_' in text:
        from jaxlib import lapack
        lapack._lapack.initialize()


def compile_hlo(text: str, devices: list, *, spmd: bool = True) -> "Executable":
    """Compile HLO text for `devices` (partition i runs on devices[i]).

    With `spmd` (the default) XLA's SPMD partitioner (GSPMD) splits the module by its
    `sharding=` annotations into `len(devices)` partitions. `spmd=False` compiles the module
    as it is for a single device. Raises ValueError with XLA's message if XLA rejects the
    module.
    """
    _jax, hlo, xc, _ = _jaxlib()
    devices = list(devices)
    if not devices:
        raise ValueError("compile_hlo needs at least one device")
    _allow_64bit_types(text)
    _initialize_lapack(text)
    if len({d.id for d in devices}) != len(devices):
        raise ValueError(f"devices repeat: {[d.id for d in devices]}")
    if not spmd and len(devices) != 1:
        raise ValueError(f"spmd=False compiles for one device, got {len(devices)}")
    try:
        module = hlo.hlo_module_from_text(text)
    except Exception as e:
        raise ValueError(f"XLA rejected the HLO module: {_error_line(e)}") from None
    proto = module.as_serialized_hlo_module_proto()
    try:
        mlir = _jax.mlir.hlo_to_stablehlo(proto)
    except Exception as e:
        raise ValueError(f"cannot convert the HLO module to StableHLO: {_error_line(e)}") \
            from None
    program_shape = xc.XlaComputation(proto).program_shape()

    options = xc.CompileOptions()
    options.num_replicas = 1
    options.num_partitions = len(devices)
    build = options.executable_build_options
    build.use_spmd_partitioning = spmd
    build.use_shardy_partitioner = False
    if spmd and not _root_has_sharding(module.to_string()):
        # Unannotated outputs take the propagated sharding instead of being replicated. Only
        # then: with this on, XLA may also replace annotated tuple elements (seen with
        # {replicated} ones).
        build.allow_spmd_sharding_propagation_to_output = [True]
    options.device_assignment = xc.DeviceAssignment.create(
        np.array([[d.id for d in devices]], dtype=np.int64))
    options.env_option_overrides = [("xla_enable_rgv3_materialization", False)]
    device_list = xc.DeviceList(tuple(devices))
    try:
        loaded = devices[0].client.compile_and_load(mlir, device_list, options)
    except Exception as e:
        raise ValueError(f"XLA could not compile the module: {_error_line(e)}") from None
    return Executable(loaded, devices, program_shape)


def _root_has_sharding(xla_text: str) -> bool:
    """Whether the entry computation's ROOT (in XLA's own print of a module) has a sharding."""
    entry = xla_text[xla_text.find("\nENTRY "):]
    root = re.search(r"^\s*ROOT .*$", entry, re.M)
    return bool(root and re.search(r", sharding=\{", root.group(0)))


def _leaves(shape) -> list:
    if shape.is_tuple():
        return [leaf for s in shape.tuple_shapes() for leaf in _leaves(s)]
    return [shape]


class Executable:
    """A module compiled for an explicit, ordered list of devices.

    Parameters and outputs are global arrays; a ROOT tuple is flattened into its leaves, in
    order. `devices[i]` runs partition i.
    """

    def __init__(self, loaded, devices: list, program_shape):
        _, _, xc, _ = _jaxlib()
        self._exe = loaded
        self.devices: tuple = tuple(devices)
        self._device_list = xc.DeviceList(self.devices)
        params = program_shape.parameter_shapes()
        self._tuple_params = any(p.is_tuple() for p in params)
        self.parameter_types: list[tuple[tuple[int, ...], np.dtype]] = [
            (tuple(p.dimensions()), np.dtype(p.numpy_dtype())) for p in params
            if not p.is_tuple()]
        self.output_types: list[tuple[tuple[int, ...], np.dtype]] = [
            (tuple(s.dimensions()), np.dtype(s.numpy_dtype()))
            for s in _leaves(program_shape.result_shape())]
        self._text: str | None = None
        # OpSharding protos and the matching jax shardings, per parameter / flattened output.
        self._param_ops = [] if self._tuple_params else _op_shardings(
            loaded.get_parameter_shardings(), len(self.parameter_types))
        self._out_ops = _op_shardings(loaded.get_output_shardings(), len(self.output_types))
        self._param_shardings = [self._gspmd(op) for op in self._param_ops]
        self._out_shardings = [self._gspmd(op) for op in self._out_ops]
        self._result_handlers = None  # made on the first execution (`execute`)
        self.donated_parameters: tuple[int, ...] = _donated_parameters(self.compiled_text())

    # ---- introspection ----------------------------------------------------------------------
    def compiled_text(self) -> str:
        """The optimized, SPMD-partitioned per-device module XLA runs (with the collectives
        it inserted); alpac's parser reads it."""
        if self._text is None:
            self._text = self._exe.hlo_modules()[0].to_string()
        return self._text

    def parameter_shardings(self) -> list[str | None]:
        """XLA sharding strings of the parameters as compiled; None = replicated."""
        return [_sharding_text(op) for op in self._param_ops]

    def output_shardings(self) -> list[str | None]:
        """XLA sharding strings of the (flattened) outputs; None = replicated."""
        return [_sharding_text(op) for op in self._out_ops]

    def memory_stats(self) -> dict[str, int]:
        """Bytes per device, from XLA's buffer assignment."""
        m = self._exe.get_compiled_memory_stats()
        return {
            "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "generated_code_bytes": int(m.generated_code_size_in_bytes),
        }

    def peak_bytes(self) -> int:
        """XLA's peak per device: arguments + outputs - aliased + temporaries."""
        m = self.memory_stats()
        return m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]

    def cost_analysis(self) -> dict[str, float]:
        """XLA's cost analysis of the per-device module (flops, bytes accessed, ...)."""
        return {k: float(v) for k, v in dict(self._exe.cost_analysis()).items()}

    # ---- execution --------------------------------------------------------------------------
    def shard_args(self, args: list) -> list:
        """Host arrays -> global jax.Arrays laid out as the parameters expect (copies)."""
        import jax
        if self._tuple_params:
            raise ValueError("modules with tuple-shaped parameters cannot be run")
        if len(args) != len(self.parameter_types):
            raise ValueError(f"the module takes {len(self.parameter_types)} arguments, "
                             f"got {len(args)}")
        out = []
        for k, (arg, (shape, dtype), sharding) in enumerate(
                zip(args, self.parameter_types, self._param_shardings)):
            a = np.asarray(arg)
            if a.shape != shape:
                raise ValueError(f"argument {k}: expected shape {list(shape)}, got "
                                 f"{list(a.shape)}")
            if a.dtype != dtype:
                if not np.can_cast(a.dtype, dtype, "same_kind"):
                    raise ValueError(f"argument {k}: expected {dtype}, got {a.dtype}")
                a = a.astype(dtype)
            # A copy per shard: the device buffer never shares the caller's memory.
            out.append(jax.make_array_from_callback(
                shape, sharding, lambda index, a=a: np.array(a[index], copy=True)))
        return out

    def run_sharded(self, arrays: list) -> list:
        """Execute on global jax.Arrays sharded as `parameter_shardings()`; returns global
        jax.Arrays (flattened outputs). Donated parameters (`donated_parameters`) are
        consumed: their arrays are deleted."""
        import jax
        if self._tuple_params:
            raise ValueError("modules with tuple-shaped parameters cannot be run")
        if len(arrays) != len(self.parameter_types):
            raise ValueError(f"the module takes {len(self.parameter_types)} arguments, "
                             f"got {len(arrays)}")
        # Checked here because a bad argument makes execute_sharded crash the process
        # (SIGSEGV after its error message) instead of raising.
        for k, (a, (shape, dtype), op, sharding) in enumerate(
                zip(arrays, self.parameter_types, self._param_ops, self._param_shardings)):
            if not isinstance(a, jax.Array):
                raise ValueError(f"argument {k} is not a jax.Array (use run or shard_args)")
            if a.is_deleted():
                raise ValueError(f"argument {k} was deleted (donated to an earlier run?)")
            if a.shape != shape or a.dtype != dtype:
                raise ValueError(f"argument {k}: expected {dtype}{list(shape)}, got "
                                 f"{a.dtype}{list(a.shape)}")
            if not a.sharding.is_equivalent_to(sharding, len(shape)):
                raise ValueError(f"argument {k}: expected sharding "
                                 f"{_sharding_text(op) or '{replicated}'} over the "
                                 f"executable's devices, got {a.sharding}")
        return self.execute(arrays)

    def execute(self, arrays: list) -> list:
        """`run_sharded` without its checks (the caller guarantees them). The outputs become
        jax arrays in XLA's C++ result handlers: wrapping them in Python cost 9 µs per
        output on this machine (a GPT stage's 53 outputs: 0.47 ms of 0.69 per execution),
        the handlers 2 µs."""
        try:
            results = self._exe.execute_sharded(list(arrays))
        except Exception as e:
            raise ValueError(f"execution failed: {_error_line(e)}") from None
        if self._result_handlers is None:
            from jax._src import core
            from jax._src.interpreters import pxla
            avals = [core.ShapedArray(shape, dtype) for shape, dtype in self.output_types]
            self._result_handlers = pxla.global_avals_to_results_handler(
                avals, self._out_shardings, True).handlers
        return results.consume_with_handlers(self._result_handlers)

    def run(self, args: list) -> list[np.ndarray]:
        """Full host arrays in, full host arrays out (flattened outputs)."""
        return [np.asarray(a) for a in self.run_sharded(self.shard_args(args))]

    # ---- helpers ----------------------------------------------------------------------------
    def _gspmd(self, op_sharding):
        from jax._src.sharding_impls import GSPMDSharding
        return GSPMDSharding(self._device_list, op_sharding)


def _op_shardings(shardings, n: int) -> list:
    _, _, xc, _ = _jaxlib()
    if not shardings:  # a one-device executable reports none
        return [xc.HloSharding.replicate().to_proto()] * n
    if len(shardings) != n:
        raise RuntimeError(f"XLA reports {len(shardings)} shardings for {n} values")
    return list(shardings)


def _sharding_text(op_sharding) -> str | None:
    _, _, xc, _ = _jaxlib()
    s = xc.HloSharding.from_proto(op_sharding)
    return None if s.is_replicated() else str(s)


def _donated_parameters(compiled_text: str) -> tuple[int, ...]:
    """Parameter numbers named by input_output_alias or buffer_donor in the module header."""
    header = compiled_text.split("\n", 1)[0]
    found: set[int] = set()
    for key in ("input_output_alias={", "buffer_donor={"):
        start = header.find(key)
        if start < 0:
            continue
        pos, depth = start + len(key) - 1, 0
        for end in range(pos, len(header)):
            depth += {"{": 1, "}": -1}.get(header[end], 0)
            if depth == 0:
                break
        found.update(int(p) for p in re.findall(r"\(\s*(\d+)\s*,", header[pos:end]))
    return tuple(sorted(found))


# ---- reference execution -------------------------------------------------------------------

_SPMD_HEADER_ATTRS = ("num_partitions", "replica_count", "spmd_output_sharding",
                      "spmd_parameters_shardings", "allow_spmd_sharding_propagation_to_output",
                      "allow_spmd_sharding_propagation_to_parameters")


def strip_shardings(text: str) -> str:
    """The module with every `sharding=` annotation (and SPMD header setting) removed."""
    from alpac.hlo import parse_hlo, print_module
    module = parse_hlo(text)
    for instr in module.instructions():
        instr.attrs.pop("sharding", None)
    for key in _SPMD_HEADER_ATTRS:
        module.attrs.pop(key, None)
    return print_module(module)


def run_hlo_single_device(text: str, args: list, device=None) -> list[np.ndarray]:
    """Reference result of a module on one device (default: the first CPU device), ignoring
    its sharding annotations. Outputs are flattened like `Executable.run`."""
    device = device if device is not None else cpu_devices(1)[0]
    return compile_hlo(strip_shardings(text), [device]).run(args)


# ---- runtime helpers (alpa-run) ------------------------------------------------------------

def sharding_from_text(text: str | None, devices: list):
    """A jax sharding laying out an array over `devices` (partition i = devices[i]) as the XLA
    sharding string says (None or "{replicated}": replicated)."""
    _, _, xc, _ = _jaxlib()
    from jax._src.sharding_impls import GSPMDSharding
    hlo = xc.HloSharding.replicate() if not text or text.strip() == "{replicated}" else \
        xc.HloSharding.from_string(text)
    return GSPMDSharding(xc.DeviceList(tuple(devices)), hlo.to_proto())


def jax_parameter_shardings(exe: "Executable") -> list:
    """The jax shardings `exe.run_sharded` expects its arguments in."""
    return list(exe._param_shardings)


def jax_output_shardings(exe: "Executable") -> list:
    """The jax shardings of the arrays `exe.run_sharded` returns."""
    return list(exe._out_shardings)


def host_to_devices(shape: tuple, sharding, piece):
    """The global array of `shape` laid out as `sharding`, its shards on this process's
    devices made from `piece(index)` (a host array of the shard's shape and the array's
    dtype, index: a tuple of slices) in one batched copy: `jax.make_array_from_callback`
    without its per-call checks (13 µs against 22 for a small array on two devices here,
    the pieces' copies included). A piece may become the shard's buffer without a copy, as
    with jax's: give fresh host arrays."""
    from jax._src import core
    from jax._src.interpreters import pxla
    index = sharding.addressable_devices_indices_map(shape)  # cached by jax
    values = [piece(i) for i in index.values()]
    aval = core.ShapedArray(shape, values[0].dtype if values else np.float32)
    return pxla.batched_device_put(aval, sharding, values, list(index))


def global_devices() -> list:
    """Every device of every process (multi-process jax), sorted by id."""
    import jax
    return sorted(jax.devices(), key=lambda d: d.id)


def sharding_text_of(sharding, ndim: int) -> str:
    """The XLA sharding string of a jax sharding for an array of `ndim` dimensions."""
    return str(sharding._to_xla_hlo_sharding(ndim))


def execute_unchecked(exe: "Executable", arrays: list) -> list:
    """`exe.run_sharded(arrays)` without its per-argument shape, dtype and sharding checks,
    for a caller that guarantees them (the runtime's hot path; benchmarks use it for the
    direct baseline too). Deleted arrays are still refused: XLA would crash on them."""
    for k, a in enumerate(arrays):
        if a.is_deleted():
            raise ValueError(f"argument {k} was deleted (donated to an earlier run?)")
    return exe.execute(arrays)


def partition_indices(text: str | None, shape: list[int], num_partitions: int) -> tuple:
    """Per partition id, the tuple of slices of an array of `shape` that an XLA sharding
    string gives it (no device objects needed: works for meshes of other processes)."""
    _, _, xc, _ = _jaxlib()
    from jax._src.op_shardings import op_sharding_to_indices
    hlo = xc.HloSharding.replicate() if not text or text.strip() == "{replicated}" else \
        xc.HloSharding.from_string(text)
    return op_sharding_to_indices(hlo, tuple(shape), num_partitions)
