"""Split the program into pipeline stages and give each a submesh and a logical mesh."""

from __future__ import annotations

from dataclasses import dataclass

from alpac.mesh import LogicalMesh
from alpac.passmanager import CompileContext, Pass
from alpac.stage import Stage


@dataclass
class StageConstructionPass(Pass):
    name = "stage-construction"
    description = "choose pipeline stages, their submeshes and logical meshes"
    requires = ("costs",)
    provides = ("stages",)
    mesh: str = ""  # e.g. 2x4: one stage over that many devices, intra-op parallelism only

    def run(self, ctx: CompileContext) -> None:
        cluster = ctx.cluster
        if self.mesh:
            mesh = LogicalMesh.parse(self.mesh, range(cluster.num_devices))
        else:
            mesh = LogicalMesh((cluster.num_devices,), tuple(range(cluster.num_devices)))
        nodes = {cluster.node_of(d) for d in mesh.devices}
        per_node = mesh.num_devices // len(nodes)
        ctx.module.analyses["stages"] = [Stage(0, mesh, ctx.module, None, (len(nodes), per_node))]

