"""Seeded mutation fuzzing of the other untrusted inputs: plan directories and cluster files,
beside the HLO fuzzing of tests/test_fuzz.py.

- Plans: two small compiled plans (one stage; two pipelined stages) with one random change
  each: a key of plan.json (or of a stage's decisions file, or of compile-stats.json) deleted,
  added or renamed at any depth, a value of another type, a huge, negative, NaN or infinite
  number, a deeply nested value, a file name that points elsewhere (absolute, '..', NUL,
  empty, a directory, a symlink out, a missing file), a truncated or corrupted file, a
  plan.json that is not JSON. `alpac explain PLAN` and alpa-run's checks before mpiexec (an
  mpiexec that does not exist: a plan that passes them is refused for want of it) must end
  with exit 0 or exit 2 and one line, never exit 1 or a traceback.
- Cluster files: the files of testdata/clusters with one random change each (keys deleted or
  renamed, types changed, figures out of range, nesting, YAML anchors, aliases, merge keys,
  tags, several documents, long strings): `load_cluster` must return a cluster or raise a
  UserError of one line naming the file; a sample of those that load plans a small model.

`python tests/test_fuzz_inputs.py` runs every kind (HLO, plan, cluster) outside pytest and
writes benchmarks/results/fuzz.md and fuzz.json.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import time
from functools import cache
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, TESTDATA  # noqa: E402

SEED = 20261129
PLAN_KINDS = ("delete", "add", "rename", "retype", "number", "nest", "filename", "corrupt",
              "not-json", "decisions", "stats", "pair")
PLAN_CASES = 240  # 20 of each kind, over the two base plans
CLUSTER_KINDS = ("delete", "rename", "retype", "number", "nest", "text-number", "yaml",
                 "pair", "figure")
CLUSTER_CASES = 270  # 30 of each kind, over the nine files of testdata/clusters
COMPILED_CLUSTERS = 30  # of the cluster cases that load: plan mlp_fwd on each
CLUSTERS = tuple(sorted((TESTDATA / "clusters").glob("*.yaml")))
# the base plans: name, model, compile arguments (each plan compiles in about a second)
BASES = (("one-stage", "mlp_fwd", ("--mesh", "2")),
         ("pipelined", "mlp_train", ("--stages", "0-0,1-1", "--micro-batches", "4")))
QUICK = ("--time-limit", "2", "--jobs", "1")
CASE_SECONDS_MAX = 20.0  # a bound on one case (in-process: no start-up)
RSS_MAX_MIB = 3072  # a bound on the runner's peak resident memory, all cases together

OTHER_VALUES = ("x", "", "stage0.hlo", 0, 1, -1, 2.5, [], [1, "a"], {}, {"k": 1}, None, True,
                False, [[0, 1]], {"nodes": 1})
ODD_NUMBERS = (0, -1, -0.0, 1e308, -1e308, 1e-300, float("nan"), float("inf"), float("-inf"),
               2 ** 64, 2 ** 63 - 1, -(2 ** 63), 10 ** 40, 0.5, 3.7, "HUGE-DIGITS")
HUGE_DIGITS = "9" * 5000  # past Python's limit on converting digits to an int


# ---- JSON mutations ------------------------------------------------------------------------

def _children(v) -> list:
    return list(v) if isinstance(v, dict) else list(range(len(v))) if isinstance(v, list) \
        else []


def _walk(doc, rng: random.Random, stop: float = 0.3) -> list:
    """A random path to a value inside `doc` (not the root): a walk down that stops at each
    level with probability `stop`."""
    path, v = [], doc
    while True:
        keys = _children(v)
        if not keys or (path and rng.random() < stop):
            return path
        k = rng.choice(keys)
        path.append(k)
        v = v[k]


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _numbers(doc, path=()) -> list:
    if isinstance(doc, bool):
        return []
    if isinstance(doc, (int, float)):
        return [list(path)]
    return [p for k in _children(doc) for p in _numbers(doc[k], path + (k,))]


def _type_of(v) -> str:
    return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else \
        type(v).__name__


def _nested_text(match: re.Match) -> str:
    """JSON (and YAML flow) text of a value `depth` levels deep, written out as text (Python's
    encoders recurse per level)."""
    depth = int(match.group(1))
    return "".join("[" if i % 3 else '{"k": ' for i in range(depth)) + "0" + "".join(
        "]" if i % 3 else "}" for i in reversed(range(depth)))


def mutate_json(doc, kind: str, rng: random.Random) -> str:
    """Apply one change of `kind` to `doc` in place; returns what it did."""
    if kind == "number":
        paths = _numbers(doc)
        if not paths:
            kind = "retype"
        else:
            path = rng.choice(paths)
            new = rng.choice(ODD_NUMBERS)
            _get(doc, path[:-1])[path[-1]] = new
            return f"{_show(path)} = {new!r}"
    path = _walk(doc, rng)
    if not path:
        return "unchanged (empty document)"
    parent, key = _get(doc, path[:-1]), path[-1]
    if kind == "delete":
        del parent[key]
        return f"deleted {_show(path)}"
    if kind == "add":
        target = _get(doc, path) if isinstance(_get(doc, path), (dict, list)) else parent
        new = rng.choice(OTHER_VALUES)
        if isinstance(target, dict):
            target[rng.choice(["extra", "index", "module", "stages", "file", "zzz"])] = new
        else:
            target.insert(rng.randrange(len(target) + 1), new)
        return f"added {new!r} in {_show(path)}"
    if kind == "rename" and isinstance(parent, dict):
        parent[key + "_renamed"] = parent.pop(key)
        return f"renamed {_show(path)}"
    if kind == "nest":
        depth = rng.choice((3, 10, 50, 58, 63, 64, 65, 100, 2000))
        parent[key] = f"NEST-{depth}"
        return f"{_show(path)} nested {depth} deep"
    old = parent[key]
    new = rng.choice([v for v in OTHER_VALUES if _type_of(v) != _type_of(old)])
    parent[key] = new
    return f"{_show(path)}: {_type_of(old)} -> {new!r}"


def _show(path) -> str:
    return ".".join(map(str, path)) or "(top)"


def dump_json(doc) -> str:
    text = json.dumps(doc, indent=1).replace('"HUGE-DIGITS"', HUGE_DIGITS)
    return re.sub(r'"NEST-(\d+)"', _nested_text, text)


def dump_yaml(doc) -> str:
    text = yaml.safe_dump(doc, sort_keys=False).replace("HUGE-DIGITS", HUGE_DIGITS)
    return re.sub(r"NEST-(\d+)", _nested_text, text)


# ---- plans ---------------------------------------------------------------------------------

def compile_base_plans(where: Path) -> dict[str, Path]:
    """The base plans, compiled in-process into `where`."""
    from click.testing import CliRunner

    from alpac.cli import main
    plans = {}
    for name, model, args in BASES:
        out = where / name
        r = CliRunner().invoke(main, ["compile", str(TESTDATA / "models" / f"{model}.hlo"),
                                      "-o", str(out), *args, *QUICK])
        assert r.exit_code == 0, r.output
        plans[name] = out
    return plans


def _stage_files(plan: Path) -> list[str]:
    return sorted(p.name for p in plan.iterdir() if p.is_file())


def mutate_plan(plan: Path, kind: str, rng: random.Random) -> str:
    """One change of `kind` to the plan directory `plan`; returns what it did."""
    pj = plan / "plan.json"
    if kind == "pair":  # two changes of plan.json at once
        return "; ".join(mutate_plan(plan, rng.choice(("delete", "add", "rename", "retype",
                                                       "number")), rng) for _ in range(2))
    if kind in ("delete", "add", "rename", "retype", "number", "nest"):
        doc = json.loads(pj.read_text())
        what = mutate_json(doc, kind, rng)
        pj.write_text(dump_json(doc))
        return what
    if kind in ("decisions", "stats"):
        name = rng.choice([f for f in _stage_files(plan) if f.endswith(".decisions.json")]) \
            if kind == "decisions" else "compile-stats.json"
        f = plan / name
        if rng.random() < 0.15:
            f.write_text(rng.choice(("[]", "{}", "null", "7", '"x"', "[1, 2]", '[{"a": 1}]')))
            return f"{name} = {f.read_text()}"
        doc = json.loads(f.read_text())
        what = mutate_json(doc, rng.choice(("delete", "add", "rename", "retype", "number",
                                            "nest")), rng)
        f.write_text(dump_json(doc))
        return f"{name}: {what}"
    if kind == "filename":
        doc = json.loads(pj.read_text())
        holders = [(s, key) for s in doc["stages"] for key in ("module", "decisions")]
        holders += [(m, "file") for m in doc["program"]["modules"]]
        holder, key = rng.choice(holders)
        outside = plan.parent / f"{plan.name}-outside.hlo"
        outside.write_text("HloModule outside\n")
        choice = rng.choice(("abs", "dotdot", "nul", "empty", "dot", "dir", "symlink-out",
                             "symlink-loop", "missing", "long", "int", "null", "list",
                             "plan.json", "swap", "dot-slash", "trailing-slash", "backslash"))
        new = {"abs": str(outside), "dotdot": f"../{outside.name}", "nul": "stage0\0.hlo",
               "empty": "", "dot": ".", "dir": "sub", "symlink-out": "out.hlo",
               "symlink-loop": "loop.hlo", "missing": "missing.hlo", "long": "a" * 5000,
               "int": 5, "null": None, "list": ["stage0.hlo"], "plan.json": "plan.json",
               "swap": "stage0.decisions.json" if key != "decisions" else "stage0.hlo",
               "dot-slash": f"./{holder[key]}", "trailing-slash": f"{holder[key]}/",
               "backslash": f"..\\{outside.name}"}[choice]
        if choice == "dir":
            (plan / "sub").mkdir()
        elif choice == "symlink-out":
            (plan / "out.hlo").symlink_to(outside)
        elif choice == "symlink-loop":
            (plan / "loop.hlo").symlink_to(plan / "loop.hlo")
        holder[key] = new
        pj.write_text(json.dumps(doc, indent=1))
        return f"{key} = {choice} {str(new)[:40]!r}"
    if kind == "corrupt":
        name = rng.choice(_stage_files(plan))
        f = plan / name
        data = f.read_bytes()
        how = rng.choice(("truncate", "empty", "non-utf8", "flip", "delete", "directory",
                          "symlink-out", "nul"))
        if how == "truncate":
            f.write_bytes(data[:rng.randrange(len(data))])
        elif how == "empty":
            f.write_bytes(b"")
        elif how == "non-utf8":
            at = rng.randrange(len(data))
            f.write_bytes(data[:at] + b"\xff\xfe\x80" + data[at:])
        elif how == "flip":
            b = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.choice(b'{}[]",:0a\n\\')
            f.write_bytes(bytes(b))
        elif how == "nul":
            at = rng.randrange(len(data))
            f.write_bytes(data[:at] + b"\0" + data[at:])
        elif how == "delete":
            f.unlink()
        elif how == "directory":
            f.unlink()
            f.mkdir()
        else:
            outside = plan.parent / f"{plan.name}-outside"
            outside.write_bytes(data)
            f.unlink()
            f.symlink_to(outside)
        return f"{name}: {how}"
    assert kind == "not-json"
    text = pj.read_text()
    how = rng.choice(("truncate", "empty", "null", "list", "number", "string", "open",
                      "non-utf8", "nan", "bom", "minimal", "deep", "huge-number", "wrong-schema",
                      "duplicate-keys"))
    new = {"truncate": text[:rng.randrange(len(text))], "empty": "", "null": "null",
           "list": "[]", "number": "42", "string": '"alpac.plan/1"', "open": "{",
           "nan": "NaN", "bom": "\ufeff" + text,
           "minimal": '{"schema": "alpac.plan/1"}', "deep": "[" * 100_000,
           "huge-number": text.replace('"num_micro_batches": ', f'"num_micro_batches": '
                                       f'{HUGE_DIGITS}', 1),
           "wrong-schema": text.replace("alpac.plan/1", "alpac.plan/2"),
           "duplicate-keys": "{" + text.strip()[1:-1] + ', "stages": 5}',
           "non-utf8": None}[how]
    if new is None:
        pj.write_bytes(b"\xff" + text.encode())
    else:
        pj.write_text(new)
    return f"plan.json: {how}"


def plan_case(index: int) -> tuple[str, str, int]:
    base = BASES[index % len(BASES)][0]
    kind = PLAN_KINDS[(index // len(BASES)) % len(PLAN_KINDS)]
    return base, kind, SEED + index


def one_line_refusal(code: int, text: str, prog: str) -> str | None:
    """Why an exit code and its error output break the rule (None when they keep it)."""
    if code == 0:
        return None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if code != 2:
        return f"exit {code}"
    if "Traceback" in text or len(lines) != 1 or not lines[0].startswith(f"{prog}: error: "):
        return "not one line of error"
    return None


def run_plan_case(index: int, bases: dict[str, Path], tmp: Path) -> dict:
    """The outcome of one plan case: explain and alpa-run's checks on the mutated plan."""
    from click.testing import CliRunner

    from alpac.cli import main
    from alpac.runtime.launcher import cli as alpa_run

    base, kind, seed = plan_case(index)
    plan = tmp / f"plan{index}"
    shutil.copytree(bases[base], plan)
    what = f"plan {base} {kind}: {mutate_plan(plan, kind, random.Random(seed))}"
    start = time.perf_counter()
    r = CliRunner().invoke(main, ["explain", str(plan)])
    explain = _outcome(r, "alpac")
    r = CliRunner().invoke(alpa_run, [str(plan), "--mpiexec", str(tmp / "no-mpiexec")],
                           obj={"mpi": []})
    run = _outcome(r, "alpa-run")
    if run["code"] == 0:  # it never starts without an mpiexec: a plan that passes is refused
        run["problem"] = "alpa-run exit 0 without an mpiexec"
    return {"what": what, "seconds": time.perf_counter() - start, "explain": explain,
            "alpa-run": run}


