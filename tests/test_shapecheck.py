"""The shape check at load (alpac/hlo/shapecheck.py): for each opcode family a module whose
shapes follow from its operands loads, and one with a wrong shape is refused with one line naming
the file, the line and the instruction; elided constants are refused; and every real module we
have still loads (no false refusals)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, SHARED, TESTDATA

from alpac.errors import UserError
from alpac.xla.loader import load_module

SUM = """
sum {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
"""
GE = """
ge {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = pred[] compare(a, b), direction=GE
}
"""
ARGMAX = """
argmax {
  a = f32[] parameter(0)
  i = s32[] parameter(1)
  b = f32[] parameter(2)
  j = s32[] parameter(3)
  c = pred[] compare(a, b), direction=GE
  m = f32[] select(c, a, b)
  k = s32[] select(c, i, j)
  ROOT t = (f32[], s32[]) tuple(m, k)
}
"""
LOOP = """
body {
  s = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  x = f32[4] get-tuple-element(s), index=1
  one = s32[] constant(1)
  j = s32[] add(i, one)
  y = f32[4] negate(x)
  ROOT t = (s32[], f32[4]) tuple(j, y)
}

cond {
  s = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(3)
  ROOT c = pred[] compare(i, n), direction=LT
}
"""
BAD_BODY = LOOP.replace("ROOT t = (s32[], f32[4]) tuple(j, y)",
                        "ROOT t = (s32[], f32[4], f32[4]) tuple(j, y, y)")
TWICE = """
twice {
  x = f32[4] parameter(0)
  ROOT y = f32[4] add(x, x)
}
"""

# The entry's parameters: p f32[4], m f32[3,4], z f32[] (more where a case needs them).
PARAMS = """  p = f32[4]{0} parameter(0)
  m = f32[3,4]{1,0} parameter(1)
  z = f32[] parameter(2)
"""

# family: (computations before the entry, the instruction when right, the same instruction
# when wrong, extra entry parameters). The instruction is named `r` and is the entry's root.
CASES = {
    "unary": ("", "f32[4] negate(p)", "f32[5] negate(p)", ""),
    "unary-pred": ("", "pred[4] is-finite(p)", "f32[4] is-finite(p)", ""),
    "convert": ("", "s32[3,4] convert(m)", "s32[4,3] convert(m)", ""),
    "bitcast-convert": ("", "u8[4,4] bitcast-convert(p)", "u8[4] bitcast-convert(p)", ""),
    "binary": ("", "f32[4] add(p, p)", "bf16[4] add(p, p)", ""),
    "binary-shapes": ("", "f32[3,4] multiply(m, m)", "f32[3,4] multiply(m, q)",
                      "  q = f32[4,3] parameter(3)\n"),
    "compare": ("", "pred[4] compare(p, p), direction=LT", "f32[4] compare(p, p), direction=LT",
                ""),
    "select": ("", "f32[4] select(c, p, p)", "f32[4] select(p, p, p)",
               "  c = pred[4] parameter(3)\n"),
    "clamp": ("", "f32[4] clamp(z, p, z)", "f32[4] clamp(q, p, q)", "  q = f32[3] parameter(3)\n"),
    "dot": ("", "f32[8,32] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            "f32[8,16] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            "  a = f32[8,16] parameter(3)\n  b = f32[16,32] parameter(4)\n"),
    "dot-batch": ("", "f32[2,8,32] dot(a, b), lhs_batch_dims={0}, rhs_batch_dims={0}, "
                      "lhs_contracting_dims={2}, rhs_contracting_dims={1}",
                  "f32[2,8,32] dot(a, b), lhs_batch_dims={0}, rhs_batch_dims={0}, "
                  "lhs_contracting_dims={1}, rhs_contracting_dims={1}",
                  "  a = f32[2,8,16] parameter(3)\n  b = f32[2,16,32] parameter(4)\n"),
    "convolution": ("", "f32[1,8,8,16] convolution(x, k), window={size=3x3 pad=1_1x1_1}, "
                        "dim_labels=b01f_01io->b01f",
                    "f32[1,6,6,16] convolution(x, k), window={size=3x3 pad=1_1x1_1}, "
                    "dim_labels=b01f_01io->b01f",
                    "  x = f32[1,8,8,3] parameter(3)\n  k = f32[3,3,3,16] parameter(4)\n"),
    "convolution-groups": ("", "f32[1,4,4,4] convolution(x, k), window={size=3x3 stride=2x2 "
                               "pad=1_1x1_1}, dim_labels=b01f_01io->b01f, feature_group_count=4",
                           "f32[1,4,4,4] convolution(x, k), window={size=3x3 stride=2x2 "
                           "pad=1_1x1_1}, dim_labels=b01f_01io->b01f, feature_group_count=2",
                           "  x = f32[1,8,8,4] parameter(3)\n  k = f32[3,3,1,4] parameter(4)\n"),
    "reshape": ("", "f32[2,6] reshape(m)", "f32[2,5] reshape(m)", ""),
    "broadcast": ("", "f32[3,4] broadcast(p), dimensions={1}",
                  "f32[3,4] broadcast(p), dimensions={0}", ""),
    "transpose": ("", "f32[4,3] transpose(m), dimensions={1,0}",
                  "f32[3,4] transpose(m), dimensions={1,0}", ""),
    "reduce": (SUM, "f32[3] reduce(m, z), dimensions={1}, to_apply=sum",
               "f32[4] reduce(m, z), dimensions={1}, to_apply=sum", ""),
    "reduce-variadic": (ARGMAX, "(f32[3], s32[3]) reduce(m, i, z, j), dimensions={1}, "
                                "to_apply=argmax",
                        "(f32[3], f32[3]) reduce(m, i, z, j), dimensions={1}, to_apply=argmax",
                        "  i = s32[3,4] parameter(3)\n  j = s32[] parameter(4)\n"),
    "reduce-window": (SUM, "f32[3,2] reduce-window(m, z), window={size=1x2 stride=1x2}, "
                           "to_apply=sum",
                      "f32[3,3] reduce-window(m, z), window={size=1x2 stride=1x2}, "
                      "to_apply=sum", ""),
    "select-and-scatter": (SUM + GE, "f32[4,4] select-and-scatter(x, s, z), window={size=2x2 "
                                     "stride=2x2}, select=ge, scatter=sum",
                           "f32[4,4] select-and-scatter(x, t, z), window={size=2x2 "
                           "stride=2x2}, select=ge, scatter=sum",
                           "  x = f32[4,4] parameter(3)\n  s = f32[2,2] parameter(4)\n"
                           "  t = f32[3,3] parameter(5)\n"),
    "slice": ("", "f32[2,2] slice(m), slice={[1:3], [0:4:2]}",
              "f32[2,3] slice(m), slice={[1:3], [0:4:2]}", ""),
    "dynamic-slice": ("", "f32[2] dynamic-slice(p, i), dynamic_slice_sizes={2}",
                      "f32[3] dynamic-slice(p, i), dynamic_slice_sizes={2}",
                      "  i = s32[] parameter(3)\n"),
    "dynamic-update-slice": ("", "f32[4] dynamic-update-slice(p, u, i)",
                             "f32[2] dynamic-update-slice(p, u, i)",
                             "  u = f32[2] parameter(3)\n  i = s32[] parameter(4)\n"),
    "concatenate": ("", "f32[8] concatenate(p, p), dimensions={0}",
                    "f32[9] concatenate(p, p), dimensions={0}", ""),
    "pad": ("", "f32[10] pad(p, z), padding=1_2_1", "f32[7] pad(p, z), padding=1_2_1", ""),
    "gather": ("", "f32[3,4] gather(e, i), offset_dims={1}, collapsed_slice_dims={0}, "
                   "start_index_map={0}, index_vector_dim=1, slice_sizes={1,4}",
               "f32[3,5] gather(e, i), offset_dims={1}, collapsed_slice_dims={0}, "
               "start_index_map={0}, index_vector_dim=1, slice_sizes={1,4}",
               "  e = f32[10,4] parameter(3)\n  i = s32[3,1] parameter(4)\n"),
    "scatter": (SUM, "f32[10,4] scatter(e, i, u), update_window_dims={1}, "
                     "inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, "
                     "index_vector_dim=1, to_apply=sum",
                "f32[10,4] scatter(e, i, v), update_window_dims={1}, "
                "inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, "
                "index_vector_dim=1, to_apply=sum",
                "  e = f32[10,4] parameter(3)\n  i = s32[3,1] parameter(4)\n"
                "  u = f32[3,4] parameter(5)\n  v = f32[2,4] parameter(6)\n"),
    "iota": ("", "s32[4,3] iota(), iota_dimension=1", "s32[4,3] iota(), iota_dimension=2", ""),
    "tuple": ("", "(f32[4], f32[]) tuple(p, z)", "(f32[4], f32[4]) tuple(p, z)", ""),
    "get-tuple-element": ("", "f32[] get-tuple-element(t), index=1",
                          "f32[4] get-tuple-element(t), index=1",
                          "  t = (f32[4], f32[]) parameter(3)\n"),
    "while": (LOOP, "(s32[], f32[4]) while(s), condition=cond, body=body",
              "(s32[], f32[4]) while(s), condition=cond, body=body",
              "  s = (s32[], f32[4]) parameter(3)\n"),
    "call": (TWICE, "f32[4] call(p), to_apply=twice", "f32[3,4] call(m), to_apply=twice", ""),
    "conditional": (TWICE, "f32[4] conditional(c, p, p), true_computation=twice, "
                           "false_computation=twice",
                    "f32[4] conditional(c, p, m), true_computation=twice, "
                    "false_computation=twice", "  c = pred[] parameter(3)\n"),
    "constant": ("", "f32[3] constant({1, 2, 3})", "f32[4] constant({1, 2, 3})", ""),
}


def module_text(family: str, wrong: bool) -> str:
    comps, right, bad, extra = CASES[family]
    if family == "while" and wrong:
        comps = BAD_BODY
    return (f"HloModule {family.replace('-', '_')}\n{comps}\nENTRY main {{\n{PARAMS}{extra}"
            f"  ROOT r = {bad if wrong else right}\n}}\n")


def load(tmp_path, text: str, name: str = "model.hlo"):
    path = tmp_path / name
    path.write_text(text)
    return load_module(path)


@pytest.mark.parametrize("family", sorted(CASES))
def test_right_shapes_load(family, tmp_path):
    module = load(tmp_path, module_text(family, wrong=False))
    assert module.entry.root.name == "r"


@pytest.mark.parametrize("family", sorted(CASES))
def test_wrong_shape_is_refused_naming_file_line_and_instruction(family, tmp_path):
    text = module_text(family, wrong=True)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "ROOT r =" in row)
    with pytest.raises(UserError) as e:
        load(tmp_path, text)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'model.hlo'}:{line}:3: 'r' "), message
    assert "\n" not in message


def test_message_says_declared_and_inferred_shapes(tmp_path):
    with pytest.raises(UserError) as e:
        load(tmp_path, module_text("dot", wrong=True))
    assert str(e.value).endswith("'r' declares f32[8,16] but its operands give f32[8,32]")


def test_dtype_counts(tmp_path):
    with pytest.raises(UserError, match=r"'r' declares bf16\[4\] but its operands give f32\[4\]"):
        load(tmp_path, module_text("binary", wrong=True))


def test_layouts_are_ignored(tmp_path):
    text = module_text("transpose", wrong=False).replace("r = f32[4,3]", "r = f32[4,3]{0,1}")
    load(tmp_path, text)


def test_unmodeled_opcodes_are_not_checked(tmp_path):
    load(tmp_path, "HloModule m\nENTRY main {\n  p = f32[4] parameter(0)\n"
                   "  ROOT r = f32[7,7] custom-call(p), custom_call_target=\"Anything\"\n}\n")


def test_wrong_instruction_inside_a_called_computation(tmp_path):
    text = module_text("call", wrong=False).replace("ROOT y = f32[4] add(x, x)",
                                                     "ROOT y = f32[5] add(x, x)")
    with pytest.raises(UserError, match=r"model.hlo:5:3: 'y' declares f32\[5\]"):
        load(tmp_path, text)


def test_parameter_numbers_are_checked(tmp_path):
    text = module_text("unary", wrong=False).replace("parameter(2)", "parameter(5)")
    with pytest.raises(UserError, match=r"model.hlo:6:3: 'z' is parameter\(5\) but "
                                        r"computation 'main' has 3 parameters"):
        load(tmp_path, text)


def test_operand_printed_with_another_shape_is_refused(tmp_path):
    text = module_text("unary", wrong=False).replace("negate(p)", "negate(f32[5] p)")
    with pytest.raises(UserError, match=r"'r' gives its operand 'p' the shape f32\[5\]"):
        load(tmp_path, text)


# ---- constants ------------------------------------------------------------------------------

ELIDED = """HloModule torch_xla_graph
ENTRY main {
  p = f32[12] parameter(0)
  c = f32[12] constant({...})
  ROOT r = f32[12] multiply(p, c)
}
"""


def test_elided_constant_is_refused_by_the_loader(tmp_path):
    with pytest.raises(UserError) as e:
        load(tmp_path, ELIDED)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'model.hlo'}:4:3: 'c' is a constant whose value "
                              f"was elided")
    assert "print_large_constants" in message and "_get_xla_tensors_hlo_proto" in message


def test_elided_constant_exits_2_with_one_line_from_the_cli(tmp_path):
    path = tmp_path / "torch.hlo"
    path.write_text(ELIDED)
    result = subprocess.run([sys.executable, "-m", "alpac.cli", "compile", str(path), "-o",
                             str(tmp_path / "plan"), "--mesh", "2"], capture_output=True,
                            text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "COLUMNS": "400"})
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"alpac: error: {path}:4:3: 'c' is a constant whose value was "
                               f"elided"), lines[0]
    assert "print_large_constants" in lines[0] and "--xla_dump_hlo_as_proto" in lines[0]
    assert not (tmp_path / "plan").exists()


def test_short_constant_literal_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"'r' declares f32\[4\] \(4 values\) but its literal "
                                        r"has 3"):
        load(tmp_path, module_text("constant", wrong=True))


def test_constant_with_row_comments_counts_its_values(tmp_path):
    text = ("HloModule m\nENTRY main {\n  ROOT c = pred[2,2] constant({ { /*i0=0*/ 1, 0 }, "
            "{ /*i0=1*/ 0, 1 } })\n}\n")
    load(tmp_path, text)


def test_large_constants_of_a_proto_are_printed_in_full(tmp_path):
    """A .pb or .mlir reaches the parser as text XLA prints; it must not elide constants (that
    would be refused here, and planned with invented values before). jax's protos also carry
    stack-frame tables, which XLA prints after the header."""
    import jax
    import numpy as np

    values = np.arange(12, dtype=np.float32) * 3
    lowered = jax.jit(lambda x: x * values).lower(np.ones(12, np.float32))
    path = tmp_path / "model.pb"
    path.write_bytes(lowered.compiler_ir("hlo").as_serialized_hlo_module_proto())
    mlir = tmp_path / "model.mlir"
    mlir.write_text(lowered.as_text())
    for model in (path, mlir):
        module = load_module(model)
        const = next(i for i in module.instructions() if i.opcode == "constant")
        assert const.payload == "{" + ", ".join(str(int(v)) for v in values) + "}", model


# ---- no false refusals: every real module we have loads --------------------------------------

LARGE = ("hlo_llama31_8b_bf16_1x8.hlo", "hlo_mixtral_8x7b_bf16_1x8.hlo")


def _real_modules() -> list:
    paths = sorted((TESTDATA / "models").glob("*.hlo"))
    paths += [p for p in sorted((SHARED / "hlo-corpus").glob("*.hlo")) if p.name not in LARGE]
    paths += sorted((SHARED / "xla-cases").rglob("*.hlo"))
    return paths


@pytest.mark.parametrize("path", _real_modules(), ids=lambda p: p.name)
def test_real_module_loads(path):
    load_module(path)


@pytest.mark.skipif(not (SHARED / "hlo-corpus").is_dir(), reason="no ../shared/hlo-corpus")
def test_large_corpus_modules_load():
    """The two 30-40K-instruction modules, in one test: ~5 s on a quiet 2-core machine."""
    start = time.time()
    for name in LARGE:
        module = load_module(SHARED / "hlo-corpus" / name)
        assert module.instruction_count() > 30_000
    assert time.time() - start < 60
