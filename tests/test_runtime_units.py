"""Unit tests of alpa-run's parts that need no MPI: schedules, the task order of a program,
cross-mesh resharding plans, the identity resharding module, inputs and errors, the launcher's
argument handling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_runtime_plans import pipeline_plan

from alpac.plan.schedule import bubble_fraction, max_live_microbatches, stage_tasks, timeline
from alpac.runtime import resharding
from alpac.runtime.status import STATUS_ENV
from alpac.runtime.data import (Layout, Param, entry_parameters, load_inputs, random_input,
                                relative_errors)
from alpac.runtime.launcher import find_mpiexec, parse_mpi_args

# ---- schedules -------------------------------------------------------------------------------


def test_1f1b_is_pipedream_flush():
    tasks = stage_tasks(4, 6, "1f1b")
    F = [("forward", m) for m in range(6)]
    assert tasks[3] == [F[0], ("backward", 0), F[1], ("backward", 1), F[2], ("backward", 2),
                        F[3], ("backward", 3), F[4], ("backward", 4), F[5], ("backward", 5)]
    assert tasks[0][:3] == F[:3]  # 3 warm-up forwards on stage 0 of 4
    assert tasks[0][3:5] == [F[3], ("backward", 0)]
    assert tasks[0][-2:] == [("backward", 4), ("backward", 5)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,B", [(1, 1), (1, 4), (2, 1), (2, 4), (4, 2), (4, 8), (3, 5)])
def test_schedules_run_every_task_once_in_order(kind, S, B):
    tasks = stage_tasks(S, B, kind)
    for stage in tasks:
        assert sorted(stage) == sorted([("forward", m) for m in range(B)] +
                                       [("backward", m) for m in range(B)])
        assert stage.index(("forward", 0)) < stage.index(("backward", 0))
        # backwards in microbatch order: gradients add up in the same order in both schedules
        assert [m for w, m in stage if w == "backward"] == list(range(B))
    ticks = timeline(S, B, kind)
    assert sum(t is not None for row in ticks for t in row) == 2 * S * B
    assert bubble_fraction(S, B, kind) == pytest.approx((S - 1) / (B + S - 1))


def test_live_microbatch_bounds():
    assert max_live_microbatches(4, 8, "1f1b") == [4, 3, 2, 1]
    assert max_live_microbatches(4, 2, "1f1b") == [2, 2, 2, 1]
    assert max_live_microbatches(4, 8, "gpipe") == [8] * 4
    assert max_live_microbatches(3, 4, "1f1b", backward=False) == [1, 1, 1]
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        stage_tasks(2, 2, "zigzag")


# ---- the task order of a program ---------------------------------------------------------------

def _program(tmp_path, meshes, B=4, name="p"):
    from alpac.plan.program import Program
    plan = pipeline_plan(tmp_path / name, meshes, B)
    return Program.from_dict(json.loads((plan / "plan.json").read_text())["program"])


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_timeline_follows_the_schedule(tmp_path, kind):
    from alpac.runtime.timeline import build
    program = _program(tmp_path, [[0], [1], [2], [3]], B=8)
    tl = build(program, kind)
    for s, want in enumerate(stage_tasks(4, 8, kind)):
        got = [(t.module.role, t.m) for t in tl.tasks
               if t.kind == "run" and t.module.stage == s and t.module.role != "apply"]
        assert got == want
    # one transfer per activation and gradient per microbatch, plus the microbatch index
    assert len(tl.transfers) == 8 * (3 + 3 + 1)
    assert sum(t.bytes for t in tl.transfers) == program.transfer_bytes()
    # every per-microbatch value is freed on its mesh within the step
    live: dict = {}
    for t in tl.tasks:
        for key, _ in t.writes:
            live[key] = t.index
        for tid in t.recv_before:
            live[tl.transfers[tid].dst_key] = t.index
        for key in t.free_after:
            live.pop(key, None)
    assert not [k for k in live if k[1] is not None]


def test_timeline_refuses_broken_programs(tmp_path):
    from alpac.runtime.timeline import ProgramError, build
    program = _program(tmp_path, [[0, 1], [2, 3]])
    program.transfers = [t for t in program.transfers if t.value != "h1"]
    with pytest.raises(ProgramError, match="takes h1 from mesh 0, but the program lists no "
                                           "transfer"):
        build(program)
    program = _program(tmp_path, [[0, 1], [2, 3]], name="q")
    program.modules[0].parameters[0].value = "nowhere"
    with pytest.raises(ProgramError, match="unknown value nowhere"):
        build(program)
    with pytest.raises(ProgramError, match="unknown schedule"):
        build(_program(tmp_path, [[0]], name="r"), "zigzag")


# ---- cross-mesh resharding -------------------------------------------------------------------

def _regions(text, n, shape):
    from alpac.xla.bridge import cpu_devices, sharding_from_text
    devices = cpu_devices(n)
    index = sharding_from_text(text, devices).devices_indices_map(tuple(shape))
    return [resharding.region_of(index[d], shape) for d in devices]


def _covers(rp, dst_regions, shape):
    """Every destination device ends with exactly its region: pieces tile what it receives,
    and the receive regions (plus forwards) cover its region."""
    for j, reg in enumerate(rp.recv_regions):
        pieces = [p for p in rp.pieces if p.dst == j]
        if not pieces:
            continue
        assert sum(resharding.size(p.region) for p in pieces) == resharding.size(reg)


def test_resharding_rows_to_columns_moves_each_element_once():
    shape = [4, 8]
    src = _regions("{devices=[2,1]0,1}", 2, shape)
    dst = _regions("{devices=[1,2]0,1}", 2, shape)
    rp = resharding.plan(shape, src, dst, [0, 1], [2, 3])
    assert rp.sharding_text() is None and not rp.forwards
    assert rp.crossing_elements() == 32
    assert len(rp.pieces) == 4
    _covers(rp, dst, shape)


def test_resharding_to_a_replicated_mesh_uses_local_allgather():
    shape = [4, 8]
    src = _regions("{devices=[1,2]0,1}", 2, shape)
    dst = _regions("{replicated}", 2, shape)
    rp = resharding.plan(shape, src, dst, [0, 1], [2, 3])
    assert rp.sharding_text() == "{devices=[2,1]0,1}"
    assert rp.crossing_elements() == 32  # not 64: each slice crosses once
    _covers(rp, dst, shape)
    # partially replicated: each half of the rows held by 2 devices
    dst = _regions("{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}", 4, shape)
    rp = resharding.plan(shape, src, dst, [0, 1], [2, 2, 3, 3])
    assert rp.sharding_text() == "{devices=[4,1]0,1,2,3}"
    assert rp.crossing_elements() == 32


def test_resharding_a_replicated_scalar_is_forwarded_inside_the_mesh():
    src = _regions("{replicated}", 2, [])
    dst = _regions("{replicated}", 2, [])
    rp = resharding.plan([], src, dst, [0, 0], [1, 2])
    assert rp.crossing_elements() == 1 and rp.forwards == [(0, 1)]


def test_resharding_prefers_a_source_on_the_same_rank():
    shape = [8]
    src = _regions("{replicated}", 2, shape)
    dst = _regions("{devices=[2]0,1}", 2, shape)
    rp = resharding.plan(shape, src, dst, [0, 1], [1, 0])
    assert [(p.src, p.dst) for p in rp.pieces] == [(1, 0), (0, 1)]


def test_identity_module_reshards():
    from alpac.runtime.transfers import identity_module
    from alpac.xla.bridge import compile_hlo, cpu_devices
    exe = compile_hlo(identity_module([4, 8], "f32", "{devices=[2,1]0,1}", "{replicated}"),
                      cpu_devices(2))
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    assert exe.output_shardings() == [None]
    np.testing.assert_array_equal(exe.run([x])[0], x)
    assert "all-gather" in exe.compiled_text()


_ADD = ("%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
        "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n\n")
#: manual reduce-scatter regions as `intraop/annotate.py` writes them: (module, devices)
REGIONS = {
    # the whole mesh of 2; the result then transposed and replicated (XLA's CPU partitioner
    # failed a RET_CHECK when the region was left replicated: tf_keras_transformer_train)
    "whole-mesh": ("HloModule rs\n\n" + _ADD + """ENTRY %main (x: f32[2,16,64], w: f32[64,64]) -> f32[2,16,64] {
  %x = f32[2,16,64]{2,1,0} parameter(0), sharding={devices=[1,1,2]<=[2]}
  %w = f32[64,64]{1,0} parameter(1), sharding={devices=[2,1]<=[2]}
  %xm = f32[2,16,32]{2,1,0} custom-call(%x), custom_call_target="SPMDFullToShardShape", sharding={manual}
  %wm = f32[32,64]{1,0} custom-call(%w), custom_call_target="SPMDFullToShardShape", sharding={manual}
  %local = f32[2,16,64]{2,1,0} dot(%xm, %wm), lhs_contracting_dims={2}, rhs_contracting_dims={0}, sharding={manual}
  %rs = f32[2,16,32]{2,1,0} reduce-scatter(%local), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, dimensions={2}, to_apply=%add, sharding={manual}
  %f = f32[2,16,64]{2,1,0} custom-call(%rs), custom_call_target="SPMDShardToFullShape", sharding={devices=[1,1,2]<=[2]}
  %t = f32[2,16,64]{2,1,0} transpose(%f), dimensions={0,1,2}, sharding={devices=[1,1,2]<=[2]}
  ROOT %r = f32[2,16,64]{2,1,0} copy(%t), sharding={replicated}
}
""", 2),
    # one mesh axis of a 2x2 mesh (groups {0,1} and {2,3})
    "one-axis": ("HloModule rs\n\n" + _ADD + """ENTRY %main (x: f32[16,64], w: f32[64,32]) -> f32[16,32] {
  %x = f32[16,64]{1,0} parameter(0), sharding={devices=[2,2]<=[4]}
  %w = f32[64,32]{1,0} parameter(1), sharding={devices=[2,1,2]<=[2,2]T(1,0) last_tile_dim_replicate}
  %xm = f32[8,32]{1,0} custom-call(%x), custom_call_target="SPMDFullToShardShape", sharding={manual}
  %wm = f32[32,32]{1,0} custom-call(%w), custom_call_target="SPMDFullToShardShape", sharding={manual}
  %local = f32[8,32]{1,0} dot(%xm, %wm), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={manual}
  %rs = f32[8,16]{1,0} reduce-scatter(%local), channel_id=1, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, dimensions={1}, to_apply=%add, sharding={manual}
  %f = f32[16,32]{1,0} custom-call(%rs), custom_call_target="SPMDShardToFullShape", sharding={devices=[2,2]<=[4]}
  ROOT %r = f32[16,32]{1,0} copy(%f), sharding={replicated}
}
""", 4),
}


@pytest.mark.parametrize("region", sorted(REGIONS))
def test_manual_reduce_scatters_run_as_xla_partitions_them_across_processes(region):
    """gloo's reduce-scatter (XLA on CPU between processes) can send a half it has already
    overwritten: the hf_gpt2_train plan on 2x2 ranks got the last 65 elements of a gradient
    tile wrong, differently from run to run. alpa-run hands such a region back to XLA as the
    op on the whole operands with the region's output sharding: the same values, computed by
    an all-reduce, and no reduce-scatter left for gloo to run."""
    from alpac.runtime.collectives import rejoin_reduce_scatters
    from alpac.xla.bridge import compile_hlo, cpu_devices
    text, n = REGIONS[region]
    rewritten = rejoin_reduce_scatters(text)
    assert "reduce-scatter(" not in rewritten and "SPMDFullToShardShape" not in rewritten
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(p).astype(np.float32)
            for p, _ in compile_hlo(text, cpu_devices(n)).parameter_types)
    want = compile_hlo(text, cpu_devices(n)).run([x, w])[0]
    exe = compile_hlo(rewritten, cpu_devices(n))
    assert " reduce-scatter(" not in exe.compiled_text() and "all-reduce(" in exe.compiled_text()
    np.testing.assert_allclose(exe.run([x, w])[0], want, rtol=1e-6, atol=1e-6)
    assert rejoin_reduce_scatters("HloModule m\n") == "HloModule m\n"


# ---- inputs, outputs, errors -----------------------------------------------------------------

def test_entry_parameters_and_inputs(tmp_path):
    text = ("HloModule m\n\nr {\n  a = f32[] parameter(0)\n}\n\nENTRY main.1 {\n"
            "  %w.1 = f32[2,3]{1,0} parameter(0)\n  tok.2 = s32[4]{0} parameter(1)\n"
            "  ROOT t = (f32[2,3]) tuple(w.1)\n}\n")
    params = entry_parameters(text)
    assert [(p.name, p.dtype, p.shape) for p in params] == [("w.1", "f32", [2, 3]),
                                                           ("tok.2", "s32", [4])]
    w = np.ones((2, 3), np.float32)
    np.savez(tmp_path / "a.npz", arg0=w, arg1=np.arange(4))
    np.savez(tmp_path / "b.npz", **{"w.1": w, "tok.2": np.arange(4, dtype=np.int32)})
    for f in ("a.npz", "b.npz"):
        got = load_inputs(tmp_path / f, 0, params, {0, 1})
        assert got[1].dtype == np.int32 and got[0].shape == (2, 3)
    from alpac.errors import UserError
    np.savez(tmp_path / "c.npz", arg0=w)
    with pytest.raises(UserError, match="no input for parameter 1 \\(tok.2\\)"):
        load_inputs(tmp_path / "c.npz", 0, params, {0, 1})
    np.savez(tmp_path / "d.npz", arg0=w.T, arg1=np.arange(4))
    with pytest.raises(UserError, match="parameter 0 \\(w.1\\) is f32\\[2, 3\\]"):
        load_inputs(tmp_path / "d.npz", 0, params, {0, 1})
    p = Param(3, "x", "f32", [5])
    np.testing.assert_array_equal(random_input(7, p), random_input(7, p))
    assert (random_input(7, p) >= 0).all()


def test_a_layer_row_of_a_vector_is_a_scalar():
    """A dropout key u32[2] stacked per layer: the program's piece of one row is u32[], as its
    parameter says, not u32[1]; several rows keep the axis."""
    layout = Layout(parameters=[[0, 1, 2, 0], [0, 0, 2, 0], [1, None, None, None]],
                    outputs=[], aliases=[])
    key = np.array([7, 42], np.uint32)
    pieces = layout.cut({0: key, 1: np.ones((2, 3))}, range(3))
    assert pieces[0].shape == () and pieces[0].dtype == np.uint32 and pieces[0] == 42
    assert isinstance(pieces[0], np.ndarray)
    assert pieces[1].shape == (2,) and pieces[2].shape == (2, 3)
    params = layout.program_parameters([Param(0, "key", "u32", [2]), Param(1, "w", "f32", [2, 3])])
    assert [p.shape for p in params] == [[], [2], [2, 3]]


def test_relative_error_definition():
    ref = [np.array([1.0, -4.0]), np.zeros(3), np.array([2, 3], np.int32)]
    out = [np.array([1.0, -3.0]), np.full(3, 1e-3), np.array([2, 3], np.int32)]
    assert relative_errors(out, ref) == pytest.approx([0.25, 1e-3, 0.0])
    assert relative_errors([np.array([np.nan])], [np.array([1.0])]) == [float("inf")]


def test_mpi_arguments():
    assert parse_mpi_args(["np", "8"]) == (8, [])
    assert parse_mpi_args(["-np", "8", "-ppn", "2"]) == (8, ["-ppn", "2"])
    assert parse_mpi_args(["-n", "3"]) == (3, [])
    assert parse_mpi_args([]) == (None, [])
    with pytest.raises(ValueError):
        parse_mpi_args(["np"])
    assert find_mpiexec() and find_mpiexec().endswith("mpiexec")


# ---- the executor in this process (one rank holding every device) --------------------------

def run_local(plan_dir, host_inputs: dict, iters: int = 1, schedule: str | None = None):
    """Run a plan's program in this process, as one MPI rank (singleton) with every device."""
    from alpac.plan.program import Program
    from alpac.runtime.comm import Comm
    from alpac.runtime.data import assemble
    from alpac.runtime.executor import Executor, host_pieces
    from alpac.runtime.timeline import build
    from alpac.xla.bridge import cpu_devices
    program = Program.from_dict(json.loads((plan_dir / "plan.json").read_text())["program"])
    tl = build(program, schedule)
    n = max(d for m in program.meshes for d in m.devices) + 1
    ex = Executor(tl, plan_dir, Comm(30), cpu_devices(n), n, 30)
    carried: dict = {}
    steps = []
    for it in range(iters):
        stats = ex.run_step(host_inputs, carried, collect=it == iters - 1)
        if it < iters - 1:
            carried, stats.carry_bytes = ex.carry()
        steps.append(stats)
    pieces = list(ex.host_out)
    for pos, a in ex.step_outputs().items():
        pieces += host_pieces(a, pos, None)
    return assemble(pieces, tl.outputs, program.num_micro_batches), steps, program


