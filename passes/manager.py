"""Passes, their registry, and the manager that runs a pipeline of them.

A pass is a small frozen dataclass: a `name`, a one-line `description`, its options as typed
fields, the result types it `requires` and `provides`, and a `run(ctx)` that reads its inputs
with `ctx.get(Type)` and hands on what it made with `ctx.put(result)`. Results are typed and
frozen: the IR (`Module`), analyses (costs, batch inputs, the step split) and decisions (the
stage assignment, the sharded stages, ...). A result may have `plan_entries()` (its share of
plan.json), `modules()` (IR the manager verifies) and `check()` (its postcondition, None when
it holds). Built-in passes are listed in `passes/__init__.py`; other installed packages add
passes through the entry-point group `alpac.passes` (`name = "package.module:PassClass"`).
"""

from __future__ import annotations

import dataclasses
import time
import typing
from dataclasses import dataclass, field
from importlib import import_module, metadata
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar

from alpac.errors import UserError
from alpac.hlo import Module, print_module
from alpac.hlo.verify import InvalidIR, verify_module

ENTRY_POINT_GROUP = "alpac.passes"
R = TypeVar("R")


@dataclass
class CompileContext:
    """What the passes of one compile share: the input, the cluster and the typed results."""

    model_path: Path
    cluster: Any  # alpac.plan.cluster.Cluster
    memory_budget_bytes: float | None = None  # what a plan must fit per device (--memory-budget)
    results: dict[type, object] = field(default_factory=dict)  # by type, in the order made
    stats: dict = field(default_factory=dict)  # run-dependent figures (solve times, ...)
    timings: dict[str, float] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    on_progress: Callable[[str, int, int], None] | None = None  # (what, done, total)
    running: Pass | None = None  # the pass being run: what it may get, find and put

    def get(self, kind: type[R]) -> R:
        """The result of that type; a pass gets only what it declared it `requires`."""
        self._declared(kind, "requires")
        return self.results[kind]

    def find(self, kind: type[R]) -> R | None:
        """The result of that type if an earlier pass made one (declared `optional`)."""
        self._declared(kind, "requires", "optional")
        return self.results.get(kind)

    def put(self, result: object) -> None:
        self._declared(type(result), "provides")
        self.results[type(result)] = result

    def _declared(self, kind: type, *lists: str) -> None:
        p = self.running
        if p is not None and not any(kind in getattr(p, name) for name in lists):
            raise TypeError(f"{kind.__name__} is not in the pass's {' or '.join(lists)}")

    @property
    def module(self) -> Module | None:
        return self.results.get(Module)

    def plan_entries(self) -> dict:
        """plan.json's entries, from every result that has some, in the order made."""
        entries: dict = {}
        for result in self.results.values():
            if hasattr(result, "plan_entries"):
                entries.update(result.plan_entries())
        return entries

    def progress(self, what: str, done: int, total: int) -> None:
        """Report the steps of a long pass (ILP solves) to whoever shows progress."""
        if self.on_progress:
            self.on_progress(what, done, total)

    @property
    def budget(self) -> float:
        """Bytes per device every stage must fit: --memory-budget, else the device memory."""
        return self.memory_budget_bytes or float(self.cluster.device.memory)


