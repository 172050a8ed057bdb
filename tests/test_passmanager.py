"""The pass manager's contract: typed results declared in requires/optional/provides, checks
after every pass (what it made, the IR and every module it made, each result's own check),
and pass specs that reproduce a pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from alpac.driver import build_pipeline
from alpac.errors import UserError
from alpac.hlo import Module, parse_hlo
from alpac.passes.manager import CompileContext, Pass, PassFailed, PassManager, available_passes, \
    parse_pipeline, pipeline_spec

MODEL = Path(__file__).resolve().parent.parent / "testdata" / "models" / "mlp_fwd.hlo"
BROKEN = """HloModule broken
ENTRY e {
  p = f32[4] parameter(0)
  ROOT n = f32[4] negate(p)
}
"""


@dataclass(frozen=True)
class Count:
    instructions: int

    def plan_entries(self):
        return {"count": self.instructions}


@dataclass(frozen=True)
class Checked:
    ok: bool
    module: Module | None = None

    def modules(self):
        return [self.module] if self.module is not None else []

    def check(self):
        return None if self.ok else "it is not ok"


def run(*passes: Pass) -> CompileContext:
    ctx = CompileContext(MODEL, None)
    PassManager([available_passes()["load"](), *passes]).run(ctx)
    return ctx


def test_results_are_handed_on_by_type_and_make_plan_entries():
    @dataclass(frozen=True)
    class Counting(Pass):
        name = "counting"
        description = "count"
        requires = (Module,)
        provides = (Count,)

        def run(self, ctx):
            ctx.put(Count(len(ctx.get(Module).entry.instructions)))

    ctx = run(Counting())
    assert ctx.get(Count).instructions == len(ctx.module.entry.instructions)
    assert ctx.plan_entries() == {"count": ctx.get(Count).instructions}


@pytest.mark.parametrize("body, message", [
    ("get", "Count is not in the pass's requires"),
    ("find", "Count is not in the pass's requires or optional"),
    ("put", "Count is not in the pass's provides"),
    ("nothing", "it did not provide Checked"),
])
def test_undeclared_access_and_missing_results_name_the_pass(body, message):
    @dataclass(frozen=True)
    class Sloppy(Pass):
        name = "sloppy"
        description = "reads and writes what it did not declare"
        requires = (Module,)
        provides = (Checked,)

        def run(self, ctx):
            if body == "get":
                ctx.get(Count)
            elif body == "find":
                ctx.find(Count)
            elif body == "put":
                ctx.put(Count(1))

    with pytest.raises(PassFailed, match="pass 'sloppy' failed") as e:
        run(Sloppy())
    assert message in str(e.value)


def test_missing_input_is_named_before_the_pass_runs():
    ctx = CompileContext(MODEL, None)
    with pytest.raises(PassFailed, match="requires Module, which no earlier pass provided"):
        PassManager([available_passes()["cost-analysis"]()]).run(ctx)


@pytest.mark.parametrize("result, message", [
    (Checked(False), "its Checked is wrong: it is not ok"),
    (Checked(True, "invalid"), "it left the IR invalid"),
])
def test_postconditions_run_on_every_new_result(result, message):
    if result.module == "invalid":
        module = parse_hlo(BROKEN)
        module.entry.instructions.reverse()  # the negate before its operand
        result = Checked(True, module)

    @dataclass(frozen=True)
    class Making(Pass):
        name = "making"
        description = "makes a result"
        provides = (Checked,)

        def run(self, ctx):
            ctx.put(result)

    with pytest.raises(PassFailed, match="pass 'making' failed") as e:
        run(Making())
    assert message in str(e.value)


def test_options_come_from_type_hints_and_specs_round_trip():
    spec = ('load,stage-construction{micro_batches=4,stages="0-1,2-3",'
            'strategy="megatron:dp=1,tp=2,pp=2"},intra-op-sharding{gap=0.01}')
    pipeline = build_pipeline(spec)
    stage = pipeline[1]
    assert stage.micro_batches == 4 and stage.stages == "0-1,2-3"
    assert stage.strategy == "megatron:dp=1,tp=2,pp=2" and pipeline[2].gap == 0.01
    assert pipeline_spec(pipeline) == spec
    assert parse_pipeline(pipeline_spec(pipeline)) == parse_pipeline(spec)
    with pytest.raises(UserError, match="expects int"):
        build_pipeline("stage-construction{micro_batches=four}")
    with pytest.raises(Exception):  # frozen: options are fixed once made
        stage.micro_batches = 8
