"""Reference execution of a microbatched step on one device (tests, `alpa-run --check`).

Runs the prologue once on the whole batch, the per-microbatch module once per microbatch on
its slice of the batch inputs, accumulates (in float32 for 16-bit floats, else in the value's
own type) and concatenates its outputs, then runs the once-per-step module. Compiled
executables are cached by module text, so B microbatches compile the module once.
"""

from __future__ import annotations

import numpy as np

from alpac.analysis.step.wiring import MicrobatchedStep, SinkKind, Source, SourceKind
from alpac.hlo.ir import Module
from alpac.hlo.printer import print_module

_CACHE: dict[str, object] = {}


def compiled(module: Module):
    """An executable for one CPU device (shardings stripped), cached by module text."""
    from alpac.xla.bridge import compile_hlo, cpu_devices, strip_shardings
    text = print_module(module)
    exe = _CACHE.get(text)
    if exe is None:
        exe = _CACHE[text] = compile_hlo(strip_shardings(text), cpu_devices(1), spmd=False)
    return exe


def _accumulator_dtype(dtype: np.dtype) -> np.dtype:
    if dtype.kind == "f" and dtype.itemsize < 4 or dtype.kind == "V" or \
            dtype.name in ("bfloat16", "float16"):
        return np.dtype(np.float32)
    return dtype


def run_microbatched(step: MicrobatchedStep, args: list, B: int | None = None
                     ) -> list[np.ndarray]:
    """The outputs of the original step (flattened like `Executable.run`), computed the
    microbatched way from the original step's arguments."""
    B = step.num_microbatches if B is None else B
    if B != step.num_microbatches:
        raise ValueError(f"the step was rewritten for {step.num_microbatches} microbatches, "
                         f"not {B}")
    args = [np.asarray(a) for a in args]
    n = step.batch_size // B
    pro_out: list[np.ndarray] = []
    if step.prologue is not None:
        pro_out = compiled(step.prologue).run([_value(s, args, None, None, None, None)
                                               for s in step.prologue_inputs])
    acc: dict[int, np.ndarray] = {}
    acc_dtype: dict[int, np.dtype] = {}
    cat: dict[int, list[np.ndarray]] = {}
    exe = compiled(step.microbatch)
    for m in range(B):
        inputs = [_value(s, args, pro_out, None, None, (m, n)) for s in step.microbatch_inputs]
        outs = exe.run(inputs)
        for out, sink in zip(outs, step.microbatch_outputs):
            if sink.kind == SinkKind.ACCUMULATE:
                acc_dtype.setdefault(sink.index, out.dtype)
                v = out.astype(_accumulator_dtype(out.dtype))
                acc[sink.index] = v if sink.index not in acc else acc[sink.index] + v
            else:
                cat.setdefault(sink.index, []).append(out)
    accumulated = {k: v.astype(acc_dtype[k]) for k, v in acc.items()}
    cat_dim = {s.index: s.dim for s in step.microbatch_outputs if s.kind == SinkKind.CONCATENATE}
    concatenated = {k: np.concatenate(v, axis=cat_dim[k]) for k, v in cat.items()}
    ep_inputs = [_value(s, args, pro_out, accumulated, concatenated, None)
                 for s in step.epilogue_inputs]
    return compiled(step.epilogue).run(ep_inputs)


def _value(s: Source, args, pro_out, accumulated, concatenated, mb):
    if s.kind == SourceKind.PARAM:
        return args[s.index]
    if s.kind == SourceKind.BATCH_SLICE:
        m, n = mb
        return np.take(args[s.index], np.arange(m * n, (m + 1) * n), axis=s.dim)
    if s.kind == SourceKind.PROLOGUE:
        return pro_out[s.index]
    if s.kind == SourceKind.ACCUMULATED:
        return accumulated[s.index]
    if s.kind == SourceKind.CONCATENATED:
        return concatenated[s.index]
    if s.kind == SourceKind.MICROBATCH_INDEX:
        return np.asarray(mb[0], np.int32)
    raise ValueError(f"unknown input source {s.kind}")
