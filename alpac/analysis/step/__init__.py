"""The structure of a training step, recovered from HLO alone, and exact microbatching.

- `batch`     which entry parameters carry the batch, on which dim (`BatchInfo`)
- `lattice`   the batch classes of a value (independent, split, batch sum, full batch)
- `dataflow`  the batch-dimension analysis of every instruction (`Dataflow`)
- `split`     per-microbatch / accumulate / once-per-step parts, forward/backward (`StepSplit`)
- `rewrite`   the per-microbatch module with batch dims divided by B
- `wiring`    the modules of a microbatched step and where their inputs come from
- `execute`   reference single-device execution of a microbatched step (`run_microbatched`)
"""

from alpac.analysis.step.batch import BatchArg, BatchInfo, batch_info_from_args, detect_batch, \
    parse_batch_args
from alpac.analysis.step.dataflow import Dataflow, analyse
from alpac.analysis.step.split import StepSplit
from alpac.analysis.step.wiring import MicrobatchedStep, MicrobatchRefused, Sink, Source

__all__ = ["BatchArg", "BatchInfo", "Dataflow", "MicrobatchRefused", "MicrobatchedStep", "Sink",
           "Source", "StepSplit", "analyse", "batch_info_from_args", "detect_batch",
           "parse_batch_args", "run_microbatched"]


def run_microbatched(step, args, B=None):
    """See `alpac.analysis.step.execute.run_microbatched` (imported lazily: it needs jaxlib)."""
    from alpac.analysis.step.execute import run_microbatched as run
    return run(step, args, B)
