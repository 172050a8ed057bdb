"""Batch rules of the ops that index, contract, window or call out (mixed into `Dataflow`).

Dots, convolutions, gathers, scatters, slices, pads, concatenations, sorts, windows,
batch norm and custom-calls. Each rule takes the instruction and its operands' classes and
returns the result's class, recording needs, full uses and mixes through the `Dataflow`
methods (`_need`, `_full_use`, `_mix`, `_sum`, `_from`, `_full`).
"""

from __future__ import annotations

import re

from alpac.analysis.step.lattice import FULL, INDEP, PSUM, Cls, like_shape, split
from alpac.hlo.ir import Instruction


def _slice_spec(instr: Instruction) -> list[tuple[int, int, int]]:
    out = []
    for part in re.findall(r"\[([^\]]*)\]", str(instr.attrs.get("slice", ""))):
        nums = [int(v) for v in part.split(":")]
        out.append((nums[0], nums[1], nums[2] if len(nums) > 2 else 1))
    return out

def _padding(instr: Instruction) -> list[tuple[int, ...]]:
    text = str(instr.attrs.get("padding", ""))
    return [tuple(int(v) for v in p.split("_")) for p in text.split("x") if p]

def _dim_labels(instr: Instruction) -> tuple[str, str, str]:
    text = str(instr.attrs.get("dim_labels", "b01f_01io->b01f"))
    lhs, _, rest = text.partition("_")
    rhs, _, out = rest.partition("->")
    return lhs, rhs, out


def reducer_kind(comp) -> str | None:
    """'add', 'maximum', ... when the computation is that binary op of its two parameters."""
    if comp is None or comp.root is None:
        return None
    root = comp.root
    params = comp.parameters
    if len(params) == 2 and len(root.operands) == 2 and set(map(id, root.operands)) == \
            set(map(id, params)):
        return root.opcode
    return None


