"""Read a model file, whatever form its front end wrote, into the HLO IR.

HLO text is parsed directly; HloModuleProto binaries and StableHLO/MHLO text are first turned
into HLO text by XLA itself (through the runtime bridge), so all three arrive as the same IR.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from alpac.errors import UserError
from alpac.hlo import Module, parse_hlo
from alpac.hlo.limits import MLIR_DEPTH_MAX, MODEL_BYTES_MAX, read_bounded, too_deep_at
from alpac.hlo.shapecheck import check_module

TEXT_SUFFIXES = (".hlo", ".txt")
PROTO_SUFFIXES = (".pb", ".hlo.pb", ".pbtxt.bin")
MLIR_SUFFIXES = (".mlir", ".stablehlo")


def read_model_bytes(path: str | Path) -> bytes:
    p = Path(path)
    if not p.exists():
        raise UserError("no such file; expected an HLO module (.hlo, .txt, .pb or .mlir)",
                        path=str(path))
    if p.is_dir():
        raise UserError("is a directory; expected an HLO module file (.hlo, .txt, .pb or .mlir)",
                        path=str(path))
    try:
        data = read_bounded(p, MODEL_BYTES_MAX, "model file")
    except OSError as e:
        raise UserError(f"cannot read the model file: {e.strerror or e}", path=str(path)) from None
    if not data.strip():
        raise UserError("empty file; expected an HLO module", path=str(path), line=1, col=1)
    return data


def load_module(path: str | Path) -> Module:
    """Load `path` as HLO text, an HloModuleProto binary or StableHLO text (by suffix, then
    by content)."""
    data = read_model_bytes(path)
    name = str(path)
    kind = _kind(Path(path), data)
    if kind == "proto":
        from alpac.xla.bridge import hlo_text_from_proto
        try:
            text = hlo_text_from_proto(data)
        except ValueError as e:
            raise UserError(f"not a valid HloModuleProto binary: {e}", path=name) from None
        return _checked(parse_hlo(text, name), name, text, from_text=False)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError("binary data where HLO text was expected (not UTF-8); a serialized "
                        "HloModuleProto needs the .pb suffix", path=name, line=line,
                        col=col) from None
    if kind == "mlir":
        from alpac.xla.bridge import hlo_text_from_stablehlo
        _check_nesting(text, name)
        try:
            text = hlo_text_from_stablehlo(text)
        except ValueError as e:
            raise UserError(f"not a valid StableHLO/MHLO module: {e}", path=name) from None
    return _checked(parse_hlo(text, name), name, text, from_text=kind == "text")


# what nests nothing in MLIR text: strings, comments and the arrows of function types
_MLIR_UNNESTED = r'"[^"\\]*(?:\\.[^"\\]*)*"|//[^\n]*|->'


def _check_nesting(text: str, name: str) -> None:
    """UserError where StableHLO text nests past MLIR_DEPTH_MAX, before XLA's parser, which
    recurses in C++, overflows its stack on it (a segfault, not an error)."""
    offset = too_deep_at(text, "()[]{}<>", _MLIR_UNNESTED, MLIR_DEPTH_MAX)
    if offset is not None:
        line = text.count("\n", 0, offset) + 1
        raise UserError(f"nested more than {MLIR_DEPTH_MAX} brackets deep, more than alpac "
                        f"hands XLA's parser", path=name, line=line,
                        col=offset - text.rfind("\n", 0, offset))


def _checked(module: Module, name: str, text: str, from_text: bool) -> Module:
    """`module` once its shapes follow from its operands and its constants are whole (line
    numbers only where the user's file is the text parsed)."""
    check_module(module, name, text, with_lines=from_text)
    return module


def _kind(path: Path, data: bytes) -> str:
    name = path.name.lower()
    if name.endswith(PROTO_SUFFIXES):
        return "proto"
    if name.endswith(MLIR_SUFFIXES):
        return "mlir"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    head = data.lstrip()[:200]
    if head.startswith(b"HloModule"):
        return "text"
    if head.startswith((b"module", b"func.func", b"#loc")):
        return "mlir"
    return "proto" if b"\x00" in data[:4096] else "text"


def module_hash(path: str | Path) -> str:
    """sha256 of the model file's bytes: identifies the source of a plan."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