def _outcome(result, prog: str) -> dict:
    exc = result.exception if not isinstance(result.exception, SystemExit) else None
    problem = f"uncaught {type(exc).__name__}: {exc}" if exc is not None else \
        one_line_refusal(result.exit_code, result.stderr, prog)
    return {"code": result.exit_code if exc is None else "crash", "problem": problem,
            "output": (result.stderr or result.output).strip()[-400:]}


@pytest.fixture(scope="module")
def base_plans(tmp_path_factory) -> dict[str, Path]:
    return compile_base_plans(tmp_path_factory.mktemp("fuzz-bases"))


@pytest.mark.parametrize("index", range(PLAN_CASES))
def test_plan_mutant_is_explained_or_refused(index, base_plans, tmp_path):
    out = run_plan_case(index, base_plans, tmp_path)
    for prog in ("explain", "alpa-run"):
        assert out[prog]["problem"] is None, \
            f"{out['what']}: {prog}: {out[prog]['problem']}: {out[prog]['output']}"
    assert out["seconds"] < CASE_SECONDS_MAX, out


_DELETE = object()


def _set(path: list, value):
    """A change of a JSON document: the value at `path` replaced (or deleted)."""
    def change(doc):
        holder = _get(doc, path[:-1])
        if value is _DELETE:
            del holder[path[-1]]
        else:
            holder[path[-1]] = value
        return doc
    return change


