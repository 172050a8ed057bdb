"""Small IR rewrites shared by several passes."""

from __future__ import annotations

import hashlib
import re

from alpac.hlo.ir import Computation, ComputationRefs, Instruction, Module
from alpac.hlo.printer import print_module


def replace_uses(comp: Computation, old: Instruction, new: Instruction) -> None:
    for instr in comp.instructions:
        if old in instr.operands:
            instr.operands = [new if op is old else op for op in instr.operands]
    if comp.root is old:
        comp.root = new


def inline_calls(module: Module) -> int:
    """Inline every `call` (front ends such as jax keep library functions as calls); returns
    how many were inlined. Computations no longer called are dropped."""
    count = 0
    for comp in module.computations:
        while True:
            calls = [i for i in comp.instructions if i.opcode == "call"]
            if not calls:
                break
            for call in calls:
                _inline_one(module, comp, call)
                count += 1
    if count:
        forward_tuples(module)
    drop_unreachable(module)
    return count


# the computations a loop or conditional runs with its own state: each needs its own shardings
_PER_CALLER = ("body", "condition", "branch_computations", "true_computation",
               "false_computation")


def flatten_call_graph(module: Module) -> int:
    """Give every loop and conditional computations of their own (copies where several share
    one); returns how many were copied. Inlined calls leave one loop body under several loops
    (jax's PRNG rounds, called once per random draw), while the sharding planner gives each
    loop's state its own sharding: a shared body would be annotated once per loop."""
    claimed: set[int] = set()
    copied = 0
    todo = [module.entry]
    while todo:
        for instr in todo.pop().instructions:
            for key in _PER_CALLER:
                refs = instr.attrs.get(key)
                if not isinstance(refs, ComputationRefs):
                    continue
                own = []
                for callee in refs:
                    if id(callee) in claimed:
                        callee = _copy_computation(module, callee)
                        copied += 1
                    claimed.add(id(callee))
                    own.append(callee)
                    todo.append(callee)
                instr.attrs[key] = ComputationRefs(own, refs.braced)
    return copied


def _copy_computation(module: Module, comp: Computation) -> Computation:
    """A copy of `comp` with fresh names, placed after it; it calls what `comp` calls."""
    mapping: dict[int, Instruction] = {}
    copy = Computation(module.unique_name(comp.name))
    for instr in comp.instructions:
        mapping[id(instr)] = copy.append(Instruction(
            module.unique_name(instr.name), instr.opcode, instr.shape,
            [mapping[id(o)] for o in instr.operands], instr.attrs, instr.payload, instr.line))
    copy.root = mapping[id(comp.root)]
    module.computations.insert(module.computations.index(comp) + 1, copy)
    return copy


def _inline_one(module: Module, comp: Computation, call: Instruction) -> None:
    inline_at(module, comp, call, call.called("to_apply"), call.operands)


def inline_at(module: Module, comp: Computation, at: Instruction, callee: Computation,
              operands) -> None:
    """Replace `at` (a call, or a loop known to run once) by a copy of `callee`'s
    instructions taking `operands` as its parameters."""
    mapping: dict[int, Instruction] = {}
    for param in callee.parameters:
        mapping[id(param)] = operands[param.parameter_number]
    new_instrs: list[Instruction] = []
    for instr in callee.instructions:
        if instr.opcode == "parameter":
            continue
        clone = Instruction(module.unique_name(instr.name), instr.opcode, instr.shape,
                            [mapping[id(op)] for op in instr.operands], dict(instr.attrs),
                            instr.payload, instr.line)
        clone.parent = comp
        mapping[id(instr)] = clone
        new_instrs.append(clone)
    result = mapping[id(callee.root)]
    if "sharding" in at.attrs and result in new_instrs:
        result.attrs["sharding"] = at.attrs["sharding"]
    position = comp.instructions.index(at)
    comp.instructions[position:position + 1] = new_instrs
    replace_uses(comp, at, result)


def forward_tuples(module: Module) -> int:
    """Replace get-tuple-element(tuple(...), k) by the k-th operand (inlined calls return tuples
    that are taken apart at once); returns how many were replaced. Dead tuples are dropped."""
    count = 0
    for comp in module.computations:
        replaced = {}
        for instr in comp.instructions:
            instr.operands = [replaced.get(id(o), o) for o in instr.operands]
            if instr.opcode == "get-tuple-element" and instr.operands[0].opcode == "tuple" \
                    and "sharding" not in instr.attrs:
                replaced[id(instr)] = instr.operands[0].operands[instr.tuple_index]
                count += 1
        if comp.root is not None and id(comp.root) in replaced:
            comp.root = replaced[id(comp.root)]
        if replaced:
            comp.remove_dead()
    return count


