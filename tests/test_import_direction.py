"""Imports point one way: down the data flow. A module may import its own layer and the layers
below it, never one above; the runtime imports only the plan, the XLA bridge and the IR below
them. A new upward import fails here, naming the file, the line and both layers."""

from __future__ import annotations

import ast
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"alpac": ROOT / "alpac", "alpac.passes": ROOT / "passes",
           "alpac.runtime": ROOT / "runtime"}

# bottom to top; a module belongs to the longest prefix that names it
LAYERS = [
    ("alpac.errors", "alpac.units", "alpac.procs", "alpac.hlo"),  # the IR; processes
    ("alpac.xla",),  # the XLA bridge and loaders
    ("alpac.plan",),  # what a plan is: cluster, meshes, shardings, program, schedule, files
    ("alpac.analysis",),  # costs, batch dimensions, the step split
    ("alpac.intraop",),  # shardings: space, strategies, ILP, annotation, rules
    ("alpac.interop",),  # layers, step graph, layer pricing, stage DP, submeshes
    ("alpac.passes",),  # adapters around one library call each, and their manager
    ("alpac.driver", "alpac.inspect", "alpac.cli"),  # the recipe and the command line
    ("alpac.runtime",),
]
RUNTIME_MAY_IMPORT = ("alpac.errors", "alpac.units", "alpac.procs", "alpac.hlo", "alpac.xla",
                      "alpac.plan", "alpac.runtime")


def layer_of(module: str) -> int:
    if module == "alpac":  # the package itself: its version only
        return 0
    best = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (level, prefix)
    assert best is not None, f"{module} is in no layer; add it to LAYERS"
    return best[0]


def modules():
    """(module name, path) of every source file of the distribution."""
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if package == "alpac" and parts and parts[0] in ("passes", "runtime"):
                continue
            yield ".".join([package, *parts]), path


def alpac_imports(path: Path):
    """(line, imported module) for every import of an alpac module, at any depth."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in names if _is_module(n)] or [node.module]
        else:
            continue
        for name in names:
            if name == "alpac" or name.startswith("alpac."):
                yield node.lineno, name


def _is_module(name: str) -> bool:
    return name == "alpac" or any(name == m for m, _ in MODULES)


MODULES = list(modules())


def test_every_import_points_down():
    upward = []
    for module, path in MODULES:
        here = layer_of(module)
        for line, target in alpac_imports(path):
            if target in ("alpac", "alpac.__version__"):
                continue
            if layer_of(target) > here:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {module} (layer "
                              f"{LAYERS[here][0]}) imports {target} (layer "
                              f"{LAYERS[layer_of(target)][0]}, above it)")
    assert not upward, "\n".join(upward)


def test_the_runtime_imports_only_the_plan_the_bridge_and_the_ir():
    wrong = [f"{path.relative_to(ROOT)}:{line}: imports {target}"
             for module, path in MODULES if module.startswith("alpac.runtime")
             for line, target in alpac_imports(path)
             if not any(target == p or target.startswith(p + ".") for p in RUNTIME_MAY_IMPORT)]
    assert not wrong, "\n".join(wrong)


def test_the_layer_table_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from alpac.interop.stage_dp import stage_dp\n")
    assert [t for _, t in alpac_imports(bad)] == ["alpac.interop.stage_dp"]
    assert layer_of("alpac.interop.stage_dp") > layer_of("alpac.hlo.ir")


def test_the_distribution_has_one_import_name():
    assert metadata.distribution("alpac").read_text("top_level.txt").split() == ["alpac"]
    import alpac.passes
    import alpac.runtime
    assert Path(alpac.passes.__file__).parent == ROOT / "passes"
    assert Path(alpac.runtime.__file__).parent == ROOT / "runtime"