def test_pipeline_in_one_process_matches_the_whole_step(tmp_path):
    """Two meshes in one rank: pieces go through the local mailbox, the replicated gradient
    through the local all-gather, the microbatch index is forwarded inside its mesh."""
    from alpac.runtime.data import reference
    from alpac.xla.bridge import cpu_devices
    plan = pipeline_plan(tmp_path / "p", [[0, 1], [2, 3]], 4)
    args = [np.asarray(a) for a in __import__("test_runtime_plans").plan_inputs(2)]
    outs, steps, program = run_local(plan, dict(enumerate(args)), iters=2, schedule="gpipe")
    want = reference((plan / "source.hlo").read_text(), args, [(0, 0), (1, 1)], 2,
                     cpu_devices(1)[0])
    for got, w in zip(outs, want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    assert [sum(s.bytes.values()) for s in steps] == [program.transfer_bytes()] * 2
    assert steps[0].peak_live == {0: 4, 1: 4}


_DONATING = """HloModule m1, input_output_alias={ {}: (0, {}, may-alias) }, \
entry_computation_layout={(f32[4,4]{1,0})->f32[4,4]{1,0}}

ENTRY main {
  a = f32[4,4]{1,0} parameter(0), sharding={devices=[2,1]0,1}
  two = f32[] constant(2)
  b2 = f32[4,4]{1,0} broadcast(two), dimensions={}
  ROOT b = f32[4,4]{1,0} multiply(a, b2), sharding={devices=[2,1]0,1}
}
"""
_PLUS_ONE = """HloModule m2, entry_computation_layout={(f32[4,4]{1,0})->f32[4,4]{1,0}}

ENTRY main {
  a = f32[4,4]{1,0} parameter(0), sharding={devices=[1,2]0,1}
  one = f32[] constant(1)
  o = f32[4,4]{1,0} broadcast(one), dimensions={}
  ROOT c = f32[4,4]{1,0} add(a, o), sharding={replicated}
}
"""
_TIMES_THREE = """HloModule m3, entry_computation_layout={(f32[4,4]{1,0})->f32[4,4]{1,0}}

ENTRY main {
  z = f32[4,4]{1,0} parameter(0), sharding={devices=[2,1]0,1}
  three = f32[] constant(3)
  t = f32[4,4]{1,0} broadcast(three), dimensions={}
  ROOT d = f32[4,4]{1,0} multiply(z, t), sharding={devices=[2,1]0,1}
}
"""


def test_donated_reread_resharded_and_carried_across_meshes(tmp_path):
    """m1 donates `a`, which m2 reads afterwards (a copy is passed); m2 expects `a` laid out
    differently (resharded inside the mesh); output c feeds input z of the next step on
    the other mesh (moved between steps)."""
    f4 = {"shape": [4, 4], "dtype": "f32", "scope": "step", "bytes": 64}
    program = {
        "meshes": [{"devices": [0, 1], "shape": [2]}, {"devices": [2, 3], "shape": [2]}],
        "values": {"a": {**f4, "mesh": 0, "sharding": "{devices=[2,1]0,1}"},
                   "b": {**f4, "mesh": 0, "sharding": "{devices=[2,1]0,1}"},
                   "c": {**f4, "mesh": 0, "sharding": "{replicated}"},
                   "z": {**f4, "mesh": 1, "sharding": "{devices=[2,1]0,1}"},
                   "d": {**f4, "mesh": 1, "sharding": "{devices=[2,1]0,1}"}},
        "inputs": [{"parameter": 0, "value": "a"}, {"parameter": 1, "value": "z"}],
        "outputs": [{"index": [0], "value": "b"}, {"index": [1], "value": "c"},
                    {"index": [2], "value": "d"}],
        "modules": [
            {"name": "m1", "file": "m1.hlo", "mesh": 0, "role": "step", "stage": 0,
             "parameters": [{"value": "a", "sharding": "{devices=[2,1]0,1}"}],
             "outputs": [{"value": "b", "sharding": "{devices=[2,1]0,1}"}], "donated": [0]},
            {"name": "m2", "file": "m2.hlo", "mesh": 0, "role": "step", "stage": 0,
             "parameters": [{"value": "a", "sharding": "{devices=[1,2]0,1}"}],
             "outputs": [{"value": "c", "sharding": "{replicated}"}]},
            {"name": "m3", "file": "m3.hlo", "mesh": 1, "role": "step", "stage": 1,
             "parameters": [{"value": "z", "sharding": "{devices=[2,1]0,1}"}],
             "outputs": [{"value": "d", "sharding": "{devices=[2,1]0,1}"}]}],
        "aliases": [[[0], 0], [[1], 1]],
    }
    (tmp_path / "plan.json").write_text(json.dumps({"schema": "alpac.plan/1",
                                                    "program": program}))
    for name, text in (("m1", _DONATING), ("m2", _PLUS_ONE), ("m3", _TIMES_THREE)):
        (tmp_path / f"{name}.hlo").write_text(text)
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    z = np.full((4, 4), 7, np.float32)
    (b, c, d), steps, _ = run_local(tmp_path, {0: a, 1: z}, iters=2)
    np.testing.assert_array_equal(b, 4 * a)
    np.testing.assert_array_equal(c, 2 * a + 1)
    np.testing.assert_array_equal(d, 3 * (a + 1))
    assert steps[0].carry_bytes == 64 and sum(steps[0].bytes.values()) == 0


# ---- the rank guard ----------------------------------------------------------------------

def _guarded(tmp_path, body: str) -> tuple[subprocess.Popen, Path]:
    """Start `python -m alpac.runtime.guard child` where child.py is `body`."""
    (tmp_path / "child.py").write_text(body)
    status = tmp_path / "status"
    status.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), STATUS_ENV: str(status)}
    proc = subprocess.Popen([sys.executable, "-m", "alpac.runtime.guard", "child"], env=env)
    return proc, status


