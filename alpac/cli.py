"""The `alpac` command: inspect, passes, compile, explain, calibrate.

Bad input ends with one line on stderr and exit code 2; a failed check or pass with exit 1;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console

from alpac.errors import CheckFailed, UserError
from alpac.passes.manager import PassFailed

err_console = Console(stderr=True, highlight=False)


class _Group(click.Group):
    """Turns alpac's own exceptions into one line and an exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (UserError, CheckFailed, PassFailed) as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            err_console.print(f"alpac: error: {e}", markup=False, soft_wrap=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:  # Ctrl-C: 130 as a shell reports it, not click's exit 1
            if ctx.obj and ctx.obj.get("debug"):
                raise
            err_console.print("alpac: interrupted; nothing was written", markup=False)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(package_name="alpac")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """alpac: plan and compile XLA HLO modules for many devices."""
    ctx.obj = {"debug": debug}


BATCH_ARGS_HELP = ("Batch inputs as PARAM:DIM pairs (e.g. 5:0,6:0), instead of detecting "
                   "them.")


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--batch-args", help=BATCH_ARGS_HELP)
def inspect(model: Path, as_json: bool, batch_args: str | None) -> None:
    """Show what MODEL holds: instructions, parameters, outputs, aliases, FLOPs, batch inputs
    and how the step splits into microbatches."""
    from alpac.analysis.costs import CostTable
    from alpac.analysis.step.report import render_step, step_report
    from alpac.analysis.step.split import StepSplit
    from alpac.driver import build_pipeline
    from alpac.inspect import render, summarize
    from alpac.passes.manager import CompileContext, PassManager

    ctx = CompileContext(model, cluster=None)
    options = {"batch-analysis": {"batch_args": batch_args}} if batch_args else {}
    PassManager(build_pipeline("load,inline-calls,cost-analysis,batch-analysis,step-split",
                               options=options)).run(ctx)
    summary = summarize(ctx.module, ctx.results[CostTable])
    summary["step"] = step_report(ctx.results[StepSplit], detail=as_json)
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        console = Console(highlight=False)
        render(summary, console)
        render_step(summary["step"], console)


@main.command(name="passes")
def list_passes() -> None:
    """List the available passes (built-in and installed) with what they do."""
    import dataclasses

    from rich.table import Table

    from alpac.driver import default_recipe
    from alpac.passes.manager import available_passes

    registry = available_passes()
    recipe = default_recipe()
    table = Table(show_edge=False)
    for col in ("pass", "in recipe", "description", "requires → provides", "options"):
        table.add_column(col)
    for name, cls in registry.items():
        opts = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
        needs = ", ".join([k.__name__ for k in cls.requires]
                          + [f"({k.__name__})" for k in cls.optional])
        flow = f"{needs or '-'} → {', '.join(k.__name__ for k in cls.provides) or '-'}"
        table.add_row(name, str(recipe.index(name) + 1) if name in recipe else "-",
                      cls.description, flow, opts)
    Console(highlight=False, width=max(120, Console().width)).print(table)


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--cluster", "cluster_path", type=click.Path(path_type=Path),
              help="cluster.yaml describing the devices (default: this machine).")
@click.option("-o", "--output", "out_dir", type=click.Path(path_type=Path), default=Path("plan"),
              show_default=True, help="Plan directory to write (replaced atomically).")
@click.option("--passes", "passes_spec", help="Comma-separated pass list replacing the recipe, "
              "e.g. 'load,cost-analysis,my-pass{opt=1}'.")
@click.option("--skip-pass", multiple=True, help="Leave this pass out of the recipe.")
@click.option("--dump-after", multiple=True,
              help="Write the IR after this pass to <plan dir>.dump/after-<pass>.hlo.")
@click.option("--timings", is_flag=True, help="Print the time each pass took.")
@click.option("--mesh", help="One stage on a logical mesh of this shape (8, 2x4, 2x2x2): "
              "intra-operator parallelism only.")
