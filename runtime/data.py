"""What goes in and comes out of `alpa-run`: the step's inputs (`--inputs FILE.npz` or
deterministic random ones from `--seed`), the outputs gathered to rank 0, `--save`, and
`--check` (the original module on one device, and the relative error per output).

Relative error of an output: max|out - ref| / max|ref| (ref = the single-device result; when
ref is all zeros, the absolute error max|out - ref|); overall: the maximum over outputs.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from alpac.errors import UserError
from alpac.plan.io import replacing
from alpac.plan.program import Program
from alpac.runtime.transfers import host_dtype


@dataclass
class Param:
    number: int
    name: str
    dtype: str  # HLO element type
    shape: list[int]


_PARAM = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\](?:\{[^}]*\})?\s+"
                    r"parameter\((\d+)\)", re.M)


def entry_parameters(text: str, path: str = "source.hlo") -> list[Param]:
    """The entry computation's parameters of HLO text, by number."""
    start = text.find("\nENTRY ")
    if start < 0:
        raise UserError("no ENTRY computation", path=path)
    end = text.find("\n}", start)
    params = {}
    for m in _PARAM.finditer(text[start:end if end > 0 else None]):
        dims = [int(x) for x in m.group(3).split(",") if x]
        params[int(m.group(4))] = Param(int(m.group(4)), m.group(1), m.group(2), dims)
    if sorted(params) != list(range(len(params))):
        raise UserError("cannot read the entry parameters (tuple-shaped parameters are not "
                        "supported)", path=path)
    return [params[i] for i in range(len(params))]


def program_parameters(program: Program, source: list[Param] | None) -> list[Param]:
    """Every entry parameter with its full shape: from source.hlo when there is one, else
    from the program's values (microbatch inputs times the number of microbatches)."""
    if source is not None:
        return source
    out = {}
    for i in program.inputs:
        v = program.values[i.value]
        shape = list(v.shape)
        if i.batch_dim is not None:
            shape[i.batch_dim] *= program.num_micro_batches
        out.setdefault(i.parameter, Param(i.parameter, f"arg{i.parameter}", v.dtype, shape))
    return [out[k] for k in sorted(out)]


@dataclass
class Layout:
    """A plan whose layer loops the compiler unrolled: the program's parameters and outputs
    are pieces of the source module's, rows [first, stop) of the layer axis (one row without
    that axis) or all of it (the program's `layout`). Inputs are read and outputs given as
    the source's."""

    parameters: list  # per program parameter: [source parameter, first, stop, axis]
    outputs: list  # per program output position: [source output position, first, stop, axis]
    aliases: list  # the source's [output position, parameter]

    @staticmethod
    def of(program: Program) -> "Layout | None":
        d = program.layout
        return Layout(d["parameters"], d["outputs"], d["aliases"]) if d else None

    def program_parameters(self, source: list[Param]) -> list[Param]:
        out = []
        for number, (k, first, stop, axis) in enumerate(self.parameters):
            p = source[k]
            if first is None:
                out.append(Param(number, p.name, p.dtype, p.shape))
            else:
                rows = [] if stop - first == 1 else [stop - first]
                out.append(Param(number, f"{p.name}[{first}:{stop}]", p.dtype,
                                 p.shape[:axis] + rows + p.shape[axis + 1:]))
        return out

    def sources(self, numbers) -> set[int]:
        """The source parameters the program parameters `numbers` are cut from."""
        return {self.parameters[n][0] for n in numbers}

    def cut(self, arrays: dict[int, np.ndarray], numbers) -> dict[int, np.ndarray]:
        """The program parameters `numbers` from the source's arrays."""
        out = {}
        for n in numbers:
            k, first, stop, axis = self.parameters[n]
            if first is None:
                out[n] = arrays[k]
            else:
                rows = np.take(arrays[k], first if stop - first == 1 else range(first, stop),
                               axis=axis)
                out[n] = np.asarray(rows)  # fresh and contiguous; one row of a vector is 0-d
        return out

    def join(self, outputs: list[np.ndarray]) -> list[np.ndarray]:
        """The source's outputs from the program's (pieces concatenated in row order)."""
        parts: dict[int, list] = {}
        axes = {}
        for a, (k, first, stop, axis) in zip(outputs, self.outputs):
            one_row = first is not None and stop - first == 1
            parts.setdefault(k, []).append((first or 0, np.expand_dims(a, axis) if one_row
                                             else a))
            axes[k] = axis
        joined = []
        for k in sorted(parts):
            pieces = [a for _, a in sorted(parts[k], key=lambda p: p[0])]
            joined.append(pieces[0] if len(pieces) == 1
                          else np.concatenate(pieces, axis=axes[k]))
        return joined