def remove_dead_code(module: Module) -> int:
    """Drop the instructions no root needs and that have no side effect, in every computation
    (XLA removes them before partitioning, so they must be neither planned nor priced);
    returns how many were dropped. Parameters stay."""
    count = 0
    for comp in module.computations:
        before = len(comp.instructions)
        comp.remove_dead()
        count += before - len(comp.instructions)
    drop_unreachable(module)  # computations only dead instructions called
    return count


def drop_unreachable(module: Module) -> None:
    """Remove computations the entry does not reach."""
    reachable: set[int] = set()
    stack = [module.entry]
    while stack:
        comp = stack.pop()
        if id(comp) in reachable:
            continue
        reachable.add(id(comp))
        for instr in comp.instructions:
            stack.extend(instr.called_computations)
    module.computations = [c for c in module.computations if id(c) in reachable]



def flatten_entry_tuple_params(module: Module) -> int:
    """Give every array inside a tuple-shaped entry parameter a parameter of its own (XLA's
    StableHLO path flattens them anyway, and loses aliases that name tuple indices). Aliases
    and buffer donors are renumbered; returns how many parameters were flattened."""
    entry = module.entry
    params = entry.parameters
    if not any(p.shape.is_tuple for p in params):
        return 0
    new_number: dict[tuple[int, tuple], int] = {}
    replacements: dict[int, Instruction] = {}
    flat: list[Instruction] = []
    for p in params:
        if not p.shape.is_tuple:
            new_number[(p.parameter_number, ())] = len(flat)
            flat.append(p)
            continue
        leaves = {}
        for idx, shape in p.shape.leaves():
            leaf = Instruction(module.unique_name(f"{p.name}.{'.'.join(map(str, idx))}"),
                               "parameter", shape, (), {}, "0")
            leaf.parent = entry
            new_number[(p.parameter_number, idx)] = len(flat)
            flat.append(leaf)
            leaves[idx] = leaf
        replacements[id(p)] = _rebuild_tuple(module, entry, p.shape, leaves, ())
    for k, p in enumerate(flat):
        p.payload = str(k)
    body = [i for i in entry.instructions if i.opcode != "parameter"]
    rebuilt = [r for r in _collect(replacements.values()) if r.opcode != "parameter"]
    entry.instructions = flat + rebuilt + body
    for instr in body:
        instr.operands = [replacements.get(id(o), o) for o in instr.operands]
    if id(entry.root) in replacements:
        entry.root = replacements[id(entry.root)]
    for alias in module.input_output_alias:
        alias.parameter_number = new_number[(alias.parameter_number, alias.parameter_index)]
        alias.parameter_index = ()
    module.buffer_donors = [(new_number[d], ()) for d in module.buffer_donors]
    module.entry_layout = None
    entry.topological_sort()
    entry.remove_dead()
    return sum(1 for p in params if p.shape.is_tuple)


def _rebuild_tuple(module, comp, shape, leaves, idx) -> Instruction:
    if not shape.is_tuple:
        return leaves[idx]
    parts = [_rebuild_tuple(module, comp, s, leaves, idx + (k,))
             for k, s in enumerate(shape.tuple_shapes)]
    tup = Instruction(module.unique_name("flat.tuple"), "tuple", shape, parts)
    tup.parent = comp
    return tup


def _collect(roots) -> list[Instruction]:
    """Instructions reachable from `roots`, operands first (in operand order, depth first)."""
    out, seen = [], set()
    for start in roots:
        if id(start) in seen:
            continue
        seen.add(id(start))
        stack = [(start, iter(start.operands))]
        while stack:
            node, operands = stack[-1]
            nxt = next((o for o in operands if id(o) not in seen), None)
            if nxt is None:
                stack.pop()
                out.append(node)
            else:
                seen.add(id(nxt))
                stack.append((nxt, iter(nxt.operands)))
    return out


def canonical_hash(module) -> str:
    """Identical for modules that differ only in names and metadata."""
    text = re.sub(r"^HloModule \S+", "HloModule m", print_module(module))
    text = re.sub(r", metadata=\{[^{}]*\}", "", text)
    text = re.sub(r"^(ENTRY )?(%\S+) \(.*\) -> .* \{$", r"\1\2 {", text, flags=re.M)
    names: dict[str, str] = {}
    text = re.sub(r"%[\w.\-:]+", lambda m: names.setdefault(m.group(), f"%n{len(names)}"), text)
    return hashlib.sha256(text.encode()).hexdigest()


def canonical_order(comp: Computation) -> None:
    """Put the instructions in the order a depth-first walk from the root meets them
    (operands first, in operand order): two cuts of the same graph listed in different orders
    then print alike — and hash alike — and their instructions match by position."""
    comp.instructions[:] = _collect([comp.root] + comp.instructions)
