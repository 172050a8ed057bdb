"""Cautions about a plan that its figures do not show, one line each, kept in plan.json
(`notes`): `alpac compile` says them when it writes the plan, `alpac explain` above the plan,
and `alpa-run` those that bear on the run."""

from __future__ import annotations

# the step trains, but nothing carries its state from one step to the next
STATELESS_STEP = "stateless-step"
# estimates from assumed CPU figures, not measured ones
UNCALIBRATED_CPU = "uncalibrated-cpu"


def plan_notes(module, cluster, trains: bool) -> list[dict]:
    """The notes of a plan of `module` (the source, its input_output_alias as given) for
    `cluster`; `trains`: the step has a backward pass."""
    notes = []
    if trains and not module.input_output_alias:
        notes.append({"kind": STATELESS_STEP, "text": (
            "the step trains (it has a backward pass) but aliases no output to an input: "
            "nothing carries its state to the next step, so each of alpa-run's --iters runs "
            "the first step again; export it with the state donated "
            "(jax.jit(step, donate_argnums=...))")})
    if cluster.device.name == "cpu" and cluster.calibration is None:
        notes.append({"kind": UNCALIBRATED_CPU, "text": (
            f"the cluster '{cluster.name}' is not calibrated: the estimates price assumed CPU "
            f"figures and may be 100x or more off this machine's clock; `alpac calibrate -o "
            f"FILE` measures them (then compile with --cluster FILE)")})
    return notes


def notes_of(plan: dict, kind: str | None = None) -> list[str]:
    """The texts of the plan's notes (of one kind), skipping malformed entries."""
    notes = plan.get("notes")
    return [n["text"] for n in notes if isinstance(n, dict) and isinstance(n.get("text"), str)
            and (kind is None or n.get("kind") == kind)] if isinstance(notes, list) else []
