"""Run a `Program` in one process on XLA's virtual CPU devices: the reference the compiler
side of pipelining is tested with, independent of MPI and of alpa-run.

As alpa-run does, a value stays on the devices of its mesh between modules that take it in
the sharding it has (an accumulated gradient reduced once per step holds each device's own
partial sums there, alpac.intraop.deferral); any other is moved through the host."""

from __future__ import annotations

import numpy as np

from alpac.plan.program import Program
from alpac.runtime.transfers import host_dtype
from alpac.xla.bridge import compile_hlo, cpu_devices



def run_program(program: Program, texts: dict[str, str], args: list[np.ndarray],
                iterations: int = 1) -> list[np.ndarray]:
    devices = cpu_devices()
    exes = {m.name: compile_hlo(texts[m.file], [devices[d] for d in
                                                 program.meshes[m.mesh].devices])
            for m in program.modules}
    B = program.num_micro_batches
    args = list(args)
    for _ in range(iterations):
        step: dict[str, np.ndarray] = {}
        per_mb: list[dict[str, np.ndarray]] = [{} for _ in range(B)]
        for spec in program.inputs:
            value = args[spec.parameter]
            if spec.batch_dim is None:
                step[spec.value] = value
            else:
                for m, part in enumerate(np.split(value, B, axis=spec.batch_dim)):
                    per_mb[m][spec.value] = part
        if program.microbatch_index:
            for m in range(B):
                per_mb[m][program.microbatch_index] = np.int32(m)
        for name in program.accumulators:
            v = program.values[name]
            step[name] = np.zeros(v.shape, host_dtype(v.dtype))

        def run(module, m=None):
            scope = per_mb[m] if m is not None else {}
            inputs = [scope[p.value] if p.value in scope else step[p.value]
                      for p in module.parameters]
            for k, (p, x) in enumerate(zip(module.parameters, inputs)):
                want = program.values[p.value].shape
                if list(np.shape(x)) != list(want):
                    raise AssertionError(f"{module.name} parameter {k} ({p.value}) is "
                                         f"{list(np.shape(x))}, the program says {want}")
            exe = exes[module.name]
            outputs = exe.run_sharded(_arguments(exe, inputs))
            for p, out in zip(module.outputs, outputs):
                if program.values[p.value].scope == "microbatch" and m is not None:
                    scope[p.value] = out
                else:
                    step[p.value] = out

        by_role = {r: [m for m in program.modules if m.role == r]
                   for r in ("prologue", "forward", "backward", "apply", "step")}
        for module in by_role["prologue"] + by_role["step"]:
            run(module)
        for m in range(B):
            for module in sorted(by_role["forward"], key=lambda x: x.stage):
                run(module, m)
            for module in sorted(by_role["backward"], key=lambda x: -x.stage):
                run(module, m)
        for module in by_role["apply"]:
            run(module)
        outputs = []
        for spec in program.outputs:
            if spec.concat_dim is not None:
                outputs.append(np.concatenate([np.asarray(per_mb[m][spec.value])
                                               for m in range(B)], axis=spec.concat_dim))
            else:
                outputs.append(np.asarray(step[spec.value]))
        for out_index, param in program.aliases:
            k = next(i for i, o in enumerate(program.outputs) if o.index == list(out_index))
            args[param] = outputs[k]
    return outputs


def _arguments(exe, inputs: list) -> list:
    """Device arrays as the module takes them: kept where already laid out so (a copy where
    the module donates it: the value may be read again), else through the host."""
    import jax

    out = []
    donated = set(exe.donated_parameters)
    for k, (x, sharding) in enumerate(zip(inputs, exe._param_shardings)):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            out.append(jax.device_put(x, x.sharding, may_alias=False) if k in donated else x)
        else:
            out.append(_host(exe, k, x))
    return out


def _host(exe, k: int, x):
    """Argument k laid out from a host copy of `x`."""
    import jax
    shape, dtype = exe.parameter_types[k]
    a = np.asarray(x).astype(dtype, copy=False)
    return jax.make_array_from_callback(shape, exe._param_shardings[k],
                                        lambda index: np.array(a[index], copy=True))
