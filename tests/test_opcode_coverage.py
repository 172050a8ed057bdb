"""Every opcode alpac handles is executed end to end by some program of the suite, or refused.

Handled: the opcodes named by the sharding strategies (`alpac.intraop.strategies`, and the
collectives of the opcode table `alpac.hlo.opcodes` that its builder refuses), the
batch-dimension dataflow (`alpac.analysis.step.dataflow`, whose rules for indexing and windowed ops
live in `alpac.analysis.step.oprules`) and the cost rules (`alpac.analysis.costs`), read from their tables.
Executed: the opcodes of the programs the suite compiles and runs under alpa-run against a
reference: testdata/models (tests/test_compile.py, test_testdata.py) and every program of
the zoo harness (tests/test_zoo.py), the opcode programs of testdata/zoo/opcodes included
(written by testdata/zoo/opcode_programs.py to fill the gaps the others leave).

An opcode that can never appear in a module alpac runs is listed in REFUSED with why, and
alpac must refuse a small module using it: exit 2 and one line.
"""

from __future__ import annotations

import glob
from functools import cache
from pathlib import Path

import pytest
from conftest import TESTDATA

from alpac.analysis.costs import _RULES as COST_RULES
from alpac.analysis.step import dataflow
from alpac.errors import UserError
from alpac.hlo import opcodes, parse_hlo
from alpac.intraop import strategies
from alpac.xla.loader import load_module
from testdata.zoo import run as zoo

