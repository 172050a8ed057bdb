"""What `alpac inspect` shows about a step: batch inputs, parts, forward/backward by layer.

`step_report(split, ...)` is the JSON-ready data (`alpac inspect --json`); `render_step`
prints it. Layers come from the layer clustering pass when it has run (a forward layer per
instruction); without one, `depth_layers` cuts the forward pass into layers of about equal
FLOPs by depth (the number of batch dots and convolutions on the longest path to an
instruction), which is enough to show how backward instructions pair with forward layers.
"""

from __future__ import annotations

from alpac.analysis.step.lattice import Cls, to_json
from alpac.analysis.step.split import PARTS, StepSplit
from alpac.analysis.step.wiring import SinkKind
from alpac.hlo.ir import Instruction
from alpac.hlo.opcodes import CONTRACTIONS
from alpac.plan.program import Role


def depth_layers(split: StepSplit, num_layers: int = 4) -> dict[Instruction, int]:
    """Forward instruction -> layer, cutting the forward pass by batch-dot depth into
    `num_layers` groups of about equal FLOPs."""
    forward = set(split.forward)
    if not forward:
        return {}
    cls = split.cls
    depth: dict[Instruction, int] = {}
    for x in split.module.entry.instructions:
        if x in forward:
            depth[x] = max((depth[o] + (o.opcode in CONTRACTIONS
                                        and isinstance(cls(o), Cls) and cls(o).kind == "S")
                            for o in x.operands if o in depth), default=0)
    costs = split.cost_table()
    flops_at: dict[int, float] = {}
    for x, d in depth.items():
        flops_at[d] = flops_at.get(d, 0.0) + (costs[x].flops if costs is not None
                                              and x in costs else 1.0)
    total = sum(flops_at.values()) or 1.0
    layer_of_depth, acc = {}, 0.0
    for d in sorted(flops_at):
        layer_of_depth[d] = min(int(acc / total * num_layers), num_layers - 1)
        acc += flops_at[d]
    return {x: layer_of_depth[d] for x, d in depth.items()}


def step_report(split: StepSplit, forward_layer: dict[Instruction, int] | None = None,
                num_layers: int = 4, detail: bool = False) -> dict:
    """The JSON-ready report: `split.summary()` plus the layer table (from `forward_layer`,
    or `depth_layers` when none is given) and, with `detail`, every instruction's class,
    parts and forward/backward role."""
    layers_from = "layer clustering"
    if forward_layer is None and split.forward:
        forward_layer = depth_layers(split, num_layers)
        layers_from = f"forward depth cut into {num_layers} layers of about equal FLOPs"
    out = split.summary(forward_layer if split.forward else None)
    out["layers_from"] = layers_from if split.forward else None
    if detail and split.flow is not None:
        fwd, bwd = set(split.forward), set(split.backward)
        membership = {p: set(split.parts[p]) for p in PARTS}
        out["instructions"] = [{
            "name": x.name, "opcode": x.opcode, "class": to_json(split.flow.of(x)),
            "parts": [p for p in PARTS if x in membership[p]],
            "role": Role.FORWARD if x in fwd else Role.BACKWARD if x in bwd else None,
        } for x in split.module.entry.instructions]
    return out


def render_step(report: dict, console) -> None:
    """Print a step report (rich console)."""
    from rich.table import Table

    batch = report["batch"]
    if batch["args"]:
        args = ", ".join(f"param {a['param']} {a['name']} dim {a['dim']}" for a in batch["args"])
        console.print(f"[bold]batch[/]: size {batch['size']} ({batch['confidence']} "
                      f"confidence{', given' if batch['given'] else ''}): {args}")
    else:
        console.print(f"[bold]batch[/]: none found — {batch['reason']}")
    for line in batch["evidence"]:
        console.print(f"  · {line}")
    if report["refusal"]:
        console.print(f"[bold]microbatching refused[/]: {report['refusal']}")
    sizes = report["sizes"]
    parts = Table(title="step parts (whole batch)", show_edge=False)
    for col in ("part", "instructions", "FLOPs", "bytes"):
        parts.add_column(col, justify="left" if col == "part" else "right")
    for part, label in (("prologue", "prologue (once, whole batch)"),
                        ("microbatch", "per microbatch (sum over all)"),
                        ("epilogue", "once per step")):
        s = sizes[part]
        parts.add_row(label, f"{s['instructions']:,}", _si(s["flops"]), _si(s["bytes"]))
    acc, cat = sizes[SinkKind.ACCUMULATE], sizes[SinkKind.CONCATENATE]
    parts.add_row("accumulated", f"{acc['tensors']} tensors", "", _si(acc["bytes"]))
    if cat["tensors"]:
        parts.add_row("concatenated", f"{cat['tensors']} tensors", "", _si(cat["bytes"]))
    console.print(parts)
    console.print(f"loss: {', '.join(report['loss']) or '—'}; forward "
                  f"{report['forward_instructions']:,} / backward "
                  f"{report['backward_instructions']:,} instructions")
    if report.get("layers"):
        table = Table(title=f"forward/backward by layer ({report['layers_from']})",
                      show_edge=False)
        for col in ("layer", "fwd instrs", "fwd FLOPs", "bwd instrs", "bwd FLOPs"):
            table.add_column(col, justify="right")
        for row in report["layers"]:
            table.add_row(str(row["layer"]), f"{row['forward_instructions']:,}",
                          _si(row["forward_flops"]), f"{row['backward_instructions']:,}",
                          _si(row["backward_flops"]))
        console.print(table)


def _si(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "
