"""Speed of the analyses every compile runs first: per-instruction costs of the 42K-instruction
Mixtral module (target < 2 s) and layer clustering of a 40K-operation program (targets: one
clustering < 3 s, the automatic layer count < 5 s)."""

from __future__ import annotations

import sys
import time

from common import ROOT, SHARED, median_time, write_results

from alpac.analysis.costs import CostTable
from alpac.hlo import parse_hlo
from alpac.interop.layers import choose_num_layers, cluster_layers

sys.path.insert(0, str(ROOT / "tests"))
from test_layers import blocks  # noqa: E402  (the synthetic transformer-like program)


def main() -> None:
    module = parse_hlo((SHARED / "hlo-corpus" / "hlo_mixtral_8x7b_bf16_1x8.hlo").read_text())
    table_s = median_time(lambda: CostTable(module), repeat=3)
    flops, heavy, edges = blocks(1900)
    cluster_s = median_time(lambda: cluster_layers(flops, heavy, edges, 100), repeat=3)
    start = time.perf_counter()
    choose_num_layers(flops, heavy, edges)
    choose_s = time.perf_counter() - start
    rows = [
        {"what": "cost table, Mixtral 8x7B module", "size": f"{module.instruction_count():,} "
         "instructions", "seconds": f"{table_s:.2f}", "target": "< 2", "met": table_s < 2},
        {"what": "layer clustering into 100 layers", "size": f"{len(flops):,} operations",
         "seconds": f"{cluster_s:.2f}", "target": "< 3", "met": cluster_s < 3},
        {"what": "automatic layer count", "size": f"{len(flops):,} operations",
         "seconds": f"{choose_s:.2f}", "target": "< 5", "met": choose_s < 5},
    ]
    write_results("analysis", "Speed of the first analyses", rows,
                  "Medians of 3 runs (the layer count: one run).")


if __name__ == "__main__":
    main()
