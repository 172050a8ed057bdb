"""Synthetic HLO text for size scaling (issue 54): many parameters against a long chain.

Both shapes hold about N instructions of f32[4], so a compile of one should cost about as much
as the other; a pass that walks every instruction once per parameter shows up as the first
growing quadratically.
"""

from __future__ import annotations

SHAPE = "f32[4]{0}"


def many_parameters_hlo(count: int, echo_parameters: bool = False) -> str:
    """An entry of `count` parameters, each negated, the negations returned in one tuple
    (followed by the parameters themselves with `echo_parameters`)."""
    params = [f"  p.{i} = {SHAPE} parameter({i})" for i in range(count)]
    negs = [f"  neg.{i} = {SHAPE} negate(p.{i})" for i in range(count)]
    outputs = [f"neg.{i}" for i in range(count)]
    if echo_parameters:
        outputs += [f"p.{i}" for i in range(count)]
    result = f"({', '.join([SHAPE] * len(outputs))})"
    root = f"  ROOT tuple.0 = {result} tuple({', '.join(outputs)})"
    layout = f"({', '.join([SHAPE] * count)})->{result}"
    return "\n".join([f"HloModule wide_{count}, entry_computation_layout={{{layout}}}", "",
                      "ENTRY main {", *params, *negs, root, "}", ""])


def chain_hlo(count: int) -> str:
    """An entry of one parameter put through `count` negates in a row."""
    body = [f"  p.0 = {SHAPE} parameter(0)"]
    body += [f"  neg.{i} = {SHAPE} negate({'neg.' + str(i - 1) if i else 'p.0'})"
             for i in range(count)]
    body.append(f"  ROOT tuple.0 = ({SHAPE}) tuple(neg.{count - 1})")
    layout = f"({SHAPE})->({SHAPE})"
    return "\n".join([f"HloModule chain_{count}, entry_computation_layout={{{layout}}}", "",
                      "ENTRY main {", *body, "}", ""])
