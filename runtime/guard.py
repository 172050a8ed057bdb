"""`python -m alpac.runtime.guard MODULE ARGS...`: run `python -m MODULE ARGS...` as this
rank's child and record, the moment it ends, how and when (`ended.pid<PID>.json` in the
launcher's status folder).

Why: when one rank dies, mpiexec kills every other rank within milliseconds, and neither a
watcher's wake-up time nor mpiexec's banner tells reliably which rank died first on a loaded
machine. The guard's record is causally first: mpiexec reacts only once this guard has
exited, after writing it. The guard passes on the signals mpiexec forwards, and its child
dies with it (PR_SET_PDEATHSIG) should the guard itself be killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from alpac.procs import die_with_parent
from alpac.runtime.status import STATUS_ENV, write_json

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    child = subprocess.Popen([sys.executable, "-m", *argv], close_fds=False,
                             preexec_fn=die_with_parent)
    for sig in _FORWARDED:
        signal.signal(sig, lambda s, _frame: child.send_signal(s))
    code = child.wait()
    status = os.environ.get(STATUS_ENV)
    if status:
        write_json(Path(status) / f"ended.pid{child.pid}.json",
                   {"pid": child.pid, "time": time.time(), "code": code})
    if code < 0:  # end the way the child did, so that mpiexec reports the same signal
        if -code in _FORWARDED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
