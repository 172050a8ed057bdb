"""Two ways a plan predicted collectives XLA does not insert (or missed ones it does).

Dead code: XLA removes instructions nothing uses (a gradient w.r.t. the input image in
tf.keras's CNN) before partitioning, so alpac drops them in the inline-calls pass and neither
plans nor prices them; side-effecting instructions stay.

Batch norm: XLA does not partition batch-norm-training/-grad, not even along the feature
dimension; it gathers every operand and slices the result (PyTorch/XLA's GPT lowers layer norm
to batch norm over a reshaped [1, rows, features] value: 10 all-gathers were missed).
"""

from __future__ import annotations

from alpac.hlo import parse_hlo, print_module
from alpac.hlo.transforms import remove_dead_code
from alpac.intraop.autoshard import auto_shard
from alpac.intraop.strategies import follow
from alpac.plan.cluster import default_cluster
from alpac.plan.mesh import LogicalMesh
from alpac.plan.sharding import Sharding
from alpac.plan.verify import compiled_collectives
from alpac.xla.bridge import compile_hlo, cpu_devices

DEAD = """HloModule dead

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main {
  x = f32[64,128]{1,0} parameter(0)
  w = f32[128,256]{1,0} parameter(1)
  d = f32[64,256]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  dx = f32[64,128]{1,0} dot(d, w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  zero = f32[] constant(0)
  unused = f32[64] reduce(dx, zero), dimensions={1}, to_apply=add
  tok = token[] after-all()
  fed = token[] outfeed(zero, tok), outfeed_shape=f32[]
  ROOT r = f32[64,256]{1,0} tanh(d)
}
"""

BATCH_NORM = """HloModule bn

ENTRY main {
  x = f32[64,128]{1,0} parameter(0)
  w = f32[128,4096]{1,0} parameter(1)
  scale = f32[4096]{0} parameter(2)
  offset = f32[4096]{0} parameter(3)
  w2 = f32[4096,128]{1,0} parameter(4)
  d = f32[64,4096]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  bn = (f32[64,4096]{1,0}, f32[4096]{0}, f32[4096]{0}) batch-norm-training(d, scale, offset), epsilon=1e-05, feature_index=1
  y = f32[64,4096]{1,0} get-tuple-element(bn), index=0
  ROOT e = f32[64,128]{1,0} dot(y, w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def _agrees(module, mesh):
    result = auto_shard(module, mesh, default_cluster(), time_limit=30)
    exe = compile_hlo(print_module(result.module), cpu_devices(mesh.num_devices))
    predicted = {k: {"count": v["count"], "bytes": v["bytes"]}
                 for k, v in result.collective_summary().items()}
    assert predicted == compiled_collectives(exe.compiled_text())
    return result


def test_dead_instructions_are_dropped_and_not_planned():
    module = parse_hlo(DEAD)
    assert remove_dead_code(module) == 2  # dx and unused (its reducer goes too), not the outfeed
    names = {i.name for i in module.instructions()}
    assert {"dx", "unused"}.isdisjoint(names) and {"fed", "tok", "zero"} <= names
    assert [c.name for c in module.computations] == ["main"]
    module.entry.instructions = [i for i in module.entry.instructions
                                 if i.name not in ("fed", "tok")]  # alpa-run serves no I/O
    module.entry.remove_dead()
    result = _agrees(module, LogicalMesh.parse("2x4"))
    assert {r["instruction"] for r in result.decisions()}.isdisjoint({"dx", "unused"})


def test_batch_norm_gathers_its_operands():
    module = parse_hlo(BATCH_NORM)
    bn = next(i for i in module.instructions() if i.name == "bn")
    split_features = Sharding(((), (0,)))
    strategy = follow(bn, 0, split_features, (2, 4))
    assert strategy.inputs == tuple(Sharding.replicated(o.shape.rank) for o in bn.operands)
    assert strategy.outputs[0] == split_features and strategy.divisor == 1
    # a feature-split batch norm was free in the plan (a split w, then a split contraction);
    # XLA gathered its operand
    _agrees(module, LogicalMesh.parse("2x4"))
