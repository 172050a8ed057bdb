"""The wiring of a microbatched step: where each module input comes from, where each
per-microbatch output goes, and the three modules (`MicrobatchedStep`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from alpac.hlo.ir import Module
from alpac.hlo.printer import print_module


class MicrobatchRefused(Exception):
    """The step cannot be microbatched exactly (or not into this many parts); says why."""


class SourceKind(enum.StrEnum):
    """Where a module input comes from (a str: `to_dict` writes it as it is)."""

    PARAM = "param"  # entry parameter `index`
    BATCH_SLICE = "batch_slice"  # the current microbatch's slice of parameter `index` on `dim`
    PROLOGUE = "prologue"  # prologue output `index`
    ACCUMULATED = "accumulated"  # sum over microbatches of accumulated value `index`
    CONCATENATED = "concatenated"  # concatenation over microbatches of value `index` on `dim`
    MICROBATCH_INDEX = "microbatch_index"  # s32[] scalar, 0..B-1


class SinkKind(enum.StrEnum):
    """Where a per-microbatch output goes (a str: `to_dict` writes it as it is)."""

    ACCUMULATE = "accumulate"  # added into accumulated value `index`
    CONCATENATE = "concatenate"  # concatenated into value `index` along `dim`


@dataclass(frozen=True)
class Source:
    """Where a module input comes from: a `SourceKind` with its `index` (and `dim`)."""

    kind: SourceKind
    index: int = 0
    dim: int | None = None

    def to_dict(self) -> dict:
        return _end_to_dict(self)


@dataclass(frozen=True)
class Sink:
    """Where a per-microbatch output goes: a `SinkKind` with its `index` (and `dim`)."""

    kind: SinkKind
    index: int
    dim: int | None = None

    def to_dict(self) -> dict:
        return _end_to_dict(self)


@dataclass
class MicrobatchedStep:
    num_microbatches: int
    batch_size: int
    prologue: Module | None
    prologue_inputs: list[Source]
    microbatch: Module
    microbatch_inputs: list[Source]
    microbatch_outputs: list[Sink]
    epilogue: Module
    epilogue_inputs: list[Source]
    accumulated: list[str] = field(default_factory=list)  # names in the original module
    concatenated: list[str] = field(default_factory=list)

    def texts(self) -> dict[str, str]:
        out = {"microbatch": print_module(self.microbatch),
               "epilogue": print_module(self.epilogue)}
        if self.prologue is not None:
            out["prologue"] = print_module(self.prologue)
        return out

    def to_dict(self) -> dict:
        return {
            "num_microbatches": self.num_microbatches, "batch_size": self.batch_size,
            "prologue_inputs": [s.to_dict() for s in self.prologue_inputs]
            if self.prologue is not None else None,
            "microbatch_inputs": [s.to_dict() for s in self.microbatch_inputs],
            "microbatch_outputs": [s.to_dict() for s in self.microbatch_outputs],
            "epilogue_inputs": [s.to_dict() for s in self.epilogue_inputs],
            "accumulated": list(self.accumulated), "concatenated": list(self.concatenated),
        }


def _end_to_dict(end: Source | Sink) -> dict:
    out = {"kind": end.kind, "index": end.index}
    if end.dim is not None:
        out["dim"] = end.dim
    return out
