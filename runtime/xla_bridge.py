"""The one place that touches jaxlib internals.

Everything alpac asks of XLA itself goes through here: converting HloModuleProto binaries and
StableHLO text to HLO text, XLA's own parse and cost analysis of a module, and compiling and
running (sharded) HLO on a list of devices. jaxlib's private API moves between releases; the
pinned version is in pyproject.toml, and only this module has to follow it.
"""

from __future__ import annotations

import os
import warnings
from functools import cache

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep XLA's C++ logging off the console


@cache
def _jaxlib():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax._src.lib import _jax, hlo, xla_client
        from jax._src import xla_bridge
    return _jax, hlo, xla_client, xla_bridge


def _xla_module(text: str):
    _, hlo, _, _ = _jaxlib()
    return hlo.hlo_module_from_text(text)


def hlo_text_from_proto(data: bytes) -> str:
    """HLO text of a serialized HloModuleProto (raises ValueError if it is not one)."""
    _, hlo, _, _ = _jaxlib()
    try:
        return hlo.HloModule.from_serialized_hlo_module_proto(data).to_string()
    except Exception as e:  # jaxlib raises its own XlaRuntimeError types
        raise ValueError(_first_line(e)) from None


def hlo_text_from_stablehlo(text: str) -> str:
    """HLO text of a StableHLO (or MHLO) MLIR module."""
    _jax, _, _, _ = _jaxlib()
    try:
        comp = _jax.mlir.mlir_module_to_xla_computation(text, use_tuple_args=False,
                                                        return_tuple=False)
    except Exception as e:
        raise ValueError(_first_line(e)) from None
    return comp.as_hlo_text()


def xla_reprint(text: str) -> str:
    """XLA's own parse of HLO text, printed back by XLA (raises ValueError if XLA rejects it)."""
    try:
        return _xla_module(text).to_string()
    except Exception as e:
        raise ValueError(_first_line(e)) from None


def xla_cost_analysis(text: str) -> dict[str, float]:
    """XLA's HloCostAnalysis of a whole module on the CPU backend."""
    _jax, _, _, xla_bridge = _jaxlib()
    return dict(_jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), _xla_module(text)))


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__