# opcode -> (why alpac refuses it, the instructions of a small entry using it over
# p = f32[8,4] parameter(0), the opcode the refusal names when it is another of the pair)
_COLLECTIVE = "a collective: the module is already partitioned (alpac plans it before SPMD)"
_ASYNC = "an asynchronous pair that only XLA's scheduling passes create"
_HOST = "host or channel I/O that alpa-run cannot serve"
REFUSED: dict[str, tuple[str, str, str | None]] = {
    "all-reduce": (_COLLECTIVE, "ROOT r = f32[8,4] all-reduce(p), replica_groups={}, "
                                "to_apply=add", None),
    "all-gather": (_COLLECTIVE, "ROOT r = f32[16,4] all-gather(p), dimensions={0}, "
                                "replica_groups={{0,1}}", None),
    "reduce-scatter": (_COLLECTIVE, "ROOT r = f32[4,4] reduce-scatter(p), dimensions={0}, "
                                    "replica_groups={{0,1}}, to_apply=add", None),
    "all-to-all": (_COLLECTIVE, "ROOT r = f32[8,4] all-to-all(p), dimensions={0}, "
                                "replica_groups={{0,1}}", None),
    "collective-permute": (_COLLECTIVE, "ROOT r = f32[8,4] collective-permute(p), "
                                        "source_target_pairs={{0,1},{1,0}}", None),
    "collective-broadcast": (_COLLECTIVE, "ROOT r = f32[8,4] collective-broadcast(p), "
                                          "replica_groups={{0,1}}", None),
    "all-reduce-start": (_COLLECTIVE, "s = f32[8,4] all-reduce-start(p), replica_groups={}, "
                                      "to_apply=add\n  ROOT d = f32[8,4] all-reduce-done(s)",
                         None),
    "all-reduce-done": (_COLLECTIVE, "", "all-reduce-start"),
    "all-gather-start": (_COLLECTIVE, "s = (f32[8,4], f32[16,4]) all-gather-start(p), "
                                      "dimensions={0}, replica_groups={{0,1}}\n"
                                      "  ROOT d = f32[16,4] all-gather-done(s)", None),
    "all-gather-done": (_COLLECTIVE, "", "all-gather-start"),
    "collective-permute-start": (_COLLECTIVE, "s = (f32[8,4], f32[8,4]) "
                                              "collective-permute-start(p), "
                                              "source_target_pairs={{0,1},{1,0}}\n"
                                              "  ROOT d = f32[8,4] collective-permute-done(s)",
                                 None),
    "collective-permute-done": (_COLLECTIVE, "", "collective-permute-start"),
    "async-start": (_ASYNC, "s = ((f32[8,4]), f32[8,4], s32[]) async-start(p), calls=neg\n"
                            "  u = ((f32[8,4]), f32[8,4], s32[]) async-update(s)\n"
                            "  ROOT d = f32[8,4] async-done(u)", None),
    "async-update": (_ASYNC, "", "async-start"),
    "async-done": (_ASYNC, "", "async-start"),
    "copy-start": (_ASYNC, "s = (f32[8,4], f32[8,4], u32[]) copy-start(p)\n"
                           "  ROOT d = f32[8,4] copy-done(s)", None),
    "copy-done": (_ASYNC, "", "copy-start"),
    "bitcast": ("a layout bitcast: only XLA's layout assignment creates them, and XLA cannot "
                "compile one in a module before optimization",
                "b = f32[32] bitcast(p)\n  ROOT n = f32[32] negate(b)", None),
    "infeed": (_HOST, "t = token[] after-all()\n  i = (f32[8,4], token[]) infeed(t)\n"
                      "  v = f32[8,4] get-tuple-element(i), index=0\n"
                      "  ROOT a = f32[8,4] add(p, v)", None),
    "outfeed": (_HOST, "t = token[] after-all()\n"
                       "  o = token[] outfeed(p, t), outfeed_shape=f32[8,4]\n"
                       "  ROOT n = f32[8,4] negate(p)", None),
    "send": (_HOST, "t = token[] after-all()\n"
                    "  s = (f32[8,4], u32[], token[]) send(p, t), channel_id=1, "
                    "is_host_transfer=true\n"
                    "  sd = token[] send-done(s), channel_id=1, is_host_transfer=true\n"
                    "  ROOT n = f32[8,4] negate(p)", None),
    "send-done": (_HOST, "", "send"),
    "recv": (_HOST, "t = token[] after-all()\n"
                    "  r = (f32[8,4], u32[], token[]) recv(t), channel_id=2, "
                    "is_host_transfer=true\n"
                    "  rd = (f32[8,4], token[]) recv-done(r), channel_id=2, "
                    "is_host_transfer=true\n"
                    "  v = f32[8,4] get-tuple-element(rd), index=0\n"
                    "  ROOT a = f32[8,4] add(p, v)", None),
    "recv-done": (_HOST, "", "recv"),
    "partition-id": ("its value depends on the partitioning (XLA's SPMD partitioner refuses it)",
                     "i = u32[] partition-id()\n  c = f32[] convert(i)\n"
                     "  b = f32[8,4] broadcast(c), dimensions={}\n"
                     "  ROOT a = f32[8,4] add(p, b)", None),
    "set-dimension-size": ("a dynamic shape (alpac plans static shapes; it ran with wrong "
                           "results)",
                           "k = s32[] constant(5)\n"
                           "  s = f32[<=8,4] set-dimension-size(p, k), dimensions={0}\n"
                           "  ROOT n = f32[<=8,4] negate(s)", None),
}

_MODULE = """\
HloModule refused

add {{
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}}

neg {{
  x = f32[8,4] parameter(0)
  ROOT n = f32[8,4] negate(x)
}}

ENTRY e {{
  p = f32[8,4] parameter(0)
  {body}
}}
"""

_TINY = """\
HloModule tiny

ENTRY e {
  p = f32[8,4] parameter(0)
  ROOT n = f32[8,4] negate(p)
}
"""


def handled_opcodes() -> dict[str, list[str]]:
    """opcode -> the tables that name it."""
    tables = {
        "strategies.IDENTITY": strategies.IDENTITY,
        "strategies.TRANSPARENT": strategies.TRANSPARENT,
        "strategies.REPLICATED_ONLY": strategies.REPLICATED_ONLY,
        "strategies.MATERIALIZED": strategies.MATERIALIZED,
        "opcodes.LOOP_FUSIBLE": opcodes.LOOP_FUSIBLE,
        "opcodes.COLLECTIVE_OPS": opcodes.COLLECTIVE_OPS,  # refused by the builder
        "strategies.UNSUPPORTED_OPS": strategies.UNSUPPORTED_OPS,
        "strategies.SOURCE_RULES": strategies.SOURCE_RULES,  # source_strategies
        "strategies.FOLLOW_FIRST": strategies.FOLLOW_FIRST,  # followed_operand, follow,
        "strategies.FOLLOW_LARGEST": strategies.FOLLOW_LARGEST,  # _whole_dims
        "dataflow._rules": Dataflow_rules(),
        "dataflow._PASS_THROUGH": dataflow._PASS_THROUGH,
        "costs._RULES": COST_RULES,
    }
    out: dict[str, list[str]] = {}
    for where, ops in tables.items():
        for op in ops:
            out.setdefault(op, []).append(where)
    return out