def load_inputs(path: Path | None, seed: int, params: list[Param],
                needed: set[int]) -> dict[int, np.ndarray]:
    """Host arrays for the parameters in `needed`: from the npz file (keys arg<N> or the
    parameters' names), else random (the same on every rank for a seed)."""
    out: dict[int, np.ndarray] = {}
    if path is not None:
        try:
            archive = np.load(path, allow_pickle=False)
            keys = set(archive.files)
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            raise UserError(f"cannot read inputs: {e}", path=str(path)) from None
        with archive:
            for p in params:
                if p.number not in needed:
                    continue
                key = next((k for k in (f"arg{p.number}", p.name, p.name.lstrip("%"))
                            if k in keys), None)
                if key is None:
                    raise UserError(f"no input for parameter {p.number} ({p.name}); expected "
                                    f"the key arg{p.number} or {p.name}", path=str(path))
                out[p.number] = _conform(archive[key], p, f"{path}[{key}]")
        return out
    for p in params:
        if p.number in needed:
            out[p.number] = random_input(seed, p)
    return out


def random_input(seed: int, p: Param) -> np.ndarray:
    """Deterministic per (seed, parameter): floats uniform in [0, 1) (valid for variances
    and logs), integers in [0, 8) (valid token ids for any vocabulary of 8 or more)."""
    rng = np.random.default_rng([seed, p.number])
    dtype = host_dtype(p.dtype)
    if dtype.kind == "f" or p.dtype == "bf16":
        return rng.random(p.shape, dtype=np.float32).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, p.shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 8, p.shape).astype(dtype)
    return rng.random(p.shape).astype(dtype)


def _conform(a: np.ndarray, p: Param, where: str) -> np.ndarray:
    dtype = host_dtype(p.dtype)
    if list(a.shape) != list(p.shape):
        raise UserError(f"parameter {p.number} ({p.name}) is {p.dtype}{p.shape}, the input is "
                        f"{a.dtype}{list(a.shape)}", path=where)
    if a.dtype != dtype:
        if not np.can_cast(a.dtype, dtype, "same_kind"):
            raise UserError(f"parameter {p.number} ({p.name}) is {p.dtype}, the input is "
                            f"{a.dtype}", path=where)
        a = a.astype(dtype)
    return np.asarray(a, order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)


# ---- outputs -----------------------------------------------------------------------------

def assemble(pieces: list, slots, num_micro_batches: int) -> list[np.ndarray]:
    """Whole outputs (in flattened order) from (position, microbatch, region, data) pieces."""
    out = []
    by_pos: dict[int, list] = {}
    for piece in pieces:
        by_pos.setdefault(piece[0], []).append(piece)
    for slot in slots:
        v = slot.value
        dtype = host_dtype(v.dtype)
        parts = by_pos.get(slot.position, [])
        if slot.per_microbatch:
            per_mb = []
            for m in range(num_micro_batches):
                a = np.empty(v.shape, dtype)
                for _, mm, region, data in parts:
                    if mm == m:
                        a[tuple(slice(lo, hi) for lo, hi in region)] = data
                per_mb.append(a)
            out.append(np.concatenate(per_mb, axis=slot.spec.concat_dim))
        else:
            a = np.empty(v.shape, dtype)
            for _, _, region, data in parts:
                a[tuple(slice(lo, hi) for lo, hi in region)] = data
            out.append(a)
    return out


def save(path: Path, outputs: list[np.ndarray]) -> None:
    with replacing(path, "outputs") as f:
        np.savez(f, **{f"out{k}": a for k, a in enumerate(outputs)})


# ---- check -------------------------------------------------------------------------------

def reference(source_text: str, args: list[np.ndarray], aliases, iterations: int, device
              ) -> list[np.ndarray]:
    """The original module on one device for `iterations` steps, outputs fed back into the
    aliased parameters."""
    from alpac.xla.bridge import compile_hlo, strip_shardings
    exe = compile_hlo(strip_shardings(source_text), [device])
    args = list(args)
    outs: list[np.ndarray] = []
    for _ in range(iterations):
        outs = exe.run(args)
        for position, param in aliases:
            args[param] = outs[position]
    return outs


def relative_errors(outputs: list[np.ndarray], refs: list[np.ndarray]) -> list[float]:
    errs = []
    for out, ref in zip(outputs, refs):
        o = np.asarray(out, np.float64)
        r = np.asarray(ref, np.float64)
        if o.shape != r.shape:
            errs.append(float("inf"))
            continue
        if o.size == 0:
            errs.append(0.0)
            continue
        diff = np.abs(o - r)
        if np.isnan(diff).any():
            same_nan = np.isnan(o) == np.isnan(r)
            if not same_nan.all():
                errs.append(float("inf"))
                continue
            diff = np.where(np.isnan(diff), 0.0, diff)
        scale = np.nanmax(np.abs(r)) if np.isfinite(r).any() else 0.0
        err = float(np.max(diff))
        errs.append(err / scale if scale > 0 else err)
    return errs
