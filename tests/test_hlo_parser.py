"""The HLO IR round trip: parse -> print is a fixed point, and XLA accepts what we print with
the same instructions and shapes."""

from __future__ import annotations

import re

import pytest
from conftest import SHARED, TESTDATA

from alpac.errors import UserError
from alpac.hlo import parse_hlo, print_module
from alpac.hlo.shape import shape_from_string
from alpac.xla.bridge import xla_reprint

CORPUS = sorted((SHARED / "hlo-corpus").glob("*.hlo")) + sorted(
    (SHARED / "xla-cases").rglob("*.hlo")) + sorted((TESTDATA / "models").glob("*.hlo"))


def _id(path):
    return path.name


def test_corpus_is_there():
    assert len([p for p in CORPUS if "xla-cases" in str(p)]) >= 94
    assert len([p for p in CORPUS if "hlo-corpus" in str(p)]) >= 7


@pytest.mark.parametrize("path", CORPUS, ids=_id)
def test_round_trip(path):
    text = path.read_text()
    module = parse_hlo(text, str(path))
    printed = print_module(module)
    again = print_module(parse_hlo(printed, "printed"))
    assert again == printed, "print(parse(x)) must be a fixed point"

    # XLA's own parser accepts the printed text, with the same instructions and shapes
    # (XLA renames instructions whose names repeat across computations, so compare contents).
    xla = parse_hlo(xla_reprint(printed), "xla")

    def contents(m):
        return sorted((i.opcode, str(i.shape.without_layout())) for i in m.instructions())

    assert xla.instruction_count() == module.instruction_count()
    assert contents(xla) == contents(module)


def test_keeps_everything():
    text = """
HloModule m, input_output_alias={ {}: (1, {}, may-alias) }, buffer_donor={ (0, {}) }, entry_computation_layout={(f32[4]{0}, f32[4]{0})->f32[4]{0}}, frontend_attributes={a="b"}, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0:T(128)} parameter(0), sharding={devices=[2]<=[2]}, metadata={op_name="a/b" source_file="x.py" source_line=3 source_end_line=4 source_column=1 source_end_column=2}
  %p1 = f32[4]{0} parameter(1)
  %r = f32[] reduce(f32[4]{0} %p0, f32[] %c), dimensions={0}, to_apply=%add, some_future_attr={x=[1,2]}
  %c = f32[] constant(0)
  %b = f32[4]{0} broadcast(%r), dimensions={}
  ROOT %o = f32[4]{0} add(%b, p1), backend_config={"k":"v, with comma"}
}
"""
    module = parse_hlo(text)
    printed = print_module(module)
    for piece in ['input_output_alias={ {}: (1, {}, may-alias) }', 'buffer_donor={ (0, {}) }',
                  'frontend_attributes={a="b"}', 'num_partitions=2', '{0:T(128)}',
                  'sharding={devices=[2]<=[2]}', 'source_end_column=2',
                  'some_future_attr={x=[1,2]}', 'backend_config={"k":"v, with comma"}',
                  'to_apply=%add']:
        assert piece in printed
    entry = module.entry
    # instructions are re-ordered so that operands come first
    names = [i.name for i in entry.instructions]
    assert names.index("c") < names.index("r")
    assert module.input_output_alias[0].parameter_number == 1
    assert module.entry_layout[1] == shape_from_string("f32[4]{0}")
    assert entry.root.name == "o"
    assert [p.name for p in entry.parameters] == ["p0", "p1"]


def test_shapes():
    s = shape_from_string("(f32[2,3]{1,0}, /*index=1*/bf16[4]{0:T(8,128)}, (s32[], pred[1]))")
    assert s.is_tuple and len(s.tuple_shapes) == 3
    assert s.tuple_shapes[1].layout == "0:T(8,128)"
    assert s.byte_size == 2 * 3 * 4 + 4 * 2 + 4 + 1
    assert [idx for idx, _ in s.leaves()] == [(0,), (1,), (2, 0), (2, 1)]
    assert shape_from_string("f32[<=10,3]").dynamic_dims == (True, False)
    assert str(shape_from_string("bf16[2, 2048]")) == "bf16[2,2048]"


BAD_INPUTS = [
    # (name, text, expected line, expected phrase)
    ("empty", "", 1, "empty"),
    ("blank", "\n\n   \n", None, "empty"),
    ("truncated", "HloModule m\n\nENTRY %e {\n  %p = f32[2] parameter(0)\n  ROOT %a = f32[2] add(%p, %p",
     5, "unbalanced"),
    ("unclosed", "HloModule m\nENTRY %e {\n  ROOT %p = f32[2] parameter(0)\n", 4, "not closed"),
    ("garbage", "\x7fELF\x02\x01\x01 garbage", 1, "HloModule"),
    ("undefined computation",
     "HloModule m\nENTRY %e {\n  %p = f32[2] parameter(0)\n  %c = f32[] constant(0)\n"
     "  ROOT %r = f32[] reduce(%p, %c), dimensions={0}, to_apply=%nope\n}\n", 5, "'nope'"),
    ("undefined operand",
     "HloModule m\nENTRY %e {\n  %p = f32[2] parameter(0)\n  ROOT %a = f32[2] add(%p, %q)\n}\n",
     4, "operand 'q'"),
    ("malformed shape",
     "HloModule m\nENTRY %e {\n  ROOT %p = f32[2,x] parameter(0)\n}\n", 3, "malformed"),
    ("unknown dtype",
     "HloModule m\nENTRY %e {\n  ROOT %p = q99[2] parameter(0)\n}\n", 3, "unknown element type"),
    ("no opcode",
     "HloModule m\nENTRY %e {\n  ROOT %p = f32[2] 17\n}\n", 3, "opcode"),
]


@pytest.mark.parametrize("name,text,line,phrase", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_file_line_col(name, text, line, phrase):
    with pytest.raises(UserError) as info:
        parse_hlo(text, "model.hlo")
    message = str(info.value)
    assert "\n" not in message
    assert phrase in message
    assert re.match(r"model\.hlo:\d+:\d+: ", message), message
    if line is not None:
        assert info.value.line == line, message


def test_an_extracted_module_names_each_instruction_once():
    """The parameter standing for an outside operand `x` is `x.in`, unless a member is already
    called so (a module extracted before, a split accumulator): the Flax BART and T5 steps
    failed stage construction with "'acc91.part.in' is used twice"."""
    import numpy as np

    from alpac.hlo.extract import extract
    from alpac.hlo.verify import verify_module
    from alpac.xla.bridge import run_hlo_single_device
    module = parse_hlo("HloModule m\n\nENTRY e {\n  x = f32[4] parameter(0)\n"
                       "  x.in = f32[4] negate(x)\n  y = f32[4] add(x.in, x)\n"
                       "  ROOT t = (f32[4]) tuple(y)\n}\n")
    members = [i for i in module.entry.instructions if i.name in ("x.in", "y")]
    stage, params, _ = extract("stage0", members, members[-1:])
    verify_module(stage)
    names = [i.name for i in stage.entry.instructions]
    assert len(names) == len(set(names)) and [p.name for p in params] == ["x"]
    out = run_hlo_single_device(print_module(stage), [np.arange(4, dtype=np.float32)])
    np.testing.assert_array_equal(out[0], np.zeros(4, np.float32))
