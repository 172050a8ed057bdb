"""The folder through which the ranks tell alpa-run how they are doing (on one machine).

Its path comes in `STATUS_ENV`. A rank writes `pid.rank<R>` when it starts, `done.rank<R>`
when it finished and `error.rank<R>.json` when it failed; its guard (alpac.runtime.guard)
writes `ended.pid<PID>.json` when its process ended. Free of imports, so that the guard
starts in milliseconds.
"""

STATUS_ENV = "ALPAC_RUN_STATUS_DIR"
