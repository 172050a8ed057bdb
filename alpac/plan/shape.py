"""The shape of what `alpac explain` reads from a plan: the keys of plan.json, of a stage's
decisions file and of compile-stats.json it uses, and their types. A tampered or hand-edited
plan is refused in one line naming the key (`UserError`), before anything renders it, instead
of failing with a KeyError or TypeError in the middle of a table.

A spec is one of:
- a type name: "int" (a whole number), "count" (a whole number from 1), "number" (int or
  float, not bool), "str", "any";
- ("list", item, least length), ("map", value spec): a JSON object with any keys,
  ("dict", required {key: spec}, optional {key: spec}): other keys are allowed (and ignored),
  ("null or", spec), ("one of", values).
"""

from __future__ import annotations

from typing import Any

from alpac.errors import UserError

_TYPES = {"int": "a whole number", "count": "a whole number from 1", "number": "a number",
          "str": "a string"}


def _dict(required: dict, optional: dict | None = None) -> tuple:
    return ("dict", required, optional or {})


_GRAPH = _dict({"nodes": "any", "strategies": "any", "edges": "any"})
_STAGE = _dict({
    "index": "int",
    "mesh": _dict({"logical_shape": ("list", "count", 1), "devices": ("list", "int", 1)}),
    "ilp": _dict({"status": "any", "gap": "number", "graph_before_reduction": _GRAPH,
                  "graph_after_reduction": _GRAPH, "rounds": ("list", "any", 0)}),
    "estimate": _dict({"time_s": "number", "compute_s": "number", "communication_s": "number",
                       "peak_memory_bytes": "number"},
                      {"time_per_microbatch_s": "number",
                       "activation_bytes_per_microbatch": ("null or", "number"),
                       "microbatches_in_flight": "any"}),
    "layers": ("null or", ("list", "int", 0)),
    "collectives": ("map", _dict({"count": "any", "bytes": "number", "seconds": "number"})),
    "decisions": "str"},
    {"loop_iterations": ("null or", ("list", "int", 0)),
     "remat": ("null or", ("map", "str"))})
_UPDATE = _dict({"stage": "int", "optimizer_state_params": "any"},
                {"rewritten": ("null or", ("list", "str", 0)), "applied": "any",
                 "zero": "any", "accumulation": "str", "already_split": "any",
                 "time_before_s": "number", "time_after_s": "number",
                 "peak_memory_before_bytes": "number", "peak_memory_after_bytes": "number"})
_ESTIMATE = _dict({}, {k: "number" for k in (
    "iteration_time_s", "peak_memory_bytes", "host_cores_s", "bubble_fraction",
    "bytes_between_meshes")})
PLAN = _dict({
    "source": _dict({"file": "str", "module": "str"}),
    "cluster": _dict({"name": "str", "nodes": "int", "devices_per_node": "int"},
                     {"calibration": ("map", "any")}),
    "compiler": _dict({}, {"spec": "str", "passes": (
        "list", _dict({"name": "str"}, {"options": ("map", "any")}), 0)}),
    "num_micro_batches": "count",
    "stages": ("list", _STAGE, 0)},
    {"estimate": _ESTIMATE, "devices_used": ("null or", "int"),
     "pipelining": ("null or", ("map", "any")), "microbatching": ("null or", ("map", "any")),
     "layer_loops": ("null or", _dict({}, {"loops": ("list", "any", 0)})),
     "reduce_scatter": ("null or", ("list", _UPDATE, 0)),
     "program": _dict({}, {"schedule": ("one of", ("gpipe", "1f1b")),
                           "modules": ("list", ("map", "any"), 0)})})
DECISIONS = ("list", _dict({"instruction": "str", "opcode": "str", "shape": "str",
                            "sharding": "str", "strategy": "str",
                            "collectives": ("list", _dict({"kind": "str", "bytes": "number"}),
                                            0)}), 0)
STATS = _dict({}, {"stages": ("list", _dict({"index": "int", "ilp_solve_time_s": "number"}),
                              0),
                   "pass_seconds": ("map", "number")})


