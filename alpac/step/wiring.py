"""The wiring of a microbatched step: where each module input comes from, where each
per-microbatch output goes, and the three modules (`MicrobatchedStep`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from alpac.hlo.ir import Module
from alpac.hlo.printer import print_module


class MicrobatchRefused(Exception):
    """The step cannot be microbatched exactly (or not into this many parts); says why."""


@dataclass(frozen=True)
class Source:
    """Where a module input comes from.

    kind: 'param' (entry parameter `index`), 'batch_slice' (the current microbatch's slice of
    entry parameter `index` along `dim`), 'prologue' (prologue output `index`), 'accumulated'
    (sum over microbatches of accumulated value `index`), 'concatenated' (concatenation over
    microbatches of value `index` along `dim`), 'microbatch_index' (s32[] scalar, 0..B-1).
    """

    kind: str
    index: int = 0
    dim: int | None = None

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "index": self.index}
        if self.dim is not None:
            out["dim"] = self.dim
        return out


@dataclass(frozen=True)
class Sink:
    """Where a per-microbatch output goes: 'accumulate' into accumulated value `index`, or
    'concatenate' into concatenated value `index` along `dim`."""

    kind: str
    index: int
    dim: int | None = None

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "index": self.index}
        if self.dim is not None:
            out["dim"] = self.dim
        return out


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
