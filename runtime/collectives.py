"""Collectives XLA's CPU backend gets wrong across processes, rewritten before compiling.

XLA runs a `reduce-scatter` between processes on CPU with gloo's halving-doubling algorithm,
which sends a device's first half to its partner asynchronously and then, in the same call,
copies its own reduced half over that first half without waiting for the send to finish. When
the receiver drains the connection late (a loaded machine), the unsent tail of the message is
the overwritten data: the partner's result ends in a few hundred wrong elements, differently
from run to run. XLA's own CPU partitioning never emits a reduce-scatter (it all-reduces and
slices), and gloo's all-reduce waits for its sends, so `alpa-run` runs each reduce-scatter of a
module whose mesh spans processes on CPU as exactly that: an all-reduce over the same groups
and a dynamic-slice at the device's position in its group. The sums are the same; only the
bytes on the wire double, on a CPU run.
"""

from __future__ import annotations

import re

import numpy as np

from alpac.hlo import parse_hlo, print_module
from alpac.hlo.ir import Instruction
from alpac.hlo.shape import Shape
from alpac.hlo.transforms import replace_uses

_IOTA = re.compile(r"^\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")


def replica_groups(text: str | None, n: int) -> list[list[int]] | None:
    """Groups of a `replica_groups` attribute (`{{0,2},{1,3}}` or `[2,2]<=[4]`, with `T(..)`);
    empty: one group of all `n`. None when the form is not understood."""
    text = (text or "{}").strip()
    m = _IOTA.match(text)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        reshape = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(reshape))).reshape(reshape)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    groups = [[int(x) for x in g.split(",") if x.strip()]
              for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
    groups = [g for g in groups if g]
    return groups or [list(range(n))]


def _leave_replicated(comp, rs: Instruction, groups, num_partitions: int) -> bool:
    """A reduce-scatter over all partitions whose result only leaves the manual region becomes
    an all-reduce that leaves the region replicated: XLA's CPU compiler aborts on the
    dynamic-slice form there (a check on manual shardings). Seen otherwise for vectors that
    stay split after leaving (a rejected shard shape): those keep the slice form."""
    uses = comp.users()
    users = uses.get(rs, [])
    if len(groups) != 1 or len(groups[0]) != num_partitions or not users or not all(
            u.opcode == "custom-call" and u.custom_call_target == "SPMDShardToFullShape"
            and u.shape.without_layout() == rs.operands[0].shape.without_layout()
            and (rs.shape.rank > 1 or all(str(w.attrs.get("sharding")) == "{replicated}"
                                          for w in uses.get(u, [])))
            for u in users):
        return False
    rs.opcode = "all-reduce"
    rs.shape = rs.operands[0].shape
    rs.attrs.pop("dimensions", None)
    rs.attrs.pop("scatter_dimension", None)
    for u in users:
        u.attrs["sharding"] = "{replicated}"
    return True


def reduce_scatters_as_all_reduces(text: str, num_partitions: int) -> str:
    """The module with every cross-partition `reduce-scatter` of one array replaced by an
    all-reduce and a dynamic-slice at the partition's position in its group (the text as given
    when there is none)."""
    if "reduce-scatter(" not in text:
        return text
    module = parse_hlo(text)
    changed = False
    for comp in module.computations:
        for rs in [i for i in comp.instructions if i.opcode == "reduce-scatter"]:
            if len(rs.operands) != 1 or rs.shape.is_tuple or "channel_id" not in rs.attrs:
                continue
            dims = rs.dims("dimensions")
            groups = replica_groups(rs.attrs.get("replica_groups"), num_partitions)
            if len(dims) != 1 or groups is None:
                continue
            if _leave_replicated(comp, rs, groups, num_partitions):
                changed = True
                continue
            dim, chunk = dims[0], rs.shape.dims[dims[0]]
            table = [0] * num_partitions
            for g in groups:
                for k, p in enumerate(g):
                    if p < num_partitions:
                        table[p] = k * chunk
            extra = {"sharding": rs.attrs["sharding"]} if "sharding" in rs.attrs else {}
            out_shape = rs.shape
            operand = rs.operands[0]

            def add(base: str, opcode: str, shape: Shape, operands=(), attrs=None,
                    payload=None) -> Instruction:
                return comp.append(Instruction(module.unique_name(f"{rs.name}.{base}"), opcode,
                                               shape, operands, {**(attrs or {}), **extra},
                                               payload))

            offsets = add("offsets", "constant", Shape.array("s32", [num_partitions]),
                          payload="{" + ",".join(map(str, table)) + "}")
            pid = add("partition", "partition-id", Shape.array("u32", []))
            pid32 = add("partition.s32", "convert", Shape.array("s32", []), [pid])
            one = add("offset.1", "dynamic-slice", Shape.array("s32", [1]), [offsets, pid32],
                      {"dynamic_slice_sizes": "{1}"})
            offset = add("offset", "reshape", Shape.array("s32", []), [one])
            zero = add("zero", "constant", Shape.array("s32", []), payload="0")
            # the reduce-scatter itself becomes the all-reduce (same groups, channel, reducer)
            rs.opcode = "all-reduce"
            rs.shape = operand.shape
            rs.attrs.pop("dimensions", None)
            rs.attrs.pop("scatter_dimension", None)
            sliced = add("slice", "dynamic-slice", out_shape,
                         [rs] + [offset if d == dim else zero for d in range(out_shape.rank)],
                         {"dynamic_slice_sizes": "{" + ",".join(map(str, out_shape.dims)) + "}"})
            replace_uses(comp, rs, sliced)
            sliced.operands[0] = rs  # replace_uses also redirected the slice's own operand
            changed = True
        if changed:
            comp.topological_sort()
    return print_module(module) if changed else text