def Dataflow_rules() -> set[str]:
    """The opcodes of the dataflow's rule table (built per instance: its values are bound
    methods), read from an analysis of a one-instruction module."""
    return set(dataflow.Dataflow(parse_hlo(_TINY, "tiny.hlo"), {0: 0}, 8)._rules)


def executed_programs() -> list[Path]:
    """The HLO of every program the suite runs under alpa-run against a reference."""
    models = sorted(Path(p) for p in glob.glob(str(TESTDATA / "models" / "*.hlo")))
    zoo_programs = [Path(info["dir"]) / f"{name}.hlo"
                    for name, info in sorted(zoo.manifest().items())]
    return models + zoo_programs


@cache
def executed_opcodes() -> tuple[dict[str, list[str]], dict[str, str]]:
    """(opcode -> programs that hold it, program -> why alpac refuses to load it). A program
    alpac does not load executes nothing."""
    seen: dict[str, list[str]] = {}
    unloadable: dict[str, str] = {}
    for path in executed_programs():
        try:
            module = load_module(path)
        except UserError as e:
            unloadable[path.stem] = str(e)
            continue
        ops = {x.opcode for comp in module.computations for x in comp.instructions}
        for op in ops:
            seen.setdefault(op, []).append(path.stem)
    return seen, unloadable


def test_tables_are_found():
    handled = handled_opcodes()
    # the tables are read, not re-listed: a few opcodes each names
    for op in ("dot", "convolution", "while", "custom-call", "add", "fft", "topk",
               "batch-norm-grad", "opt-barrier", "all-reduce"):
        assert op in handled, op
    assert "optimization-barrier" not in handled, "not an HLO opcode (XLA's is opt-barrier)"


def test_opcode_programs_are_in_the_zoo():
    names = {n for n, info in zoo.manifest().items() if info["dir"].endswith("opcodes")}
    assert len(names) >= 5, names


def test_every_handled_opcode_is_executed_or_refused():
    handled = handled_opcodes()
    seen, unloadable = executed_opcodes()
    gap = sorted(op for op in handled if op not in seen and op not in REFUSED)
    lines = [f"{op} (named by {', '.join(handled[op])})" for op in gap]
    if unloadable:
        lines.append("programs alpac does not load (their opcodes do not count): " + "; ".join(
            f"{k}: {v}" for k, v in sorted(unloadable.items())))
    assert not gap, ("handled opcodes that no program of the suite executes and alpac does "
                     "not refuse:\n  " + "\n  ".join(lines))


def test_refused_opcodes_are_handled_and_not_executed():
    """The refusal list names opcodes alpac's tables know, and no program runs them."""
    handled = handled_opcodes()
    seen, _ = executed_opcodes()
    assert sorted(op for op in REFUSED if op not in handled) == []
    assert {op: seen[op] for op in REFUSED if op in seen} == {}


@pytest.mark.parametrize("opcode", [op for op, (_, body, _) in REFUSED.items() if body])
def test_alpac_refuses(opcode, tmp_path):
    from click.testing import CliRunner

    from alpac.cli import main

    why, body, _ = REFUSED[opcode]
    path = tmp_path / f"{opcode}.hlo"
    path.write_text(_MODULE.format(body=body))
    result = CliRunner().invoke(main, ["compile", str(path), "-o", str(tmp_path / "plan")])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, (opcode, why, result.output[-2000:])
    assert len(lines) == 1 and lines[0].startswith("alpac: error:"), result.output
    named = [op for op, (_, _, first) in REFUSED.items() if op == opcode or first == opcode]
    assert any(f"({op})" in lines[0] or f"an {op} " in lines[0] for op in named), lines[0]
    assert not (tmp_path / "plan").exists()
