"""The kernels XLA's fusion makes of a computation, and the bytes each kernel moves.

A measured table prices a kernel (`alpac calibrate` times a fused elementwise chain and a
reduction as one kernel each), not an instruction: a chain of ten elementwise ops that XLA
fuses reads its inputs and writes its result once, and pays one kernel's fixed cost. The
rule is XLA's loop and input fusion in its simplest form: an op of `LOOP_FUSIBLE` all of
whose users are such ops or reductions runs inside its users' kernels, made again in each
where it has several, unless it is expensive (a transcendental, a division: XLA keeps
those in a kernel of their own rather than repeat them); a constant, iota or broadcast
whose users all fuse is made again inside each of their kernels. Each
instruction keeps its share of its kernel's bytes (what it reads from outside the kernel,
and its result where that leaves the kernel), so the sharding ILP can still price each
instruction under its own sharding.
"""

from __future__ import annotations

from dataclasses import dataclass

from alpac.analysis.costs import CostTable
from alpac.hlo.ir import Computation, Instruction
from alpac.hlo.opcodes import CONTRACTIONS, GENERATORS, LOOP_FUSIBLE, REDUCTIONS, TRANSCENDENTAL


@dataclass(frozen=True, slots=True)
class KernelShare:
    """An instruction's bytes inside the kernel XLA runs it in."""

    own: float  # read from outside the kernel, plus its result if that leaves the kernel
    kernel: float  # the kernel's bytes: its members' `own` summed
    kind: str  # "reduce" or "elementwise": which measured table prices the kernel
    root: Instruction  # the instruction whose result the kernel writes (names the kernel)


def kernel_shares(comp: Computation, costs: CostTable, *, cpu: bool
                  ) -> dict[Instruction, KernelShare]:
    """Every costed instruction of `comp` that is not a contraction, with its kernel share,
    as XLA's GPU backend fuses (`cpu`: its CPU backend, whose fusion makes a cheap op again
    in every kernel that uses it, whatever the bytes)."""
    users = comp.users()
    fusible = LOOP_FUSIBLE | REDUCTIONS
    # a constant, iota or broadcast all of whose users fuse is made again inside each of
    # their kernels (XLA duplicates what is cheaper to make than to read): no kernel of its
    # own, and each user reads what it is made from (a broadcast's operand, a literal)
    again = {x for x in comp.instructions if x.opcode in GENERATORS and users[x] and
             all(u.opcode in fusible for u in users[x])}
    root: dict[Instruction, Instruction] = {}
    made_in: dict[Instruction, frozenset] = {}  # the kernels (their roots) it is made in
    for instr in reversed(comp.instructions):  # users come after their operands
        outs = users[instr]
        fused = instr.opcode in LOOP_FUSIBLE and bool(outs) and \
            all(u in root and u.opcode in fusible for u in outs) and \
            (len(outs) == 1 or not _expensive(instr))
        kernels = frozenset().union(*(made_in[u] for u in outs)) if fused else None
        fused = fused and (cpu or _worth_making_again(instr, len(kernels), again))
        root[instr] = root[outs[0]] if fused else instr
        made_in[instr] = kernels if fused else frozenset((instr,))
    own: dict[Instruction, float] = {}
    for instr in comp.instructions:
        if instr not in costs or instr.opcode in CONTRACTIONS:
            continue
        if instr in again:
            own[instr] = 0.0
            continue
        cost = costs[instr]
        operand_bytes = [op.shape.byte_size for op in instr.operands]
        outside = sum(_made_from(op) if op in again else b
                      for op, b in zip(instr.operands, operand_bytes)
                      if op in again or root[instr] not in made_in.get(op, ()))
        total = sum(operand_bytes)
        read = cost.bytes_read * (outside / total if total else 1.0) * len(made_in[instr])
        own[instr] = read + (cost.bytes_written if root[instr] is instr else 0.0)
    kernel: dict[Instruction, float] = {}
    for instr, b in own.items():
        kernel[root[instr]] = kernel.get(root[instr], 0.0) + b
    return {instr: KernelShare(b, kernel[root[instr]],
                               "reduce" if root[instr].opcode in REDUCTIONS else "elementwise",
                               root[instr])
            for instr, b in own.items()}


def _worth_making_again(x: Instruction, kernels: int, again: set) -> bool:
    """Whether XLA's GPU backend makes `x` again inside each of the `kernels` that use it
    rather than write it once: its priority fusion decides by the bytes either way. Made again, each
    kernel reads x's operands; written once, x reads them, writes its result, and each kernel
    reads that. A binary op of equal shapes is made again in at most 3 kernels, so a chain
    of them (a residual stream's gradient, summed layer by layer) is written every few
    links instead of being made again, ever longer, in every kernel below it."""
    if kernels <= 1:
        return True
    out = x.shape.byte_size
    read = sum(_made_from(op) if op in again else op.shape.byte_size for op in x.operands)
    return (kernels - 1) * read <= (kernels + 1) * out


def _expensive(x: Instruction) -> bool:
    """Whether XLA keeps `x` in a kernel of its own rather than make it again inside each of
    its users' kernels (its fusion duplicates only cheap ops: not transcendentals, nor a
    division of floating-point numbers)."""
    return x.opcode in TRANSCENDENTAL or (x.opcode in ("divide", "remainder") and
                                          x.shape.dtype.startswith(("f", "bf", "c")))


def _made_from(x: Instruction) -> float:
    """Bytes a kernel reads to make generator `x` again: a literal's own, a broadcast's
    operand, nothing for an iota."""
    if x.opcode == "constant":
        return x.shape.byte_size
    return sum(op.shape.byte_size for op in x.operands)
