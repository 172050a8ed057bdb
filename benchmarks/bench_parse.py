"""Parse speed of the HLO text parser on the largest modules (target: < 3 s each, one core)."""

from __future__ import annotations

from common import SHARED, median_time, write_results

from alpac.hlo import parse_hlo


def main() -> None:
    from testdata.generate import gpt_suite_hlo

    inputs = {
        "hlo_mixtral_8x7b_bf16_1x8.hlo": (SHARED / "hlo-corpus" /
                                          "hlo_mixtral_8x7b_bf16_1x8.hlo").read_text(),
        "hlo_llama31_8b_bf16_1x8.hlo": (SHARED / "hlo-corpus" /
                                        "hlo_llama31_8b_bf16_1x8.hlo").read_text(),
        "GPT-39B training step (generated)": gpt_suite_hlo("39B"),
    }
    rows = []
    for name, text in inputs.items():
        module = parse_hlo(text)
        seconds = median_time(lambda: parse_hlo(text), repeat=5)
        n = module.instruction_count()
        rows.append({"module": name, "instructions": f"{n:,}",
                     "MB": f"{len(text) / 1e6:.1f}", "parse s (median of 5)": f"{seconds:.2f}",
                     "instructions/s": f"{n / seconds:,.0f}",
                     "under 3 s": "yes" if seconds < 3 else "NO"})
    write_results("parse", "HLO text parser speed", rows,
                  "Single process, one core; `make bench` regenerates this file.")


if __name__ == "__main__":
    main()