@dataclass(frozen=True)
class Pass:
    """Base of every pass. Subclasses are frozen dataclasses whose fields are the options."""

    name: ClassVar[str]
    description: ClassVar[str]
    requires: ClassVar[tuple[type, ...]] = ()  # results it reads (ctx.get)
    optional: ClassVar[tuple[type, ...]] = ()  # results it reads when present (ctx.find)
    provides: ClassVar[tuple[type, ...]] = ()  # results it makes (ctx.put)

    def run(self, ctx: CompileContext) -> None:
        raise NotImplementedError

    @classmethod
    def with_options(cls, options: dict[str, str]) -> "Pass":
        """An instance from option strings, each converted to its field's type hint."""
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for key, text in options.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise UserError(f"pass '{cls.name}' has no option '{key}'; it has: "
                                f"{', '.join(sorted(fields)) or 'none'}")
            values[name] = _convert(text, name, hints[name], cls.name)
        return cls(**values)

    def spec(self) -> str:
        """The `--passes` item that makes this pass: its name and the options not at their
        defaults, e.g. `stage-construction{micro_batches=4}`."""
        changed = [f"{f.name}={_spec_value(getattr(self, f.name))}"
                   for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        return f"{self.name}{{{','.join(changed)}}}" if changed else self.name


def pipeline_spec(passes: list[Pass]) -> str:
    """The `--passes` string that reproduces a pipeline."""
    return ",".join(p.spec() for p in passes)


def _spec_value(value) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f'"{text}"' if any(c in text for c in ',{}="') else text


def _convert(text: str, name: str, kind: type, pass_name: str):
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind in (int, float):
            return kind(text)
    except ValueError:
        raise UserError(f"option '{name}' of pass '{pass_name}' expects {kind.__name__}, got "
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
    from alpac.passes import BUILTIN_PASSES

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
    """`a,b{opt=1,other=x},c` -> [(name, {option: text})]; a value holding commas or braces
    is quoted: `stage-construction{stages="0-3,4-7"}`."""
    out = []
    for item in _split_outside(spec, ","):
        name, _, rest = item.partition("{")
        options = {}
        for kv in _split_outside(rest.rstrip().removesuffix("}"), ","):
            key, eq, value = kv.partition("=")
            if not eq:
                raise UserError(f"pass option '{kv}' of '{name.strip()}' must be key=value")
            options[key.strip()] = value.strip().removeprefix('"').removesuffix('"')
        out.append((name.strip(), options))
    return out


def _split_outside(text: str, sep: str) -> list[str]:
    """`text` split at `sep` where it is outside braces and quotes; empty items dropped."""
    items, depth, quoted, cur = [], 0, False, ""
    for c in text:
        quoted ^= c == '"'
        depth += 0 if quoted else (c == "{") - (c == "}")
        if c == sep and depth == 0 and not quoted:
            items.append(cur)
            cur = ""
        else:
            cur += c
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
            missing = [kind.__name__ for kind in p.requires if kind not in ctx.results]
            if missing:
                raise PassFailed(p.name, ctx.ran, f"it requires {', '.join(missing)}, which no "
                                 f"earlier pass provided")
            if self.on_start:
                self.on_start(p)
            before = dict(ctx.results)
            start = time.perf_counter()
            ctx.running = p
            try:
                p.run(ctx)
            except (UserError, PassFailed):
                raise
            except Exception as e:
                raise PassFailed(p.name, ctx.ran, f"{type(e).__name__}: {e}") from e
            finally:
                ctx.running = None
            elapsed = time.perf_counter() - start
            self.check(p, ctx, before)
            ctx.timings[p.name] = ctx.timings.get(p.name, 0.0) + elapsed
            ctx.ran.append(p.name)
            if self.on_end:
                self.on_end(p, elapsed)
            if p.name in self.dump_after and ctx.module is not None:
                target = (self.dump_dir or Path(".")) / f"after-{p.name}.hlo"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(print_module(ctx.module))
        return ctx

    def check(self, p: Pass, ctx: CompileContext, before: dict) -> None:
        """Postconditions: the pass made what it declared and nothing else, every module it
        made (and the IR) verifies, and each new result's own check holds."""
        made = [r for kind, r in ctx.results.items() if before.get(kind) is not r]
        absent = [kind.__name__ for kind in p.provides if kind not in ctx.results]
        if absent:
            raise PassFailed(p.name, ctx.ran, f"it did not provide {', '.join(absent)}")
        modules = [ctx.module] if ctx.module is not None else []
        for result in made:
            if hasattr(result, "modules"):
                modules += [m for m in result.modules() if m is not ctx.module]
        for module in modules:
            try:
                verify_module(module)
            except InvalidIR as e:
                raise PassFailed(p.name, ctx.ran, f"it left the IR invalid: {e}") from e
        for result in made:
            broken = result.check() if hasattr(result, "check") else None
            if broken:
                raise PassFailed(p.name, ctx.ran, f"its {type(result).__name__} is wrong: "
                                 f"{broken}")
