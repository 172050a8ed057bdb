"""The compile recipe: the named passes, in order, and the driver that runs them and writes
the plan directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from alpac import __version__
from alpac.analysis.step.split import StepSplit
from alpac.errors import UserError
from alpac.interop.emit import EmittedPlan
from alpac.passes.manager import CompileContext, Pass, PassManager, available_passes, \
    parse_pipeline, pipeline_spec
from alpac.plan.io import write_plan_dir
from alpac.plan.notes import plan_notes
from alpac.xla.loader import module_hash


def default_recipe() -> list[str]:
    return [
        "load",           # the model file -> IR
        "inline-calls",   # one flat entry computation (front ends keep library calls)
        "flatten-params",  # one parameter per array
        "cost-analysis",  # FLOPs, transcendentals and bytes of every instruction
        "batch-analysis",  # which inputs carry the batch, on which dimension
        "step-split",     # per-microbatch part, accumulated values, once-per-step update
        "unroll-layer-loops",  # scanned layers unrolled where the step will be pipelined
        "stage-construction",  # pipeline stages, submeshes, logical meshes
        "intra-op-sharding",   # the sharding ILP of every stage
        "reduce-scatter",      # shard the weight update (ZeRO-2) where it does not slow
        "emit",                # sharded HLO per stage + plan entries
    ]


def build_pipeline(spec: str | None = None, skip: tuple[str, ...] = (),
                   options: dict[str, dict[str, str]] | None = None) -> list[Pass]:
    """Pass instances for `spec` (default: the recipe), minus `skip`; `options` adds
    per-pass options (from CLI flags) under those given in the spec."""
    registry = available_passes()
    for name in skip:
        if name not in registry:
            raise UserError(f"--skip-pass names unknown pass '{name}'; `alpac passes` lists "
                            f"them")
    options = _mirror_stage_options(options or {})
    chosen = []
    for name, spec_options in parse_pipeline(spec or ",".join(default_recipe())):
        if name not in registry:
            raise UserError(f"unknown pass '{name}'; `alpac passes` lists them: "
                            f"{', '.join(registry)}")
        if name not in skip:
            chosen.append((name, {**options.get(name, {}), **spec_options}))
    return [registry[name].with_options(merged)
            for name, merged in _mirror_time_limit(chosen)]


ILP_PASSES = ("intra-op-sharding", "stage-construction", "reduce-scatter")


def _mirror_time_limit(chosen: list[tuple[str, dict[str, str]]]
                       ) -> list[tuple[str, dict[str, str]]]:
    """The per-stage ILP's time limit set on one of the passes that solve it (a spec such as
    `intra-op-sharding{time_limit=30}`) holds for the others where they leave it unset, as
    --time-limit sets all three: the stages solved while they were chosen are kept only when
    solved at the intra-op pass's settings, else solved again."""
    given = [o["time_limit"] for name in ILP_PASSES for n, o in chosen
             if n == name and "time_limit" in o]
    if not given:
        return chosen
    return [(n, {"time_limit": given[0], **o} if n in ILP_PASSES else o) for n, o in chosen]


def _mirror_stage_options(options: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Layer loops are cut only for a step that may be pipelined, one per stage only for a
    forced pipeline that leaves the layers to alpac: that pass sees the stage options that
    say so (--mesh, --strategy, --layers)."""
    stage = options.get("stage-construction", {})
    mirrored = {k: stage[k] for k in ("mesh", "strategy", "layers") if k in stage}
    return {**options, "unroll-layer-loops": {**mirrored,
                                              **options.get("unroll-layer-loops", {})}}


def compile_model(model_path: str | Path, cluster, pipeline: list[Pass], out_dir: str | Path,
                  *, dump_after: frozenset[str] = frozenset(), on_start=None, on_end=None,
                  memory_budget: float | None = None,
                  on_progress=None) -> tuple[CompileContext, Path]:
    """Run the passes on the model and write what they made into the plan directory."""
    ctx = CompileContext(Path(model_path), cluster, memory_budget, on_progress=on_progress)
    dump_dir = Path(out_dir).with_name(Path(out_dir).name + ".dump")
    PassManager(pipeline, dump_after, dump_dir, on_start, on_end).run(ctx)
    plan = {
        "compiler": {"name": "alpac", "version": __version__,
                     "passes": [_describe(p) for p in pipeline],
                     "spec": pipeline_spec(pipeline)},  # `--passes` that reproduces it
        "source": {"file": Path(model_path).name, "sha256": module_hash(model_path),
                   "module": ctx.module.name if ctx.module else None},
        "cluster": cluster.to_dict(),
        **ctx.plan_entries(),
        "notes": compile_notes(ctx),
    }
    emitted = ctx.results.get(EmittedPlan)
    files = emitted.files if emitted else {}
    stats = {"pass_seconds": ctx.timings, **ctx.stats}
    return ctx, write_plan_dir(out_dir, plan, files, stats)


def compile_notes(ctx: CompileContext) -> list[dict]:
    """plan.json's `notes` (alpac.plan.notes) of a compile whose passes have run."""
    if ctx.module is None:
        return []
    split = ctx.results.get(StepSplit)
    return plan_notes(ctx.module, ctx.cluster, trains=bool(split and split.backward))


def _describe(p: Pass) -> dict:
    return {"name": p.name, "options": {f.name: getattr(p, f.name)
                                        for f in sorted(dataclasses.fields(p),
                                                        key=lambda f: f.name)}}
