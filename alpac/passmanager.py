"""Passes, their registry, and the manager that runs a pipeline of them.

A pass is a small dataclass: a `name`, a one-line `description`, its options as fields, the
analyses it `requires` and `provides`, and a `run(ctx)`. Passes talk to each other only through
the context's IR (`ctx.module`, with analyses attached under their names) and the plan being
built (`ctx.plan`). Built-in passes are listed in `passes/__init__.py`; other installed packages
add passes through the entry-point group `alpac.passes` (`name = "package.module:PassClass"`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from importlib import import_module, metadata
from pathlib import Path
from typing import Any, Callable, ClassVar

from alpac.errors import UserError
from alpac.hlo import Module, print_module
from alpac.hlo.verify import InvalidIR, verify_module

ENTRY_POINT_GROUP = "alpac.passes"


@dataclass
class CompileContext:
    """What the passes of one compile share: the input, the cluster, the IR and the plan."""

    model_path: Path
    cluster: Any  # alpac.cluster.Cluster
    memory_budget_bytes: float | None = None  # what a plan must fit per device (--memory-budget)
    module: Module | None = None
    plan: dict = field(default_factory=dict)  # filled by the passes, written by the driver
    artifacts: dict[str, str] = field(default_factory=dict)  # plan-relative path -> text
    stats: dict = field(default_factory=dict)  # run-dependent figures (solve times, ...)
    timings: dict[str, float] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    on_progress: Callable[[str, int, int], None] | None = None  # (what, done, total)

    def progress(self, what: str, done: int, total: int) -> None:
        """Report the steps of a long pass (ILP solves) to whoever shows progress."""
        if self.on_progress:
            self.on_progress(what, done, total)

    @property
    def budget(self) -> float:
        """Bytes per device every stage must fit: --memory-budget, else the device memory."""
        return self.memory_budget_bytes or float(self.cluster.device.memory)


@dataclass
class Pass:
    """Base of every pass. Subclasses are dataclasses whose fields are the pass's options."""

    name: ClassVar[str]
    description: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()

    def run(self, ctx: CompileContext) -> None:
        raise NotImplementedError

    @classmethod
    def with_options(cls, options: dict[str, str]) -> "Pass":
        """An instance from option strings, each converted to its field's type."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, text in options.items():
            f = fields.get(key.replace("-", "_"))
            if f is None:
                raise UserError(f"pass '{cls.name}' has no option '{key}'; it has: "
                                f"{', '.join(fields) or 'none'}")
            values[f.name] = _convert(text, f, cls.name)
        return cls(**values)


def _convert(text: str, f: dataclasses.Field, pass_name: str):
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("bool"):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
    except ValueError:
        raise UserError(f"option '{f.name}' of pass '{pass_name}' expects {kind}, got "
                        f"'{text}'") from None
    return text


class PassFailed(Exception):
    """A pass raised or left the IR broken; names the pass and those that ran before it."""

    exit_code = 1

    def __init__(self, pass_name: str, ran: list[str], cause: str):
        before = ", ".join(ran) if ran else "none"
        super().__init__(f"pass '{pass_name}' failed (passes run before it: {before}): {cause}")
        self.pass_name = pass_name


# ---- registry -------------------------------------------------------------------------------

def available_passes() -> dict[str, type[Pass]]:
    """Every pass by name: the built-ins, then those registered by installed packages."""
    from passes import BUILTIN_PASSES

    registry: dict[str, type[Pass]] = {}
    for name, target in BUILTIN_PASSES.items():
        registry[name] = _load(target)
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Pass)):
            raise UserError(f"entry point '{ep.name}' in group {ENTRY_POINT_GROUP} is not an "
                            f"alpac Pass class ({ep.value})")
        registry.setdefault(cls.name, cls)
    return registry


def _load(target: str) -> type[Pass]:
    module_name, _, attr = target.partition(":")
    return getattr(import_module(module_name), attr)


def parse_pipeline(spec: str) -> list[tuple[str, dict[str, str]]]:
    """`a,b{opt=1,other=x},c` -> [(name, {option: text})]."""
    out = []
    for item in _split_spec(spec):
        name, _, rest = item.partition("{")
        options = {}
        for kv in rest.rstrip().removesuffix("}").split(","):
            if kv.strip():
                key, eq, value = kv.partition("=")
                if not eq:
                    raise UserError(f"pass option '{kv.strip()}' of '{name.strip()}' must be "
                                    f"key=value")
                options[key.strip()] = value.strip()
        out.append((name.strip(), options))
    return out


def _split_spec(spec: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for c in spec:
        depth += (c == "{") - (c == "}")
        if c == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += c
    if cur.strip():
        items.append(cur)
    return [i.strip() for i in items if i.strip()]


# ---- manager --------------------------------------------------------------------------------

@dataclass
class PassManager:
    passes: list[Pass]
    dump_after: frozenset[str] = frozenset()
    dump_dir: Path | None = None
    on_start: Callable[[Pass], None] | None = None
    on_end: Callable[[Pass, float], None] | None = None

    def run(self, ctx: CompileContext) -> CompileContext:
        for p in self.passes:
            if ctx.module is not None:
                missing = [r for r in p.requires if r not in ctx.module.analyses]
            else:
                missing = list(p.requires)
            if missing:
                raise PassFailed(p.name, ctx.ran, f"it requires {', '.join(missing)}, which no "
                                 f"earlier pass provided")
            if self.on_start:
                self.on_start(p)
            start = time.perf_counter()
            try:
                p.run(ctx)
            except (UserError, PassFailed):
                raise
            except Exception as e:
                raise PassFailed(p.name, ctx.ran, f"{type(e).__name__}: {e}") from e
            elapsed = time.perf_counter() - start
            if ctx.module is not None:
                try:
                    verify_module(ctx.module)
                except InvalidIR as e:
                    raise PassFailed(p.name, ctx.ran, f"it left the IR invalid: {e}") from e
                absent = [a for a in p.provides if a not in ctx.module.analyses]
                if absent:
                    raise PassFailed(p.name, ctx.ran, f"it did not provide {', '.join(absent)}")
            ctx.timings[p.name] = ctx.timings.get(p.name, 0.0) + elapsed
            ctx.ran.append(p.name)
            if self.on_end:
                self.on_end(p, elapsed)
            if p.name in self.dump_after and ctx.module is not None:
                target = (self.dump_dir or Path(".")) / f"after-{p.name}.hlo"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(print_module(ctx.module))
        return ctx
