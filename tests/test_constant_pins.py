"""Shardings that XLA's reading of the module (HLO -> StableHLO -> HLO) must not lose.

A value made of constants alone keeps the sharding alpac gave it.

XLA folds such a value (a broadcast zero, say) into a splat constant, dropping its annotation,
and merges it with equal constants of other shardings; a scatter reading it was then partitioned
by the sharding XLA's propagation inferred, and its result all-gathered: collectives the plan
did not predict (Hugging Face BERT-MLM's one-hot gradient on a 2x4 mesh). The emitted module
pins such operands with a `Sharding` custom-call.

An opt-barrier (rematerialization) passes its elements on in the shardings they have, and what
is taken from it is pinned likewise: XLA's StableHLO barrier is one op with many results, and a
user folded away (a reshape and its inverse) left a barrier result that XLA's conversion back to
HLO gave a sharding of another element (BERT with remat on a 2x4 mesh failed to compile).
"""

from __future__ import annotations

from alpac.hlo import parse_hlo, print_module
from alpac.intraop.autoshard import auto_shard
from alpac.plan.cluster import default_cluster
from alpac.plan.mesh import LogicalMesh
from alpac.plan.verify import compiled_collectives
from alpac.xla.bridge import compile_hlo, cpu_devices

# one zero broadcast read by an elementwise op (split over the mesh) and by a scatter with
# batching dimensions (replicated: alpac splits none of its dimensions)
SHARED_ZEROS = """HloModule shared_zeros

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main {
  x = f32[16,32,256]{2,1,0} parameter(0)
  idx = s32[16,32,1,1]{3,2,1,0} parameter(1)
  upd = f32[16,32,1]{2,1,0} parameter(2)
  zero = f32[] constant(0)
  zeros = f32[16,32,256]{2,1,0} broadcast(zero), dimensions={}
  relu = f32[16,32,256]{2,1,0} maximum(x, zeros)
  e = f32[16,32,256]{2,1,0} exponential(relu)
  t = f32[16,32,256]{2,1,0} tanh(e)
  onehot = f32[16,32,256]{2,1,0} scatter(zeros, idx, upd), update_window_dims={}, inserted_window_dims={2}, scatter_dims_to_operand_dims={2}, input_batching_dims={0,1}, scatter_indices_batching_dims={0,1}, index_vector_dim=3, to_apply=add
  ROOT out = (f32[16,32,256]{2,1,0}, f32[16,32,256]{2,1,0}) tuple(t, onehot)
}
"""


def test_constant_operands_keep_their_sharding_in_xla():
    mesh = LogicalMesh.parse("2x4")
    result = auto_shard(parse_hlo(SHARED_ZEROS), mesh, default_cluster(), time_limit=30)
    shardings = {r["instruction"]: r["sharding"] for r in result.decisions()}
    # the case that went wrong: the elementwise user splits the zeros, the scatter does not
    assert shardings["relu"] != "R,R,R" and shardings["onehot"] == "R,R,R"
    text = print_module(result.module)
    assert 'custom_call_target="Sharding"' in text
    exe = compile_hlo(text, cpu_devices(mesh.num_devices))
    predicted = {k: {"count": v["count"], "bytes": v["bytes"]}
                 for k, v in result.collective_summary().items()}
    assert predicted == compiled_collectives(exe.compiled_text())


BARRIER = """HloModule barrier

ENTRY main {
  x = f32[256,512]{1,0} parameter(0)
  w = f32[512,512]{1,0} parameter(1)
  b = f32[512]{0} parameter(2)
  t = (f32[256,512]{1,0}, f32[512,512]{1,0}, f32[512]{0}) tuple(x, w, b)
  ob = (f32[256,512]{1,0}, f32[512,512]{1,0}, f32[512]{0}) opt-barrier(t)
  x1 = f32[256,512]{1,0} get-tuple-element(ob), index=0
  w1 = f32[512,512]{1,0} get-tuple-element(ob), index=1
  b1 = f32[512]{0} get-tuple-element(ob), index=2
  d = f32[256,512]{1,0} dot(x1, w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  br = f32[1,512]{1,0} reshape(b1)
  b2 = f32[512]{0} reshape(br)
  bb = f32[256,512]{1,0} broadcast(b2), dimensions={1}
  y = f32[256,512]{1,0} add(d, bb)
  ROOT r = f32[256,512]{1,0} tanh(y)
}
"""


def test_opt_barrier_passes_shardings_through():
    mesh = LogicalMesh.parse("2x4")
    result = auto_shard(parse_hlo(BARRIER), mesh, default_cluster(), time_limit=30)
    shardings = {r["instruction"]: r["sharding"] for r in result.decisions()}
    assert shardings["x"] != "R,R" and shardings["d"] == shardings["x"]  # split, not gathered
    exe = compile_hlo(print_module(result.module), cpu_devices(mesh.num_devices))
    predicted = {k: {"count": v["count"], "bytes": v["bytes"]}
                 for k, v in result.collective_summary().items()}
    assert predicted == compiled_collectives(exe.compiled_text())