class OpRules:
    """Rules of `Dataflow` for indexing, contracting, windowed and custom ops."""

    def _dot(self, x, ocs):
        cl, cr = ocs
        lhs, rhs = x.operands
        lb, rb = x.dims("lhs_batch_dims"), x.dims("rhs_batch_dims")
        lc, rc = x.dims("lhs_contracting_dims"), x.dims("rhs_contracting_dims")
        lfree = [d for d in range(lhs.shape.rank) if d not in lb and d not in lc]
        rfree = [d for d in range(rhs.shape.rank) if d not in rb and d not in rc]
        nb = len(lb)
        if cl.kind == "S" and cr.kind == "S":
            if cl.inner == cr.inner:
                if cl.dim in lb and rb[lb.index(cl.dim)] == cr.dim:
                    return split(lb.index(cl.dim), cl.inner)
                if cl.dim in lc and rc[lc.index(cl.dim)] == cr.dim:
                    return self._sum(x)
            return self._mix(x, "a dot that pairs examples with other examples")
        if "S" in (cl.kind, cr.kind):
            si = 0 if cl.kind == "S" else 1
            s, oi = ocs[si], 1 - si
            own_b, own_c, own_free = (lb, lc, lfree) if si == 0 else (rb, rc, rfree)
            oth_b, oth_c = (rb, rc) if si == 0 else (lb, lc)
            other = ocs[oi]
            if other.kind in "PF":
                self._full_use(x, oi)
            d = s.dim
            if d in own_b:
                k = own_b.index(d)
                if other.kind in "IZ":
                    self._need(x, oi, oth_b[k])
                return split(k, s.inner)
            if d in own_c:
                if other.kind not in "IZ":
                    return self._mix(x, "a dot that contracts the batch with a batch sum")
                self._need(x, oi, oth_c[own_c.index(d)])
                return self._sum(x)
            pos = nb + own_free.index(d) if si == 0 else nb + len(lfree) + own_free.index(d)
            return split(pos, s.inner)
        return self._bilinear(x, ocs)

    def _bilinear(self, x, ocs):
        kinds = [c.kind for c in ocs]
        if "F" in kinds:
            return self._full(x, ocs)
        if kinds.count("P") == 2:
            return self._full(x, ocs)
        if "P" in kinds:
            return self._from(x, PSUM, ocs)
        return self._zero_rule(x, ocs)

    def _convolution(self, x, ocs):
        cl, cr = ocs
        lhs_l, rhs_l, out_l = _dim_labels(x)
        fg = x.int_attr("feature_group_count", 1)
        bg = x.int_attr("batch_group_count", 1)
        plain = fg == 1 and bg == 1
        if cl.kind == "S" and cr.kind == "S":
            if lhs_l[cl.dim] == "f" and rhs_l[cr.dim] == "i" and plain and cl.inner == cr.inner:
                return self._sum(x)
            return self._mix(x, "a convolution that pairs examples with other examples")
        if cl.kind == "S":
            if cr.kind in "PF":
                self._full_use(x, 1)
            ch = lhs_l[cl.dim]
            if ch == "b" and bg == 1:
                return split(out_l.index("b"), cl.inner)
            if ch == "f" and plain and cr.kind in "IZ":
                self._need(x, 1, rhs_l.index("i"))
                return self._sum(x)
            return self._mix(x, f"a convolution over the batch (batch on lhs dim '{ch}')")
        if cr.kind == "S":
            if cl.kind in "PF":
                self._full_use(x, 0)
            ch = rhs_l[cr.dim]
            if ch == "o" and plain:
                return split(out_l.index("f"), cr.inner)
            if ch == "i" and plain and cl.kind in "IZ":
                self._need(x, 0, lhs_l.index("f"))
                return self._sum(x)
            return self._mix(x, f"a convolution over the batch (batch on rhs dim '{ch}')")
        return self._bilinear(x, ocs)

    def _slice(self, x, ocs):
        c = ocs[0]
        if c.kind == "S":
            spec = _slice_spec(x)
            size = x.operands[0].shape.dims[c.dim]
            if c.dim < len(spec) and spec[c.dim] == (0, size, 1):
                return c
            return self._mix(x, "a slice that keeps only some examples")
        if c.kind in "PF":
            return self._from(x, c, ocs)
        return self._zero_rule(x, ocs)

    def _dynamic_slice(self, x, ocs):
        c = ocs[0]
        if any(s.kind not in "IZ" for s in ocs[1:]):
            return self._full(x, ocs, "a dynamic-slice whose start depends on the batch")
        if c.kind == "S":
            sizes = x.dims("dynamic_slice_sizes")
            if sizes[c.dim] == x.operands[0].shape.dims[c.dim]:
                return c
            return self._mix(x, "a dynamic-slice that keeps only some examples")
        if c.kind in "PF":
            return self._from(x, c, ocs)
        return self._zero_rule(x, ocs)

    def _dus(self, x, ocs):
        co, cu = ocs[0], ocs[1]
        if any(s.kind not in "IZ" for s in ocs[2:]):
            return self._full(x, ocs, "a dynamic-update-slice whose start depends on the batch")
        s = self._the_split(x, ocs, (0, 1))
        if s is False:
            return self._mix(x, "updates a value split along another dim")
        if s is not None:
            if x.operands[1].shape.dims[s.dim] != x.operands[0].shape.dims[s.dim]:
                return self._mix(x, "a dynamic-update-slice that writes only some examples")
            self._meet_split(x, ocs[:2], s)
            return s
        kinds = [co.kind, cu.kind]
        if "F" in kinds:
            return self._full(x, ocs)
        if "P" in kinds:
            return self._from(x, PSUM if all(k in "PZ" for k in kinds) else FULL, ocs)
        return self._zero_rule(x, ocs)

    def _pad(self, x, ocs):
        c, pv = ocs
        if c.kind == "S":
            pads = _padding(x)
            if pv.kind in "PF":
                self._full_use(x, 1)
            if c.dim < len(pads) and all(v == 0 for v in pads[c.dim]):
                return c
            return self._mix(x, "a pad along the batch dim")
        if c.kind == "F" or pv.kind in "PF" and not (c.kind in "PZ" and pv.kind in "PZ"):
            return self._full(x, ocs)
        if c.kind == "P":
            return self._from(x, PSUM if pv.kind == "Z" else FULL, ocs)
        return self._zero_rule(x, ocs)

    def _concatenate(self, x, ocs):
        s = self._the_split(x, ocs)
        if s is False:
            return self._mix(x, "concatenates values split along different dims")
        if s is not None:
            if s.dim == x.dims("dimensions")[0]:
                return self._mix(x, "a concatenation along the batch dim")
            self._meet_split(x, ocs, s)
            return s
        kinds = [c.kind for c in ocs]
        if "F" in kinds:
            return self._full(x, ocs)
        if "P" in kinds:
            return self._from(x, PSUM if all(k in "PZ" for k in kinds) else FULL, ocs)
        return self._zero_rule(x, ocs)

    def _gather(self, x, ocs):
        co, ci = ocs
        op, idx = x.operands
        offset = x.dims("offset_dims")
        collapsed = x.dims("collapsed_slice_dims")
        ivd = x.int_attr("index_vector_dim", idx.shape.rank)
        sizes = x.dims("slice_sizes")
        obd = x.dims("operand_batching_dims")
        sibd = x.dims("start_indices_batching_dims")
        batch_out = [i for i in range(x.shape.rank) if i not in offset]
        idx_dims = [i for i in range(idx.shape.rank) if i != ivd]
        window = [i for i in range(op.shape.rank) if i not in collapsed and i not in obd]
        if ci.kind == "S":
            if ci.dim == ivd:
                return self._mix(x, "gather indices split along the index vector")
            od = batch_out[idx_dims.index(ci.dim)]
            if co.kind == "S":
                if co.dim in obd and sibd[obd.index(co.dim)] == ci.dim and \
                        co.inner == ci.inner:
                    return split(od, ci.inner)
                return self._mix(x, "a gather that picks examples of another example")
            if co.kind in "PF":
                self._full_use(x, 0)
            return split(od, ci.inner)
        if ci.kind in "PF":
            return self._full(x, ocs)
        if co.kind == "S":
            d = co.dim
            if d in obd:
                j = sibd[obd.index(d)]
                self._need(x, 1, j)
                return split(batch_out[idx_dims.index(j)], co.inner)
            if d in window and sizes[d] == op.shape.dims[d]:
                return split(offset[window.index(d)], co.inner)
            return self._mix(x, "a gather that selects examples")
        if co.kind in "PF":
            return self._from(x, co, ocs)
        return self._zero_rule(x, ocs)

    def _scatter(self, x, ocs):
        if len(x.operands) != 3 or any(not isinstance(c, Cls) for c in ocs):
            return self._opaque(x, ocs)
        co, ci, cu = ocs
        op, idx, upd = x.operands
        uwd = x.dims("update_window_dims")
        iwd = x.dims("inserted_window_dims")
        ivd = x.int_attr("index_vector_dim", idx.shape.rank)
        ibd = x.dims("input_batching_dims")
        sibd = x.dims("scatter_indices_batching_dims")
        scatter_dims = [i for i in range(upd.shape.rank) if i not in uwd]
        idx_dims = [i for i in range(idx.shape.rank) if i != ivd]
        window = [i for i in range(op.shape.rank) if i not in iwd and i not in ibd]
        is_add = reducer_kind(x.called("to_apply")) == "add"
        if cu.kind == "S":
            e = cu.dim
            if e in uwd:
                d = window[uwd.index(e)]
                if upd.shape.dims[e] != op.shape.dims[d] or ci.kind not in "IZ" or \
                        co.kind in "PF" or co.kind == "S" and co != Cls("S", d, cu.inner):
                    return self._mix(x, "a scatter that moves examples")
                if co.kind in "IZ":
                    self._need(x, 0, d)
                return split(d, cu.inner)
            j = idx_dims[scatter_dims.index(e)]
            if ci.kind == "S":
                if ci.dim != j or ci.inner != cu.inner:
                    return self._mix(x, "scatter indices and updates split differently")
            elif ci.kind in "IZ":
                self._need(x, 1, j)
            else:
                return self._full(x, ocs)
            if co.kind == "S" and co.dim in ibd and sibd[ibd.index(co.dim)] == j:
                return co
            if is_add and co.kind in "PZ":
                return self._sum(x)
            return self._mix(x, "a scatter that combines examples without adding them")
        if ci.kind == "S":
            return self._mix(x, "scatter indices split along the batch")
        if co.kind == "S":
            d = co.dim
            if d in window and ci.kind in "IZ" and cu.kind in "IZ":
                e = uwd[window.index(d)]
                if upd.shape.dims[e] == op.shape.dims[d]:
                    self._need(x, 2, e)
                    return co
            return self._mix(x, "a scatter into some examples")
        kinds = [co.kind, ci.kind, cu.kind]
        if "F" in kinds or ci.kind == "P":
            return self._full(x, ocs)
        if "P" in kinds:
            ok = is_add and co.kind in "PZ" and cu.kind in "PZ"
            return self._from(x, PSUM if ok else FULL, ocs)
        return self._zero_rule(x, ocs)

    def _sort(self, x, ocs):
        if any(not isinstance(c, Cls) for c in ocs):
            return self._opaque(x, ocs)
        s = self._the_split(x, ocs)
        if s is False:
            return self._mix(x, "sorts values split along different dims")
        if s is not None:
            if s.dim in x.dims("dimensions"):
                return self._mix(x, "a sort along the batch dim")
            self._meet_split(x, ocs, s)
            return s if len(ocs) == 1 else tuple(s for _ in ocs)
        return self._full(x, ocs) if any(c.kind in "PF" for c in ocs) else \
            like_shape(x.shape, INDEP)

    def _topk(self, x, ocs):
        """The k largest along the last dim: a split on another dim passes to both results."""
        c = ocs[0]
        if c.kind == "S":
            if c.dim == x.operands[0].shape.rank - 1:
                return self._mix(x, "a top-k across examples")
            return like_shape(x.shape, c)
        if c.kind in "PF":
            return self._full(x, ocs)
        return like_shape(x.shape, INDEP)

    def _fft(self, x, ocs):
        """Transforms of the last len(fft_length) dims: a split on a leading dim passes."""
        c = ocs[0]
        if c.kind == "S":
            if c.dim >= x.operands[0].shape.rank - len(x.dims("fft_length")):
                return self._mix(x, "an FFT across examples")
            return c
        if c.kind in "PZ":  # linear: a transform of a batch sum is the sum of the transforms
            return self._from(x, c, ocs)
        if c.kind == "F":
            return self._full(x, ocs)
        return like_shape(x.shape, INDEP)

    def _reverse(self, x, ocs):
        c = ocs[0]
        if c.kind == "S":
            if c.dim in x.dims("dimensions"):
                return self._mix(x, "a reverse along the batch dim")
            return c
        if c.kind in "PF":
            return self._from(x, c, ocs)
        return self._zero_rule(x, ocs)

    def _trivial_window(self, x, dim: int) -> bool:
        w = x.window()
        for key, trivial in (("size", 1), ("stride", 1), ("lhs_dilate", 1), ("rhs_dilate", 1)):
            vals = w.get(key)
            if vals and dim < len(vals) and vals[dim] != trivial:
                return False
        pads = w.get("pad")
        return not (pads and dim < len(pads) and tuple(pads[dim]) != (0, 0))

    def _reduce_window(self, x, ocs):
        n = len(x.operands) // 2
        if any(not isinstance(c, Cls) for c in ocs):
            return self._opaque(x, ocs)
        s = self._the_split(x, ocs[:n])
        if s is False:
            return self._mix(x, "reduces values split along different dims")
        if s is not None:
            if not self._trivial_window(x, s.dim):
                return self._mix(x, "a window across examples")
            self._meet_split(x, ocs, s)
            return s if n == 1 else tuple(s for _ in range(n))
        kinds = [c.kind for c in ocs]
        if "P" in kinds[:n] and "F" not in kinds and n == 1 and kinds[1] == "Z" and \
                reducer_kind(x.called("to_apply")) == "add":
            return self._from(x, PSUM, ocs)
        if "P" in kinds or "F" in kinds:
            return self._full(x, ocs)
        return self._zero_rule(x, ocs)

    def _select_and_scatter(self, x, ocs):
        s = self._the_split(x, ocs[:2])
        if s is False or s is None and any(c.kind in "PF" for c in ocs):
            return self._full(x, ocs) if s is None else self._mix(x, "mismatched splits")
        if s is not None:
            if not self._trivial_window(x, s.dim):
                return self._mix(x, "a window across examples")
            self._meet_split(x, ocs[:2], s)
            return s
        return like_shape(x.shape, INDEP)

    def _bn_training(self, x, ocs):
        c = ocs[0]
        fi = x.int_attr("feature_index", -1)
        if isinstance(c, Cls) and c.kind == "S" and c.dim != fi:
            if self._record:
                self.blockers.append((x, f"{x.opcode} %{x.name} normalizes each example with "
                                         f"mean and variance over the whole batch"))
            self.origin[x] = x
            return (c,) + tuple(FULL for _ in x.shape.tuple_shapes[1:])
        return self._opaque(x, ocs)

    def _bn_inference(self, x, ocs):
        c = ocs[0]
        fi = x.int_attr("feature_index", -1)
        if c.kind == "S" and c.dim != fi and all(o.kind in "IZ" for o in ocs[1:]):
            self._meet_split(x, ocs, c, dim_of=lambda i: None)
            return c
        return self._opaque(x, ocs)

    def _custom_call(self, x, ocs):
        if x.is_identity_call:
            return ocs[0]
        rule = x.sharding_rule()
        if rule is not None:
            out = self._by_factors(x, ocs, *rule)
            if out is not None:
                return out
        return self._opaque(x, ocs)

    def _by_factors(self, x, ocs, operand_factors, result_factors, sizes):
        """Classes from a Shardy sharding rule: a dim of a result follows the operand dims
        that carry the same factor. Operands split on factors of the same size are taken to
        be split on the same batch (the rule of a fused kernel may name them apart)."""
        if len(operand_factors) != len(ocs) or any(not isinstance(c, Cls) for c in ocs):
            return None
        split_factors = set()
        inner = None
        for c, facs in zip(ocs, operand_factors):
            if c.kind in "PF":
                return None
            if c.kind == "S":
                if c.dim >= len(facs):
                    return None
                split_factors.add(facs[c.dim])
                inner = c.inner if inner is None else inner
                if c.inner != inner:
                    return None
        if not split_factors:
            return None
        fsizes = {sizes.get(f) for f in split_factors}
        if len(fsizes) != 1:
            return None
        batch_size = fsizes.pop()
        linked = {f for f in split_factors if any(f in r for r in result_factors)}
        if not linked:
            return None
        for c, facs in zip(ocs, operand_factors):
            if c.kind in "IZ":
                for k, f in enumerate(facs):
                    if f in split_factors or sizes.get(f) == batch_size and f in linked:
                        self._need(x, ocs.index(c), k)
        outs = []
        for facs in result_factors:
            dims = [k for k, f in enumerate(facs) if f in split_factors]
            outs.append(split(dims[0], inner) if len(dims) == 1 else FULL)
        if self._record:
            self.assumed.append((x, "batch dims of a custom-call taken from its Shardy "
                                    "sharding rule"))
        if x.shape.is_tuple:
            return tuple(outs) if len(outs) == len(x.shape.tuple_shapes) else None
        return outs[0] if len(outs) == 1 else None


