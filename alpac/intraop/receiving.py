"""What receiving a parameter from another mesh costs a pipeline stage's ILP: alpa-run receives
per node, so the bytes one node of the stage's mesh holds in the parameter's sharding
(`node_bytes`), over the link from the sending mesh, as often as it is received. A replicated
activation costs every node all of it, one split over the nodes a share (GPT-39.1B's two
stages on 32 nodes each took a 6.4 GB gradient replicated, 277 ms per microbatch)."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.analysis.costmodel import CostModel, node_bytes
from alpac.plan.sharding import Sharding


@dataclass(frozen=True)
class Receive:
    """A parameter a pipeline stage receives: its bytes, how often per step, and a device of
    the mesh it comes from."""

    nbytes: int
    times: float
    src_device: int


def receive_seconds(model: CostModel, receive: Receive, sharding: Sharding) -> float:
    """Seconds per step receiving the parameter in `sharding` on the model's mesh."""
    mesh = model.mesh
    held = node_bytes(receive.nbytes, sharding.to_xla(tuple(mesh.shape)), list(mesh.devices),
                      model.cluster)
    return receive.times * model.send(held, receive.src_device, mesh.devices[0])
