"""Layer construction: exact against brute force, one block per layer on transformer-like
chains, relaxation when the constraints admit nothing, speed on 40K operations."""

import itertools
import random

import numpy as np
import pytest

from alpac.interop.layers import choose_num_layers, cluster, cluster_layers


def brute_force(flops, heavy, edges, L, bound, h):
    """(max, sum) of bytes entering the layers, least over all cut positions, or None."""
    n = len(flops)
    P = np.concatenate([[0.0], np.cumsum(np.asarray(flops, dtype=float))])
    size = {}
    for p, _, w in edges:
        size[p] = max(size.get(p, 0), w)

    def entering(a, b):
        return sum(size[p] for p in {p for p, c, _ in edges if p < a <= c < b})

    best = None
    for cuts in itertools.combinations(range(1, n), L - 1):
        bs = (0, *cuts, n)
        if all(P[b] <= P[a] + bound and sum(heavy[a:b]) >= h for a, b in zip(bs, bs[1:])):
            ins = [entering(a, b) for a, b in zip(bs, bs[1:])]
            best = min(best or (max(ins), sum(ins)), (max(ins), sum(ins)))
    return best


def random_program(rng, n):
    flops = [rng.choice([0, 1, 2, 5, 10]) for _ in range(n)]
    heavy = [rng.random() < 0.4 for _ in range(n)]
    edges = [(p, c, rng.choice([1, 2, 4, 8])) for c in range(n) for p in range(c)
             if rng.random() < 0.3]
    return flops, heavy, edges


