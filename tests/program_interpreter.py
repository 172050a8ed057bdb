"""Run a `Program` in one process on XLA's virtual CPU devices: the reference the compiler
side of pipelining is tested with, independent of MPI and of alpa-run."""

from __future__ import annotations

import numpy as np

from alpac.plan.program import Program
from alpac.xla.bridge import compile_hlo, cpu_devices

DTYPES = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "s32": np.int32,
          "s64": np.int64, "u32": np.uint32, "pred": np.bool_, "s8": np.int8, "u8": np.uint8}


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
            step[name] = np.zeros(v.shape, DTYPES[v.dtype])

        def run(module, m=None):
            scope = per_mb[m] if m is not None else {}
            inputs = [scope[p.value] if p.value in scope else step[p.value]
                      for p in module.parameters]
            for k, (p, x) in enumerate(zip(module.parameters, inputs)):
                want = program.values[p.value].shape
                if list(np.shape(x)) != list(want):
                    raise AssertionError(f"{module.name} parameter {k} ({p.value}) is "
                                         f"{list(np.shape(x))}, the program says {want}")
            outputs = exes[module.name].run(inputs)
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
                outputs.append(np.concatenate([per_mb[m][spec.value] for m in range(B)],
                                              axis=spec.concat_dim))
            else:
                outputs.append(step[spec.value])
        for out_index, param in program.aliases:
            k = next(i for i, o in enumerate(program.outputs) if o.index == list(out_index))
            args[param] = outputs[k]
    return outputs
