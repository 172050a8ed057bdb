"""The folder through which the ranks tell alpa-run how they are doing (on one machine).

Its path comes in `STATUS_ENV`. A rank writes `pid.rank<R>` when it starts, `done.rank<R>`
when it finished and `error.rank<R>.json` when it failed; its guard (alpac.runtime.guard)
writes `ended.pid<PID>.json` when its process ended. Only light imports, so that the guard
starts in milliseconds.
"""

import json
import os

STATUS_ENV = "ALPAC_RUN_STATUS_DIR"


def write_json(path, data) -> None:
    """Write `data` to `path` whole or not at all: the launcher reads these files while the
    ranks write them."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