def test_equals_brute_force_on_small_random_programs():
    rng = random.Random(5)
    relaxed = 0
    for _ in range(400):
        n = rng.randint(1, 12)
        L = rng.randint(1, min(4, n))
        flops, heavy, edges = random_program(rng, n)
        eps = rng.choice([0.0, 0.2, 0.5, 1.0])
        r = cluster_layers(flops, heavy, edges, L, eps)
        assert brute_force(flops, heavy, edges, L, r.flop_bound, r.heavy_min) == \
            (r.max_input_bytes, r.total_input_bytes)
        assert r.bounds[0] == 0 and r.bounds[-1] == n and len(r.bounds) == L + 1
        assert r.layer_of_op == [l for l in range(L) for _ in range(r.bounds[l], r.bounds[l + 1])]
        assert r.layer_of_op == cluster(flops, heavy, edges, L, eps)
        nominal = (sum(flops) / L * (1 + eps), min(3, sum(heavy) // L))
        if r.relaxed:
            relaxed += 1
            assert brute_force(flops, heavy, edges, L, *nominal) is None
            assert r.heavy_min == nominal[1] and r.flop_bound > nominal[0]
        else:
            assert (r.flop_bound, r.heavy_min) == nominal
    assert relaxed > 10  # the relaxation path was exercised


def blocks(num_blocks, width=1000):
    """A transformer-like chain: an embedding, then per block a pre-norm attention part and a
    pre-norm MLP part, each ended by adding the residual stream; one attention mask made up
    front is read by every block. Dots are heavy."""
    flops, heavy, edges = [], [], []

    def op(f, inputs, is_heavy=False, out=width):
        for p in inputs:
            edges.append((p, len(flops), sizes[p]))
        flops.append(f)
        heavy.append(is_heavy)
        sizes.append(out)
        return len(flops) - 1

    sizes = []
    x = op(10, [])  # embedding lookup
    mask = op(1, [], out=width // 4)
    for _ in range(num_blocks):
        for part in ("attention", "mlp"):
            h = op(5, [x])  # layer norm: a few elementwise ops
            h = op(5, [h, x])
            if part == "attention":
                q, k, v = (op(1e6, [h], True) for _ in range(3))
                s = op(1e6, [q, k], True)
                s = op(2, [s, mask])
                m = op(2, [s])
                s = op(2, [s, m])
                h = op(1e6, [s, v], True)
                h = op(1e6, [h], True)
            else:
                h = op(4e6, [h], True, out=4 * width)
                for _ in range(4):
                    h = op(8, [h], out=4 * width)
                h = op(4e6, [h], True)
            x = op(1, [h, x])
    return flops, heavy, edges


def block_starts(num_blocks):
    per_block = (len(blocks(2)[0]) - len(blocks(1)[0]))
    first = len(blocks(1)[0]) - per_block
    return [first + i * per_block for i in range(num_blocks)]


@pytest.mark.parametrize("num_blocks,layers", [(8, 8), (8, 4), (12, 3), (6, 6)])
def test_transformer_chain_cuts_at_block_boundaries(num_blocks, layers):
    flops, heavy, edges = blocks(num_blocks)
    r = cluster_layers(flops, heavy, edges, layers)
    starts = block_starts(num_blocks)
    per_layer = num_blocks // layers
    assert r.bounds == [0] + starts[per_layer::per_layer] + [len(flops)]
    assert r.max_input_bytes == 1000 + 250  # the residual stream and the mask
    assert not r.relaxed


@pytest.mark.parametrize("num_blocks", [8, 24])
def test_choose_num_layers_gives_one_layer_per_block(num_blocks):
    flops, heavy, edges = blocks(num_blocks)
    assert choose_num_layers(flops, heavy, edges) == num_blocks


def test_choose_num_layers_respects_the_cap_and_small_programs():
    flops, heavy, edges = blocks(24)
    assert choose_num_layers(flops, heavy, edges, max_layers=10) == 10  # 2 or 3 blocks each
    assert choose_num_layers([1.0], [True], []) == 1
    assert choose_num_layers([1.0, 1.0], [True, True], [(0, 1, 4)]) == 2


def test_balance_breaks_ties():
    # A chain where every cut costs the same: the FLOPs decide.
    n = 40
    flops = [float(i % 3 + 1) for i in range(n)]
    r = cluster_layers(flops, [True] * n, [(i - 1, i, 8) for i in range(1, n)], 4)
    ideal = sum(flops) / 4
    assert max(abs(f - ideal) for f in r.flops) <= 3


@pytest.mark.parametrize("flops,heavy", [
    ([1.0] * 9 + [100.0] + [1.0] * 10, [i % 2 == 0 for i in range(20)]),  # one giant op
    ([1.0] * 15 + [10.0] * 15, [True] * 15 + [False] * 15),  # dots bunched at the start
])
def test_relaxation_raises_the_flop_bound_just_enough(flops, heavy):
    edges = [(i - 1, i, 4) for i in range(1, len(flops))]
    r = cluster_layers(flops, heavy, edges, 4)
    assert r.relaxed and r.heavy_min == min(3, sum(heavy) // 4)  # the heavy minimum is kept
    assert r.flop_bound > sum(flops) / 4 * 1.5
    assert max(r.flops) <= r.flop_bound
    assert brute_force(flops, heavy, edges, 4, r.flop_bound * (1 - 1e-6), r.heavy_min) is None
    assert brute_force(flops, heavy, edges, 4, r.flop_bound, r.heavy_min) == \
        (r.max_input_bytes, r.total_input_bytes)


def test_bad_input():
    with pytest.raises(ValueError):
        cluster([1.0, 1.0], [True, True], [], 3)
    with pytest.raises(ValueError):
        cluster([1.0, 1.0], [True, True], [(1, 0, 4)], 1)
    with pytest.raises(ValueError):
        cluster([1.0, -1.0], [True, True], [], 1)
    with pytest.raises(ValueError):
        cluster([1.0], [True, False], [], 1)


def test_40k_ops():
    # the speed on this size is measured by benchmarks/bench_analysis.py
    flops, heavy, edges = blocks(1900)  # ~40K ops
    assert len(flops) > 39000
    r = cluster_layers(flops, heavy, edges, 100)
    assert r.max_input_bytes == 1250 and not r.relaxed
    assert choose_num_layers(flops, heavy, edges) == 128  # the cap: 1900 blocks are plenty


def test_a_head_heavier_than_a_layer_share_keeps_the_cuts_at_blocks():
    """Blocks then an LM head as heavy as 0.3 of a block, one layer per block: cutting after
    an attention part lets in as few bytes as cutting after an MLP part, and the
    nearest-to-even cut from the last layer back (MLP and head: 0.9 of the mean, against 1.3
    for a block and the head) moves an attention into every layer before, the first then 1.4
    blocks. The largest layer as small as the bytes allow keeps every cut at a block (the last
    layer holds a block and the head), as Megatron's stages hold whole blocks."""
    num_blocks = 24
    flops, heavy, edges = blocks(num_blocks)
    edges = [e for e in edges if e[0] != 1]  # no mask: any residual add is as cheap a cut
    block = sum(flops) / num_blocks
    edges.append((len(flops) - 1, len(flops), 1000))
    flops.append(0.3 * block)
    heavy.append(True)
    r = cluster_layers(flops, heavy, edges, num_blocks)
    assert r.bounds == [0] + block_starts(num_blocks)[1:] + [len(flops)]
    assert max(r.flops) == pytest.approx(1.3 * block, rel=1e-3)


def test_the_largest_layer_is_the_least_the_bytes_allow():
    """Against brute force: among the partitions with the least (max, sum) of bytes entering,
    none has a largest layer smaller (to the bisection's 0.1%)."""
    rng = random.Random(11)
    for _ in range(200):
        n = rng.randint(2, 11)
        L = rng.randint(2, min(4, n))
        flops, heavy, edges = random_program(rng, n)
        r = cluster_layers(flops, heavy, edges, L, 0.5)
        best = brute_force(flops, heavy, edges, L, r.flop_bound, r.heavy_min)
        P = np.concatenate([[0.0], np.cumsum(flops)])
        least = min(max(P[b] - P[a] for a, b in zip(bs, bs[1:]))
                    for cuts in itertools.combinations(range(1, n), L - 1)
                    for bs in [(0, *cuts, n)]
                    if brute_force_of(flops, heavy, edges, bs, r.flop_bound, r.heavy_min)
                    == best)
        assert max(r.flops) <= least * (1 + 1e-3) + 1e-9


def brute_force_of(flops, heavy, edges, bs, bound, h):
    """(max, sum) of bytes entering the layers of one partition `bs`, None if it breaks the
    constraints."""
    P = np.concatenate([[0.0], np.cumsum(np.asarray(flops, dtype=float))])
    if not all(P[b] <= P[a] + bound and sum(heavy[a:b]) >= h for a, b in zip(bs, bs[1:])):
        return None
    size = {}
    for p, _, w in edges:
        size[p] = max(size.get(p, 0), w)
    ins = [sum(size[p] for p in {p for p, c, _ in edges if p < a <= c < b})
           for a, b in zip(bs, bs[1:])]
    return max(ins), sum(ins)
