"""Submeshes: the slices of the cluster a pipeline stage can run on, their logical meshes, and
where on the cluster they go.

A submesh shape is (nodes, devices per node). It is either part of one node, (1, m), or whole
nodes, (k, M) with M = the cluster's devices per node; a stage never spans a fraction of
several nodes, so its model-parallel collectives can stay on the fast intra-node links.
Devices are numbered node by node: device d is on node d // M.
"""

from __future__ import annotations


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def submesh_shapes(nodes: int, devices_per_node: int,
                   space: str = "power_of_two") -> list[tuple[int, int]]:
    """Candidate submesh shapes, smallest first (Alpa's `get_submesh_choices`).

    Within one node: (1, m) for m = 1, 2, 4, ... up to M, when M is a power of two; otherwise
    the powers of two that divide M and M itself ("power_of_two") or every divisor of M
    ("all"). Whole nodes: (k, M) for k = 2, 4, 8, ... ("power_of_two"; the whole cluster is
    always added so that a single stage can use it) or every k = 2..nodes ("all").

    With "power_of_two" each width divides the next, so any set of submeshes that adds up
    to the cluster also fits on it (`place` packs them); with "all" and an M that is not a
    power of two that can fail, and the stage DP then skips that combination.
    """
    if nodes < 1 or devices_per_node < 1:
        raise ValueError(f"need at least one node and one device per node, got {nodes}x"
                         f"{devices_per_node}")
    M = devices_per_node
    if space == "power_of_two":
        widths = sorted({m for m in _divisors(M) if m & (m - 1) == 0} | {M})
        counts = sorted({1 << i for i in range(nodes.bit_length()) if 1 << i <= nodes}
                        | {nodes})
    elif space == "all":
        widths, counts = _divisors(M), list(range(1, nodes + 1))
    else:
        raise ValueError(f"unknown submesh space {space!r}; expected 'power_of_two' or 'all'")
    return [(1, m) for m in widths] + [(k, M) for k in counts if k > 1]


def logical_shapes(submesh: tuple[int, int],
                   max_model_parallel: int | None = None) -> list[tuple[int, ...]]:
    """The logical meshes a stage on `submesh` is tried with, Alpa's
    "single_node_model_parallel" space by default.

    - (n,): one axis over all n devices; the sharding ILP may split any dimension on it
      (pure data parallelism is one of its choices);
    - (dp, mp) with dp·mp = n and mp > 1: data parallel across the first axis, model
      parallel across the last. By default mp runs over the divisors of the submesh's devices
      per node, so that with the row-major device order of `place` every model-parallel
      group sits inside one node. `max_model_parallel` = k instead allows every mp dividing n
      up to k (Alpa's "all" with k = n), at the price of model-parallel groups that may cross
      nodes.

    Within one node every axis runs over the same links, so shapes that are the same up to
    the order of their axes price every sharding the same: only (dp, mp) with dp ≥ mp is
    kept there, and (1, n) — the same space as (n,) — is left out. `grid_shape` gives the
    exact shape a forced dp × tp grid asks for.
    """
    rows, width = submesh
    n = rows * width
    if max_model_parallel is None:
        mps = [mp for mp in _divisors(width) if mp > 1]
    else:
        mps = [mp for mp in _divisors(n) if 1 < mp <= max_model_parallel]
    if rows == 1:
        mps = [mp for mp in mps if n // mp >= mp]
    return [(n,)] + [(n // mp, mp) for mp in mps]


def stage_submesh(devices: int, devices_per_node: int) -> tuple[int, int] | None:
    """The submesh of a stage of `devices` devices: part of one node or whole nodes, any
    number of them (a forced grid's stages, e.g. Megatron's 24-node data-parallel replicas,
    need not come in the powers of two `submesh_shapes` offers); None where it is neither."""
    if devices <= devices_per_node:
        return 1, devices
    return (devices // devices_per_node, devices_per_node) \
        if devices % devices_per_node == 0 else None


def pinned_submeshes(pinned, submeshes, nodes: int, devices_per_node: int) -> list:
    """The submeshes pinned stages ask for (`--stage-meshes`) that `submeshes` lacks and the
    cluster has: any whole number of nodes, not only powers of two."""
    return [sm for sm in dict.fromkeys(pinned) if sm not in submeshes and sm[0] <= nodes
            and stage_submesh(sm[0] * sm[1], devices_per_node) == tuple(sm)]


def grid_shape(submesh: tuple[int, int], dp: int, tp: int) -> tuple[int, ...] | None:
    """The logical mesh (dp, tp) — or (dp,) when tp = 1 — on `submesh`, if it has dp·tp
    devices and each tensor-parallel group fits inside one node; else None."""
    rows, width = submesh
    if rows * width != dp * tp or width % tp:
        return None
    return (dp, tp) if tp > 1 else (dp,)


def place(submeshes: list[tuple[int, int]], nodes: int,
          devices_per_node: int) -> list[list[int]]:
    """Physical device ids for each submesh, in the order given (Alpa's
    `get_sliced_virtual_submeshes`). Whole-node submeshes take whole nodes first, largest
    first, from node 0 up; the others are packed into the nodes left, first-fit decreasing,
    each inside one node, on its lowest free devices. Ties keep the given order, so the
    result is deterministic. Each list is ascending, so a logical mesh over it, read
    row-major, keeps its last axis inside a node when that axis divides the submesh's
    devices per node. Raises ValueError when they do not fit."""
    M = devices_per_node
    for k, m in submeshes:
        if not (k >= 1 and 1 <= m <= M and (k == 1 or m == M)):
            raise ValueError(f"submesh {k}x{m} is neither part of one node nor whole nodes "
                             f"of {M} devices")
    free = [list(range(node * M, (node + 1) * M)) for node in range(nodes)]
    out: list[list[int]] = [[] for _ in submeshes]
    by_size = sorted(range(len(submeshes)), key=lambda s: -submeshes[s][0] * submeshes[s][1])
    next_node = 0
    for s in (s for s in by_size if submeshes[s][1] == M):
        k = submeshes[s][0]
        if next_node + k > nodes:
            raise ValueError(f"submeshes {submeshes} do not fit on {nodes}x{M} devices")
        for node in range(next_node, next_node + k):
            out[s] += free[node]
            free[node] = []
        next_node += k
    for s in (s for s in by_size if submeshes[s][1] < M):
        m = submeshes[s][1]
        node = next((node for node in range(next_node, nodes) if len(free[node]) >= m), None)
        if node is None:
            raise ValueError(f"submeshes {submeshes} do not fit on {nodes}x{M} devices")
        out[s], free[node] = free[node][:m], free[node][m:]
    return out