@click.option("--memory-budget", help="Bytes per device the plan must fit (e.g. 12GiB; "
              "default: the device memory in the cluster spec).")
@click.option("--time-limit", type=float, help="Seconds the ILP solver may take per stage "
              "(default 60).")
@click.option("--batch-args", help=BATCH_ARGS_HELP)
@click.option("--micro-batches", type=int, help="Number of microbatches (default: chosen "
              "among the divisors of the batch).")
@click.option("--layers", type=int, help="Number of layers to cluster the forward pass into "
              "(default: chosen).")
@click.option("--stages", "stages_spec", help="Pin the pipeline stages as layer ranges, e.g. "
              "0-3,4-7.")
@click.option("--stage-meshes", help="With --stages: pin each stage's submesh (nodes x devices "
              "per node), optionally with its logical mesh, e.g. 1x2,1x2,1x4 or 1x4:2x2.")
@click.option("--jobs", type=int, help="Parallel ILP solves while choosing stages (default: "
              "all cores).")
@click.option("--strategy", help="A fixed strategy priced by the same model: data-parallel, "
              "zero2, zero3 or megatron:dp=..,tp=..,pp=..")
@click.option("--remat", type=click.Choice(["auto", "none", "selective", "full"]),
              help="Recomputation of activations in the backward of pipeline stages: auto "
              "(default: the stage DP chooses per stage where memory needs it), or none, "
              "selective (recompute the cheap instructions between dots) or full (keep only each "
              "layer's output) for every layer.")
@click.option("--zero", type=click.Choice(["auto", "2", "3"]), default="auto", show_default=True,
              help="Weight-update sharding after the ILP (reduce-scatter + all-gather): auto "
              "splits the optimizer state of each chain where that is no slower, 2 of every "
              "chain, 3 also stores the weights split.")
@click.option("--no-reduce-scatter", is_flag=True, help="Keep the weight update as the ILP "
              "chose it (skip the reduce-scatter pass).")
