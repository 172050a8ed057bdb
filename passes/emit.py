"""Write the plan: one sharded HLO module per stage, its decisions, and plan.json entries."""

from __future__ import annotations

import json
from dataclasses import dataclass

from alpac.hlo import print_module
from alpac.passmanager import CompileContext, Pass
from alpac.pipeline import assemble, role_modules
from alpac.program import single_stage_program
from alpac.stage_costs import pipelined_peak


@dataclass
class EmitPass(Pass):
    name = "emit"
    description = "write the sharded HLO of every stage and the plan's stages and estimates"
    requires = ("stages", "sharded")

    def run(self, ctx: CompileContext) -> None:
        stages = ctx.module.analyses["stages"]
        entries, stats = [], []
        for stage in stages:
            result = stage.sharding
            module_file = f"stage{stage.index}.hlo"
            decisions_file = f"stage{stage.index}.decisions.json"
            ctx.artifacts[module_file] = print_module(result.module)
            ctx.artifacts[decisions_file] = json.dumps(result.decisions(), indent=1,
                                                       sort_keys=True) + "\n"
            sol = result.solution
            comm = result.communication_seconds()
            entries.append({
                "index": stage.index,
                "layers": list(stage.layers) if stage.layers else None,
                "mesh": {"devices": list(stage.mesh.devices),
                         "logical_shape": list(stage.mesh.shape),
                         "physical_shape": list(stage.physical_shape or ())},
                "module": module_file,
                "decisions": decisions_file,
                "weights_stored_split": stage.weights_stored_split,
                "ilp": {"objective_s": sol.objective, "gap": sol.gap, "status": sol.status,
                        "graph_before_reduction": sol.size_before,
                        "graph_after_reduction": sol.size_after,
                        "rounds": [list(r) for r in result.rounds],
                        "memory_budget_bytes": result.budget},
                "collectives": result.collective_summary(),
                "estimate": {"time_s": sol.objective, "communication_s": comm,
                             "compute_s": max(sol.objective - comm, 0.0),
                             "peak_memory_bytes": sol.peak_memory},
            })
            stats.append({"index": stage.index, "ilp_solve_time_s": sol.solve_time})
        ctx.plan["num_micro_batches"] = ctx.plan.get("num_micro_batches", 1)
        ctx.plan["stages"] = entries
        ctx.artifacts["source.hlo"] = print_module(ctx.module)  # what --check runs
        if stages[0].pipeline_stage is None:
            program = single_stage_program(ctx.module, stages[0].sharding.module,
                                           stages[0].mesh, entries[0]["module"])
            ctx.plan["program"] = program.to_dict()
            ctx.plan["estimate"] = {
                "iteration_time_s": sum(e["estimate"]["time_s"] for e in entries),
                "peak_memory_bytes": max(e["estimate"]["peak_memory_bytes"] for e in entries),
            }
        else:
            self.pipelined(ctx, stages, entries)
        ctx.stats["stages"] = stats

    def pipelined(self, ctx: CompileContext, stages, entries) -> None:
        """Role modules of every stage, the program, and the pipeline's estimates."""
        graph, modules = ctx.module.analyses["pipeline"]
        B = ctx.plan["num_micro_batches"]
        roles = []
        for stage, entry in zip(stages, entries):
            mine = role_modules(stage.pipeline_stage, stage.sharding.module)
            roles += mine
            entry["modules"] = {rm.role: f"stage{stage.index}.{rm.role}.hlo" for rm in mine}
        program, files = assemble(graph, modules, roles, [s.mesh for s in stages],
                                  ctx.module, B)
        ctx.artifacts.update(files)
        ctx.plan["program"] = program.to_dict()
        S = len(stages)
        times, applies, peaks = [], [], []
        for s, (stage, entry) in enumerate(zip(stages, entries)):
            figures, in_flight, peak = pipelined_peak(stage.pipeline_stage, stage.sharding,
                                                      S, s, B)
            entry["estimate"].update({
                "time_per_microbatch_s": figures.t, "apply_s": figures.apply,
                "static_bytes": figures.static_bytes,
                "transient_bytes": figures.transient_bytes,
                "activation_bytes_per_microbatch": figures.activation_bytes,
                "microbatches_in_flight": in_flight, "peak_memory_bytes": peak})
            times.append(figures.t)
            applies.append(figures.apply)
            peaks.append(peak)
        iteration = sum(times) + (B - 1) * max(times) + max(applies)
        ctx.plan["estimate"] = {
            "iteration_time_s": iteration,
            "bubble_fraction": 1 - B * sum(times) / S / (sum(times) + (B - 1) * max(times)),
            "peak_memory_bytes": max(peaks),
            "bytes_between_meshes": program.transfer_bytes(),
        }