def test_the_guard_records_when_and_how_its_rank_ended_and_ends_the_same_way(tmp_path):
    proc, status = _guarded(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    before = time.time()
    assert proc.wait(timeout=60) == -signal.SIGKILL  # mpiexec sees the child's own end
    [record] = [json.loads(f.read_text()) for f in status.glob("ended.pid*.json")]
    assert record["code"] == -signal.SIGKILL and record["time"] <= time.time()
    assert record["time"] > before - 60


def test_a_killed_guard_takes_its_rank_with_it(tmp_path):
    proc, status = _guarded(tmp_path, "import os, time\nopen('%s', 'w').write(str(os.getpid()))"
                            "\ntime.sleep(600)\n" % (tmp_path / "pid"))
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int((tmp_path / "pid").read_text())
    proc.kill()
    proc.wait()
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
        assert time.monotonic() < deadline, "the rank outlived its guard"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def test_zero_tasks_are_made_in_blocks_that_every_rank_of_a_mesh_sees_alike():
    """A mesh's uninterrupted run of zero tasks is one block (one module makes its zeros),
    whatever other meshes' tasks a rank's stream interleaves; a run or feed of the same mesh
    ends the block."""
    from alpac.runtime.executor import zero_blocks
    from alpac.runtime.timeline import Task
    kinds = [("zero", 0), ("zero", 1), ("zero", 0), ("run", 1), ("zero", 0), ("zero", 1),
             ("feed", 0), ("zero", 0)]
    tasks = [Task(i, kind, mesh) for i, (kind, mesh) in enumerate(kinds)]
    blocks = {first: [t.index for t in block] for first, block in zero_blocks(tasks).items()}
    assert blocks == {0: [0, 2, 4], 1: [1], 5: [5], 7: [7]}
    # the rank that holds mesh 0 alone sees mesh 0's tasks in the same order: same blocks
    alone = [t for t in tasks if t.mesh == 0]
    assert {f: [t.index for t in b] for f, b in zero_blocks(alone).items()} == \
        {f: b for f, b in blocks.items() if tasks[f].mesh == 0}


def test_check_on_an_accelerator_passes_within_the_original_module_s_own_rounding(monkeypatch):
    """On a GPU, an error over rtol has --check run the original module on the host's CPU too:
    within what those two runs differ by it is rounding and passes; above it, it fails."""
    from types import SimpleNamespace

    from alpac.runtime import data, worker
    gpu, cpu = SimpleNamespace(platform="gpu", id=0), SimpleNamespace(platform="cpu", id=0)
    refs = {"gpu": [np.array([1.0, 2.0])], "cpu": [np.array([1.0, 2.0 + 4e-4])]}
    monkeypatch.setattr(data, "reference", lambda text, args, aliases, iters, device:
                        refs[device.platform])
    fake_jax = SimpleNamespace(local_devices=lambda: [gpu], devices=lambda kind: [cpu])
    setup = SimpleNamespace(source_inputs={}, source_params=[], layout=None, source_text="",
                            tl=SimpleNamespace(outputs=[]), program=SimpleNamespace(aliases=[]))
    opts = SimpleNamespace(rtol=1e-5, iters=3)
    near = worker._check(opts, fake_jax, setup, [np.array([1.0, 2.0 + 2e-4])])
    assert near["rounding_floor"]["devices"] == "gpu:0 and cpu:0"
    assert near["rounding_floor"]["max_rel_error"] == pytest.approx(2e-4)
    assert near["passed"] and near["max_rel_error"]["overall"] == pytest.approx(1e-4)
    far = worker._check(opts, fake_jax, setup, [np.array([1.0, 2.0 + 2e-3])])
    assert not far["passed"]
    within_rtol = worker._check(opts, fake_jax, setup, [np.array([1.0, 2.0 + 1e-5])])
    assert within_rtol["passed"] and within_rtol["rounding_floor"] is None  # no CPU run
    fake_jax.local_devices = lambda: [cpu]  # on the CPU: rtol alone
    on_cpu = worker._check(opts, fake_jax, setup, [np.array([1.0, 2.0 + 2e-4])])
    assert on_cpu["rounding_floor"] is None and not on_cpu["passed"]


def test_a_rank_beyond_the_node_s_gpus_is_told_how_many_there_are(monkeypatch):
    from alpac.errors import UserError
    from alpac.runtime import worker
    monkeypatch.setattr(worker.os, "listdir", lambda d: ["nvidia0", "nvidiactl", "null"])
    monkeypatch.setenv("MPI_LOCALRANKID", "0")
    assert worker._rank_gpus(1) == [0]
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    with pytest.raises(UserError, match="this rank needs GPU 1 of its node, which has 1"):
        worker._rank_gpus(1)