def problem(value: Any, spec, where: str = "") -> str | None:
    """Where `value` departs from `spec` and how ("stages.0.mesh: expected ..."), or None."""
    if isinstance(spec, str):
        if spec == "any" or _is(value, spec):
            return None
        return f"{where or '(top level)'}: expected {_TYPES[spec]}, got {_describe(value)}"
    form = spec[0]
    if form == "null or":
        return None if value is None else problem(value, spec[1], where)
    if form == "one of":
        return None if isinstance(value, str) and value in spec[1] else \
            f"{where}: expected one of {', '.join(spec[1])}, got {_describe(value)}"
    if form == "list":
        if not isinstance(value, list) or len(value) < spec[2]:
            return f"{where or '(top level)'}: expected a list" + \
                (f" of at least {spec[2]} item(s)" if spec[2] else "") + \
                f", got {_describe(value)}"
        for i, item in enumerate(value):
            if found := problem(item, spec[1], f"{where}.{i}" if where else str(i)):
                return found
        return None
    if not isinstance(value, dict):
        return f"{where or '(top level)'}: expected an object, got {_describe(value)}"
    if form == "map":
        items = value.items()
    else:
        missing = [k for k in spec[1] if k not in value]
        if missing:
            return f"{where + '.' if where else ''}{missing[0]}: missing key"
        items = [(k, value[k]) for k in (*spec[1], *spec[2]) if k in value]
        specs = {**spec[1], **spec[2]}
    for k, v in items:
        sub = spec[1] if form == "map" else specs[k]
        if found := problem(v, sub, f"{where}.{k}" if where else str(k)):
            return found
    return None


def plan_problem(plan: dict) -> str | None:
    """Where the plan departs from what `alpac explain` reads, or None: `PLAN`, and the keys
    one key makes necessary."""
    if found := problem(plan, PLAN):
        return found
    if "spec" not in plan["compiler"] and "passes" not in plan["compiler"]:
        return "compiler: expected a key spec or passes, got neither"
    for i, stage in enumerate(plan["stages"]):
        where, e = f"stages.{i}", stage["estimate"]
        if len(plan["stages"]) > 1 and "time_per_microbatch_s" not in e:
            return f"{where}.estimate.time_per_microbatch_s: missing key (the plan has stages)"
        if e.get("activation_bytes_per_microbatch") is not None and \
                "microbatches_in_flight" not in e:
            return f"{where}.estimate.microbatches_in_flight: missing key"
        if stage["layers"] and len(stage["layers"]) != 2:
            return f"{where}.layers: expected [first, last], got {len(stage['layers'])} items"
        for layer in stage.get("remat") or {}:
            if not layer.isdigit():
                return f"{where}.remat: expected layer numbers as keys, got {layer[:40]!r}"
    for i, update in enumerate(plan.get("reduce_scatter") or []):
        needed = ["accumulation", "applied", "zero"] if update.get("rewritten") else []
        if "time_after_s" in update:
            needed += ["time_before_s", "peak_memory_before_bytes", "peak_memory_after_bytes"]
        if missing := [k for k in needed if k not in update]:
            return f"reduce_scatter.{i}.{missing[0]}: missing key"
    return None


def check(value: Any, spec, path, what: str) -> None:
    """UserError naming `path` (a `what`: "plan file") and the key, unless `value` fits."""
    if found := problem(value, spec):
        raise UserError(f"the {what} is malformed: {found}", path=str(path))


def _is(value: Any, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if isinstance(value, bool):
        return False
    if kind == "number":
        return isinstance(value, (int, float))
    return isinstance(value, int) and (kind == "int" or value >= 1)


def _describe(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int) and v.bit_length() > 128:
        return f"an integer of {v.bit_length()} bits"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return repr(v[:40] + ("..." if len(v) > 40 else ""))
    return {dict: "an object", list: "a list"}.get(type(v), type(v).__name__)