def compile(model: Path, cluster_path: Path | None, out_dir: Path, passes_spec: str | None,
            skip_pass: tuple[str, ...], dump_after: tuple[str, ...], timings: bool,
            mesh: str | None, memory_budget: str | None, time_limit: float | None,
            batch_args: str | None, micro_batches: int | None, layers: int | None,
            stages_spec: str | None, stage_meshes: str | None, jobs: int | None,
            strategy: str | None, remat: str | None, zero: str,
            no_reduce_scatter: bool) -> None:
    """Compile MODEL into a plan directory."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
        TimeElapsedColumn

    from alpac.driver import build_pipeline, compile_model
    from alpac.plan.cluster import default_cluster, load_cluster

    cluster = load_cluster(cluster_path) if cluster_path else default_cluster()
    options: dict[str, dict[str, str]] = {"stage-construction": {}, "intra-op-sharding": {},
                                          "batch-analysis": {}}
    if batch_args:
        options["batch-analysis"]["batch_args"] = batch_args
    for key, value in (("micro_batches", micro_batches), ("layers", layers),
                       ("stages", stages_spec), ("stage_meshes", stage_meshes), ("jobs", jobs),
                       ("strategy", strategy),
                       ("remat", remat)):
        if value is not None:
            options["stage-construction"][key] = str(value)
    options["reduce-scatter"] = {"zero": zero}
    if no_reduce_scatter:
        skip_pass = skip_pass + ("reduce-scatter",)
    if mesh:
        options["stage-construction"]["mesh"] = mesh
    from alpac.plan.cluster import parse_size
    budget = parse_size(memory_budget, "--memory-budget") if memory_budget else None
    if time_limit is not None:  # every per-stage ILP: candidate plans, the plan, ZeRO's
        for name in ("stage-construction", "intra-op-sharding", "reduce-scatter"):
            options[name]["time_limit"] = str(time_limit)
    pipeline = build_pipeline(passes_spec, skip_pass, options)
    # no progress where stderr is not a terminal: an error is then its one line, nothing more
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err_console,
                  transient=True, disable=not err_console.is_terminal) as progress:
        task = progress.add_task("compiling", total=len(pipeline))
        steps = progress.add_task("", total=None, visible=False)  # ILP solves of a pass

        def on_start(p):
            progress.update(task, description=f"pass {p.name}: {p.description}")
            progress.update(steps, visible=False)

        def on_progress(what, done, total):
            progress.update(steps, description=f"  {what}", completed=done, total=total,
                            visible=True)

        ctx, path = compile_model(model, cluster, pipeline, out_dir,
                                  dump_after=frozenset(dump_after), on_start=on_start,
                                  on_end=lambda p, dt: progress.advance(task),
                                  memory_budget=budget, on_progress=on_progress)
    console = Console(highlight=False)
    console.print(f"plan written to {path} ({len(ctx.ran)} passes)")
    from alpac.driver import compile_notes
    for note in compile_notes(ctx):  # as written into plan.json, not read back from it
        err_console.print(f"alpac: note: {note['text']}", markup=False, soft_wrap=True)
    if timings:
        from rich.table import Table
        table = Table(title="time per pass", show_edge=False)
        table.add_column("pass")
        table.add_column("seconds", justify="right")
        for name, seconds in ctx.timings.items():
            table.add_row(name, f"{seconds:.3f}")
        table.add_row("[bold]total", f"{sum(ctx.timings.values()):.3f}")
        console.print(table)


@main.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the plan summary as JSON.")
@click.option("--filter", "pattern", help="Show the shardings of instructions whose name or "
              "opcode matches this regular expression.")
@click.option("--limit", default=40, show_default=True, help="Rows of shardings to show.")
@click.option("--verify", is_flag=True, help="Compile every stage with XLA on virtual CPU "
              "devices and compare the collectives XLA inserted with the prediction "
              "(exit 1 if they differ).")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), help="Write the "
              "predicted schedule as a Chrome trace-event file (ui.perfetto.dev, "
              "chrome://tracing) and print only that.")
@click.option("--against", "report_path", type=click.Path(path_type=Path), help="Compare the "
              "estimates with this plan's `alpa-run --report` file and print only that.")
def explain(plan_dir: Path, as_json: bool, pattern: str | None, limit: int,
            verify: bool, trace_path: Path | None, report_path: Path | None) -> None:
    """Show what the plan in PLAN_DIR decided and what it should cost."""
    from alpac.plan import explain as ex

    plan = ex.load(plan_dir)
    if trace_path or report_path:
        _predicted_and_measured(plan, plan_dir, trace_path, report_path)
        return
    if as_json:
        click.echo(json.dumps(plan, indent=1, sort_keys=True))
        return
    console = Console(highlight=False)
    from alpac.plan.notes import notes_of
    for note in notes_of(plan):
        console.print(f"note: {note}", markup=False, soft_wrap=True)
    ex.render(plan, plan_dir, console, pattern, limit)
    console.print(f"made by: alpac compile {plan['source']['file']} --passes "
                  f"'{_recorded_spec(plan)}'", markup=False, soft_wrap=True)
    if verify and not ex.verify(plan, plan_dir, console):
        raise CheckFailed("XLA's collectives differ from the plan's prediction, or XLA refused "
                          "a stage's module (see above)")


def _predicted_and_measured(plan: dict, plan_dir: Path, trace_path: Path | None,
                            report_path: Path | None) -> None:
    """`explain --against` and `--trace`: the estimates beside a run, the predicted timeline."""
    from alpac.plan import against
    from alpac.plan.trace import predicted_trace, write_trace
    from alpac.units import duration
    console = Console(highlight=False)
    if report_path:
        report = against.load_report(report_path, plan)
        against.render(against.compare(plan, report), report, console,
                       calibrated=bool(plan.get("cluster", {}).get("calibration")))
        against.render_breakdown(against.breakdown(plan, report), console)
        against.render_hosts(against.host_rows(report), against.measured_iteration(report),
                             console)
    if trace_path:
        trace, iteration = predicted_trace(plan, f"alpac explain {plan_dir} (predicted)")
        write_trace(trace, trace_path)
        console.print(f"predicted timeline written to {trace_path} (open it in ui.perfetto.dev "
                      f"or chrome://tracing): iteration {duration(iteration)} with transfers "
                      f"between meshes, {duration(plan['estimate']['iteration_time_s'])} by "
                      f"the plan's formula", soft_wrap=True)


def _recorded_spec(plan: dict) -> str:
    """The `--passes` string of the pipeline plan.json records (its passes and options)."""
    from alpac.passes.manager import available_passes, pipeline_spec

    if "spec" in plan["compiler"]:
        return plan["compiler"]["spec"]
    registry = available_passes()  # a plan written before plan.json recorded the spec
    recorded = plan["compiler"]["passes"]
    if any(p["name"] not in registry for p in recorded):
        return ",".join(p["name"] for p in recorded)  # made with a plug-in not installed here
    try:
        return pipeline_spec([registry[p["name"]](**p.get("options", {})) for p in recorded])
    except (TypeError, ValueError, UserError):  # options these passes no longer take
        return ",".join(p["name"] for p in recorded)


@main.command()
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="cluster.yaml to write (replaced atomically).")
@click.option("--check", "check_path", type=click.Path(path_type=Path),
              help="Measure a few rows of each table of this calibrated file again and report "
              "the drift (measured / recorded) per table; exit 1 past --tolerance.")
@click.option("--tolerance", default=0.5, show_default=True, type=click.FloatRange(min=0),
              help="Drift --check allows either way (0.5: from 1/1.5 to 1.5 times).")
@click.option("--report", type=click.Path(path_type=Path),
              help="With --check: write the drift per table to this JSON file.")
@click.option("--quick", is_flag=True, help="A few sizes of each table (for tests: < 1 min).")
@click.option("--devices-per-rank", type=click.IntRange(min=1), help="Devices each rank drives, "
              "as in alpa-run (default 1; with --check, the file's devices_per_node).")
@click.option("--name", help="The cluster's name (default local-<platform>-calibrated).")
@click.option("--mpiexec", type=click.Path(path_type=Path),
              help="mpiexec to use (default: the one of the mpich package).")
@click.option("--timeout", default=300.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds any rank waits for another before giving up.")
@click.option("--platform", type=click.Choice(("auto", "cpu", "gpu")), default="auto",
              show_default=True, help="Devices to measure.")
@click.argument("mpi_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def calibrate(ctx: click.Context, output: Path | None, check_path: Path | None,
              tolerance: float, report: Path | None, quick: bool,
              devices_per_rank: int | None, name: str | None, mpiexec: Path | None,
              timeout: float, platform: str, mpi_args: tuple[str, ...]) -> None:
    """Measure this machine's devices and links into a cluster file, launched like alpa-run:
    alpac calibrate [--devices-per-rank K] -o cluster.yaml -- np N."""
    import subprocess
    if (output is None) == (check_path is None):
        raise UserError("give either -o FILE (measure and write) or --check FILE (compare)")
    if report and not check_path:
        raise UserError("--report is the drift report of --check FILE")
    options = {"output": str(output) if output else None,
               "check": str(check_path) if check_path else None, "tolerance": tolerance,
               "quick": quick, "devices_per_rank": devices_per_rank, "name": name,
               "mpiexec": str(mpiexec) if mpiexec else None, "timeout": timeout,
               "platform": platform, "debug": bool(ctx.obj and ctx.obj.get("debug")),
               "report": str(report) if report else None}
    # the runtime measures, in a process of its own: the compiler never imports it
    sys.exit(subprocess.call([sys.executable, "-m", "alpac.runtime.calibrate",
                              json.dumps(options), *mpi_args]))


if __name__ == "__main__":
    main()
