"""Flatten tuple-shaped entry parameters into one parameter per array."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.hlo import Module
from alpac.hlo.transforms import flatten_entry_tuple_params
from alpac.passes.manager import CompileContext, Pass


@dataclass(frozen=True)
class FlattenParamsPass(Pass):
    name = "flatten-params"
    description = "one entry parameter per array (tuple parameters are split; aliases follow)"
    requires = (Module,)

    def run(self, ctx: CompileContext) -> None:
        ctx.stats["flattened_params"] = flatten_entry_tuple_params(ctx.get(Module))