def _recorded_passes(doc):
    del doc["compiler"]["spec"]
    doc["compiler"]["passes"] = [{"name": "load", "options": {"bogus": 1}}, {"name": "emit"}]
    return doc


# What the fuzz found before plan.json, the decisions files and compile-stats.json were
# checked against what explain reads (alpac/plan/shape.py): each ended in exit 1 with a
# traceback. name: (file, change, a phrase of explain's one-line refusal now, or None where
# it explains the plan)
FOUND = {
    "source.file deleted": ("plan.json", _set(["source", "file"], _DELETE),
                            "source.file: missing key"),
    "num_micro_batches deleted": ("plan.json", _set(["num_micro_batches"], _DELETE),
                                  "num_micro_batches: missing key"),
    "stages deleted": ("plan.json", _set(["stages"], _DELETE), "stages: missing key"),
    "cluster a list": ("plan.json", _set(["cluster"], []), "cluster: expected an object"),
    "reduce_scatter an object": ("plan.json", _set(["reduce_scatter"], {"k": 1}),
                                 "reduce_scatter: expected a list"),
    "reduce_scatter stage a list": ("plan.json", _set(["reduce_scatter", 0, "stage"], [0, 1]),
                                    "reduce_scatter.0.stage: expected a whole number"),
    "mesh shape -inf": ("plan.json", _set(["stages", 0, "mesh", "logical_shape", 0],
                                          float("-inf")),
                        "stages.0.mesh.logical_shape.0: expected a whole number from 1"),
    "compiler deleted": ("plan.json", _set(["compiler"], _DELETE), "compiler: missing key"),
    "only the schema": ("plan.json", lambda doc: {"schema": doc["schema"]}, "missing key"),
    "decisions rows without keys": ("stage0.decisions.json", lambda doc: [{"a": 1}],
                                    "0.instruction: missing key"),
    "decisions row null": ("stage0.decisions.json", _set([0], None), "0: expected an object"),
    # compile-stats.json holds timings only: one of another shape is left out
    "stats a list": ("compile-stats.json", lambda doc: [], None),
    "stats stage null": ("compile-stats.json", _set(["stages", 0], None), None),
    "stats index nested": ("compile-stats.json", _set(["stages", 0, "index"], {"k": 0}), None),
    # recorded passes with an option no pass takes: the spec shown falls back to their names
    "passes with unknown options": ("plan.json", _recorded_passes, None),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_what_the_fuzz_found(name, base_plans, tmp_path):
    from click.testing import CliRunner

    from alpac.cli import main
    file, change, phrase = FOUND[name]
    plan = tmp_path / "plan"
    shutil.copytree(base_plans["one-stage"], plan)
    (plan / file).write_text(json.dumps(change(json.loads((plan / file).read_text()))))
    r = CliRunner().invoke(main, ["explain", str(plan)])
    if phrase is None:
        assert r.exit_code == 0, r.output
        return
    assert r.exit_code == 2 and one_line_refusal(2, r.stderr, "alpac") is None, r.output
    assert phrase in r.stderr and f"{file}: the " in r.stderr, r.stderr


# ---- cluster files -------------------------------------------------------------------------

def cluster_case(index: int) -> tuple[Path, str, int]:
    base = CLUSTERS[index % len(CLUSTERS)]
    kind = CLUSTER_KINDS[(index // len(CLUSTERS)) % len(CLUSTER_KINDS)]
    return base, kind, SEED + 7919 * index


@cache
def _cluster_doc(path: Path) -> str:
    return path.read_text()


# YAML features, each a text change of a cluster file (CANARY: where a tag that ran code would
# leave a trace)
CANARY = "alpac-fuzz-canary"


def _yaml_feature(text: str, rng: random.Random, canary: Path) -> tuple[str, str]:
    doc = yaml.safe_load(text)
    how = rng.choice(("anchor-alias", "merge-key", "merge-bad", "python-object",
                      "python-name", "python-apply", "binary", "set", "timestamp",
                      "documents", "documents-empty", "long-string", "too-long-string",
                      "laughs", "recursive-alias", "duplicate-key", "tab", "bom", "non-utf8",
                      "empty", "comment-only", "null", "list", "scalar", "flow-unclosed",
                      "float-tag", "str-tag-number", "key-tag", "complex-key", "undefined-alias"))
    dump = yaml.safe_dump(doc, sort_keys=False)
    if how in ("anchor-alias", "merge-key"):  # inter_node: intra_node's, or merged into it
        intra = json.dumps(doc["links"]["intra_node"])
        body = {k: v for k, v in doc.items() if k != "links"}
        inter = " *i" if how == "anchor-alias" else "\n    <<: *i\n    latency: 1us"
        return (yaml.safe_dump(body, sort_keys=False) + f"links:\n  intra_node: &i {intra}\n"
                f"  inter_node:{inter}\n", how)
    if how == "merge-bad":
        return dump + "<<: [1, 2]\n", how
    if how in ("python-object", "python-name", "python-apply"):
        tag = {"python-object": "!!python/object:os.system {}",
               "python-name": "!!python/name:os.system",
               "python-apply": f"!!python/object/apply:os.system ['touch {canary}']"}[how]
        return _in_place_of(dump, rng.choice(["name", "nodes", "device"]), tag), how
    if how in _IN_PLACE:
        return _in_place_of(dump, *_IN_PLACE[how]), how
    if how == "documents":
        return dump + "---\n" + dump, how
    if how == "documents-empty":
        return "---\n---\n" + dump, how
    if how == "laughs":
        laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
            f"*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]\n" for i in range(1, 9))
        return laughs + dump, how
    if how == "recursive-alias":
        return "loop: &r [*r]\n" + dump, how
    if how == "duplicate-key":
        return dump + "nodes: 3\n", how
    if how == "tab":
        return dump.replace("  ", "\t", 1), how
    if how == "bom":
        return "\ufeff" + dump, how
    if how == "non-utf8":
        return dump + "\udcff", how  # written with surrogateescape: a lone 0xff byte
    if how == "empty":
        return "", how
    if how == "comment-only":
        return "# nothing\n", how
    if how == "null":
        return "~\n", how
    if how == "list":
        return "- " + dump.replace("\n", "\n  "), how
    if how == "scalar":
        return "just a string\n", how
    if how == "flow-unclosed":
        return "{name: x, nodes: [1, 2\n", how
    if how == "key-tag":
        return dump.replace("nodes:", "!!int 7: 1\nnodes:", 1), how
    if how == "complex-key":
        return dump.replace("nodes:", "? [a, b]\n: 1\nnodes:", 1), how
    return _in_place_of(dump, "nodes", "*nowhere"), how  # undefined-alias


# features that set one key of the file to a value, the original moved aside to `_KEY`
_IN_PLACE = {"binary": ("name", "!!binary aGVsbG8="), "set": ("nodes", "!!set {1, 2}"),
             "timestamp": ("nodes", "2001-12-14t21:59:43.10-05:00"),
             "long-string": ("name", "n" * 900_000), "too-long-string": ("name", "n" * 1_100_000),
             "float-tag": ("nodes", "!!float .nan"), "str-tag-number": ("nodes", "!!str 2")}


def _in_place_of(dump: str, key: str, value: str) -> str:
    return dump.replace(f"{key}:", f"{key}: {value}\n_{key}:", 1)


TEXT_NUMBERS = ("0", "-1", "-0", "0.0", ".inf", "-.inf", ".nan", ".NaN", "1e300", "1e-300",
                "1e999", "-1e999", "9" * 5000, "0x10", "0o17", "1_000", "+5", "1e300 GB/s",
                "1e-300 us", "-5us", "5 furlongs", "nan GB", "inf TFLOPS", "1e18 TFLOP/s",
                "0 B", "1.5", "'3'", "true", "null", "[]", "{}", "1:30", "0b101")


def mutate_cluster(path: Path, kind: str, rng: random.Random, canary: Path) -> tuple[str, str]:
    """The text of a changed cluster file and what changed."""
    text = _cluster_doc(path)
    if kind == "yaml":
        return _yaml_feature(text, rng, canary)
    doc = yaml.safe_load(text)
    if kind == "figure":  # a figure scaled, most often still in range: clusters that load
        from alpac.plan.cluster import load_cluster
        doc = load_cluster(path).to_dict()
        paths = [p for p in _numbers(doc) if p[0] != "calibration"]
        path = rng.choice(paths)
        old = _get(doc, path)
        new = rng.choice((1, 2, 3, 16, 1000)) if path[-1] in ("nodes", "devices_per_node") \
            else old * rng.choice((0.001, 0.1, 0.5, 0.9, 2, 10, 1000))
        _get(doc, path[:-1])[path[-1]] = new
        return dump_yaml(doc), f"{_show(path)}: {old!r} -> {new!r}"
    if kind == "pair":
        whats = [mutate_json(doc, rng.choice(("delete", "rename", "retype", "number")), rng)
                 for _ in range(2)]
        return dump_yaml(doc), "; ".join(whats)
    if kind == "text-number":  # a figure replaced by YAML's own spelling of a number
        paths = _numbers(doc) + [p for p in _leaf_paths(doc) if isinstance(_get(doc, p), str)]
        path = rng.choice(paths)
        marker = "FUZZ-MARKER-0"
        _get(doc, path[:-1])[path[-1]] = marker
        new = rng.choice(TEXT_NUMBERS)
        return yaml.safe_dump(doc, sort_keys=False).replace(repr(marker)[1:-1], new, 1), \
            f"{_show(path)} = {new[:20]}"
    if kind == "number":  # odd numbers, and only where there are numbers
        paths = _numbers(doc)
        path = rng.choice(paths)
        new = rng.choice(ODD_NUMBERS)
        _get(doc, path[:-1])[path[-1]] = new
        return dump_yaml(doc), f"{_show(path)} = {new!r}"
    what = mutate_json(doc, kind, rng)
    return dump_yaml(doc), what


def _leaf_paths(doc, path=()) -> list:
    keys = _children(doc)
    if not keys:
        return [list(path)]
    return [p for k in keys for p in _leaf_paths(doc[k], path + (k,))]


def run_cluster_case(index: int, tmp: Path) -> dict:
    """The outcome of one cluster case: the cluster, or the refusal and its problems."""
    from alpac.errors import UserError
    from alpac.plan.cluster import load_cluster

    base, kind, seed = cluster_case(index)
    canary = tmp / f"{CANARY}-{index}"
    text, what = mutate_cluster(base, kind, random.Random(seed), canary)
    path = tmp / f"cluster{index}.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    out = {"what": f"cluster {base.name} {kind}: {what}", "path": path, "cluster": None,
           "problem": None, "code": 0, "output": ""}
    start = time.perf_counter()
    try:
        out["cluster"] = load_cluster(path)
    except UserError as e:
        message = str(e)
        out["code"], out["output"] = 2, message
        if "\n" in message or not message.startswith(str(path)):
            out["problem"] = f"refusal not one line naming the file: {message[:300]!r}"
    except Exception as e:  # noqa: BLE001 - the fuzz looks for exactly these
        out["code"], out["problem"] = "crash", f"uncaught {type(e).__name__}: {str(e)[:300]}"
    out["seconds"] = time.perf_counter() - start
    _LOADS[index] = out["cluster"] is not None
    if canary.exists():
        out["problem"] = "a YAML tag ran code"
    return out


_LOADS: dict[int, bool] = {}  # cluster case: whether it loads (as the cases run)


def _loading_cases(tmp: Path) -> tuple[int, ...]:
    """The cluster cases that load, their planning checked by the compile sample (the cases
    not run yet run here)."""
    for i in range(CLUSTER_CASES):
        if i not in _LOADS:
            run_cluster_case(i, tmp)
    return tuple(i for i in range(CLUSTER_CASES) if _LOADS[i])


def compile_with_cluster(index: int, tmp: Path) -> dict:
    """Plan mlp_fwd on the cluster of case `index` (which loads), in-process."""
    from click.testing import CliRunner

    from alpac.cli import main
    out = run_cluster_case(index, tmp)
    cluster = out["cluster"]
    mesh = "2" if cluster.num_devices >= 2 else "1"
    start = time.perf_counter()
    r = CliRunner().invoke(main, ["compile", str(TESTDATA / "models" / "mlp_fwd.hlo"),
                                  "--cluster", str(out["path"]), "--mesh", mesh,
                                  "-o", str(tmp / f"plan{index}"), *QUICK])
    result = _outcome(r, "alpac")
    result.update(what=out["what"] + " (compiled)", seconds=time.perf_counter() - start)
    return result


@pytest.mark.parametrize("index", range(CLUSTER_CASES))
def test_cluster_mutant_loads_or_is_refused(index, tmp_path):
    out = run_cluster_case(index, tmp_path)
    assert out["problem"] is None, f"{out['what']}: {out['problem']}"
    assert out["seconds"] < CASE_SECONDS_MAX, out


@pytest.fixture(scope="module")
def loading_cases(tmp_path_factory) -> tuple[int, ...]:
    cases = _loading_cases(tmp_path_factory.mktemp("clusters"))
    assert len(cases) >= COMPILED_CLUSTERS, cases
    return cases


@pytest.mark.parametrize("nth", range(COMPILED_CLUSTERS))
def test_loaded_cluster_figures_reach_the_solver(nth, loading_cases, tmp_path):
    out = compile_with_cluster(loading_cases[nth * len(loading_cases) // COMPILED_CLUSTERS],
                               tmp_path)
    assert out["problem"] is None, f"{out['what']}: {out['problem']}: {out['output']}"


# ---- the runner ----------------------------------------------------------------------------

def _peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _tally(rows: list[dict], kind: str, outcomes: list[tuple[object, str | None, float, str]]
           ) -> None:
    codes = [c for c, _, _, _ in outcomes]
    bad = [(c, p, w) for c, p, _, w in outcomes if p is not None]
    rows.append({"kind": kind, "cases": len(outcomes), "exit 0": codes.count(0),
                 "exit 2": codes.count(2), "other": len(bad),
                 "slowest case (s)": round(max(s for _, _, s, _ in outcomes), 2),
                 "peak RSS so far (MiB)": round(_peak_rss_mib())})
    for c, p, w in bad:
        print(f"  {kind}: {w}: {p}", flush=True)


def main(argv: list[str]) -> int:
    import tempfile

    import test_fuzz
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import write_results

    hlo_cases = int(argv[0]) if argv else test_fuzz.CASES + test_fuzz.SHARED_CASES
    rows: list[dict] = []
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="alpac-fuzz-") as d:
        tmp = Path(d)
        outcomes = []
        for i in range(hlo_cases):
            if not test_fuzz.case(i)[0].exists():
                continue
            (tmp / "hlo").mkdir(exist_ok=True)
            t = time.perf_counter()
            code, exc, what, output = test_fuzz.run_case(i, tmp / "hlo")
            problem = f"uncaught {type(exc).__name__}" if exc is not None else \
                one_line_refusal(code, output, "alpac")
            outcomes.append(("crash" if exc else code, problem, time.perf_counter() - t, what))
            shutil.rmtree(tmp / "hlo")
        _tally(rows, "hlo (alpac compile)", outcomes)

        bases = compile_base_plans(tmp / "bases")
        explain, run = [], []
        for i in range(PLAN_CASES):
            (tmp / "p").mkdir()
            out = run_plan_case(i, bases, tmp / "p")
            for prog, into in (("explain", explain), ("alpa-run", run)):
                o = out[prog]
                into.append((o["code"], o["problem"], out["seconds"], out["what"]))
            shutil.rmtree(tmp / "p")
        _tally(rows, "plan (alpac explain)", explain)
        _tally(rows, "plan (alpa-run checks)", run)

        loads, compiled = [], []
        loading = []
        for i in range(CLUSTER_CASES):
            (tmp / "c").mkdir()
            out = run_cluster_case(i, tmp / "c")
            loads.append((out["code"], out["problem"], out["seconds"], out["what"]))
            if out["cluster"] is not None:
                loading.append(i)
            shutil.rmtree(tmp / "c")
        _tally(rows, "cluster (load_cluster)", loads)
        for nth in range(COMPILED_CLUSTERS):
            (tmp / "c").mkdir()
            out = compile_with_cluster(loading[nth * len(loading) // COMPILED_CLUSTERS],
                                       tmp / "c")
            compiled.append((out["code"], out["problem"], out["seconds"], out["what"]))
            shutil.rmtree(tmp / "c")
        _tally(rows, "cluster (alpac compile --cluster)", compiled)
    seconds = time.time() - start
    command = f".venv/bin/python tests/test_fuzz_inputs.py{' ' + argv[0] if argv else ''}"
    write_results("fuzz", "Seeded fuzzing of alpac's inputs", rows, notes=(
        f"Command: `{command}` ({seconds:.0f} s in all). Each case is one seeded change of a valid input; it must "
        f"end in exit 0 or exit 2 with one line of error (for load_cluster: a UserError of one "
        f"line naming the file), never exit 1, a traceback or an uncaught exception: `other` "
        f"counts those, and must be 0. HLO: tests/test_fuzz.py; plan and cluster: "
        f"tests/test_fuzz_inputs.py (alpa-run: its checks before mpiexec, with an mpiexec "
        f"that does not exist; a plan case's seconds are explain's and alpa-run's together). "
        f"Bounds: {CASE_SECONDS_MAX:g} s a case, {RSS_MAX_MIB} MiB peak RSS of the runner "
        f"process (resource.getrusage; cumulative over the rows, which run in this order)."))
    results = ROOT / "benchmarks" / "results" / "fuzz.json"  # the command beside the figures
    results.write_text(json.dumps({**json.loads(results.read_text()), "command": command,
                                   "seconds": round(seconds)}, indent=1) + "\n")
    return 1 if any(r["other"] or r["slowest case (s)"] > CASE_SECONDS_MAX
                    or r["peak RSS so far (MiB)"] > RSS_MAX_MIB for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
