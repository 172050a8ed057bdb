"""`alpac inspect`: what a module is — instructions, parameters, outputs, aliases, FLOPs."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from alpac.analysis.costs import CostTable
from alpac.analysis.layerloops import find_layer_loops
from alpac.hlo import Module
from alpac.units import si


def summarize(module: Module, costs: CostTable | None = None) -> dict:
    """A JSON-ready summary of a loaded module, with its costs when given."""
    entry = module.entry
    aliased = {a.parameter_number: list(a.output_index) for a in module.input_output_alias}
    params = [{
        "index": p.parameter_number, "name": p.name, "shape": str(p.shape.without_layout()),
        "bytes": p.shape.byte_size, "aliased_output": aliased.get(p.parameter_number),
    } for p in entry.parameters]
    root = entry.root
    outputs = [{"index": list(idx), "shape": str(shape.without_layout()),
                "bytes": shape.byte_size} for idx, shape in root.shape.leaves()]
    summary = {
        "module": module.name,
        "instructions": module.instruction_count(),
        "computations": len(module.computations),
        "opcodes": dict(sorted(Counter(i.opcode for i in module.instructions()).items(),
                               key=lambda kv: (-kv[1], kv[0]))),
        "parameters": params,
        "parameter_bytes": sum(p["bytes"] for p in params),
        "outputs": outputs,
        "aliases": [{"output": list(a.output_index), "parameter": a.parameter_number,
                     "parameter_index": list(a.parameter_index), "kind": a.kind}
                    for a in module.input_output_alias],
        "buffer_donors": [[p, list(i)] for p, i in module.buffer_donors],
        **find_layer_loops(module).summary(),
    }
    if costs is not None:
        total = costs.total
        summary["cost"] = {"flops": total.flops, "transcendentals": total.transcendentals,
                           "bytes_accessed": total.bytes_accessed,
                           "estimated_loops": [i.name for i in costs.estimated_loops]}
    return summary


def render(summary: dict, console: Console) -> None:
    console.print(f"[bold]{summary['module']}[/]: {summary['instructions']:,} instructions in "
                  f"{summary['computations']} computations")
    if "cost" in summary:
        c = summary["cost"]
        console.print(f"  {si(c['flops'])}FLOP, {si(c['transcendentals'])} transcendentals, "
                      f"{si(c['bytes_accessed'])}B accessed"
                      + (f" ({len(c['estimated_loops'])} loop trip counts estimated)"
                         if c["estimated_loops"] else ""))
    console.print("[bold]instructions by opcode")
    ops = Table(show_edge=False)
    ops.add_column("opcode")
    ops.add_column("count", justify="right")
    for op, n in list(summary["opcodes"].items())[:15]:
        ops.add_row(op, f"{n:,}")
    if len(summary["opcodes"]) > 15:
        ops.add_row(f"… {len(summary['opcodes']) - 15} more", "")
    console.print(ops)
    console.print(f"[bold]parameters[/] ({si(summary['parameter_bytes'])}B in all)")
    params = Table(show_edge=False)
    for col in ("#", "name", "shape", "bytes", "aliased to output"):
        params.add_column(col, justify="right" if col in ("#", "bytes") else "left")
    for p in summary["parameters"][:40]:
        params.add_row(str(p["index"]), p["name"], p["shape"], f"{si(p['bytes'])}B",
                       "" if p["aliased_output"] is None else str(p["aliased_output"]))
    if len(summary["parameters"]) > 40:
        params.add_row("…", f"{len(summary['parameters']) - 40} more", "", "", "")
    console.print(params)
    console.print(f"outputs: {len(summary['outputs'])} "
                  f"({si(sum(o['bytes'] for o in summary['outputs']))}B), "
                  f"aliased to inputs: {len(summary['aliases'])}")
    for line in summary["layer_loops"]:
        console.print(f"layer loop {line}")
    for line in summary["other_loops"]:
        console.print(f"[dim]loop {line}, not a layer loop[/]")
