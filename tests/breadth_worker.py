"""Run by test_autoshard.py in a child process: shard every module under the given folders on
the given meshes and compile the result with XLA, printing one line per case. A child process,
because XLA aborts the whole process on some malformed inputs, and the test must then still
say which module did it."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from alpac.errors import UserError  # noqa: E402
from alpac.hlo import parse_hlo, print_module  # noqa: E402
from alpac.hlo.transforms import flatten_entry_tuple_params, inline_calls  # noqa: E402
from alpac.intraop.autoshard import auto_shard  # noqa: E402
from alpac.plan.cluster import default_cluster  # noqa: E402
from alpac.plan.mesh import LogicalMesh  # noqa: E402
from alpac.xla.bridge import compile_hlo, cpu_devices  # noqa: E402


def main(paths, meshes):
    cluster = default_cluster()
    for path in paths:
        for text in meshes:
            name = f"{os.path.basename(path)} {text}"
            print("START", name, flush=True)
            module = parse_hlo(open(path).read(), path)
            inline_calls(module)
            flatten_entry_tuple_params(module)
            mesh = LogicalMesh.parse(text)
            try:
                result = auto_shard(module, mesh, cluster, time_limit=10)
            except UserError as e:
                print("REFUSED", name, "|", e, flush=True)
                continue
            try:
                compile_hlo(print_module(result.module), cpu_devices(mesh.num_devices))
            except ValueError as e:
                print("XLA-REJECTED", name, "|", e, flush=True)
                continue
            print("OK", name, flush=True)


if __name__ == "__main__":
    sep = sys.argv.index("--meshes")
    main(sys.argv[1:sep], sys.argv[sep + 1:])
