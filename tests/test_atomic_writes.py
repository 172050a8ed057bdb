"""The files alpac and alpa-run write beside a plan (outputs, reports, traces, cluster files)
replace their targets whole: a write that fails midway leaves the previous file as it was and
no temporary file behind, and its error is one line naming the file."""

from __future__ import annotations

import errno
import os
import resource
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TESTDATA

from alpac.errors import UserError

BIN = Path(sys.executable).parent
OLD = b"the previous file\n"


def _previous(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    target.write_bytes(OLD)
    return target


def _assert_untouched(target: Path) -> None:
    assert target.read_bytes() == OLD
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_outputs_torn_midway_leave_the_previous_file(tmp_path, monkeypatch):
    from alpac.runtime.data import save

    def torn_savez(f, **arrays):
        f.write(b"PK\x03\x04 half an archive")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    target = _previous(tmp_path, "outputs.npz")
    monkeypatch.setattr(np, "savez", torn_savez)
    with pytest.raises(UserError, match="outputs.npz: cannot write the outputs: No space left"):
        save(target, [np.zeros(4)])
    _assert_untouched(target)


def test_an_interrupted_write_leaves_the_previous_file(tmp_path):
    from alpac.plan.io import replacing
    target = _previous(tmp_path, "report.json")
    with pytest.raises(KeyboardInterrupt):
        with replacing(target, "report") as f:
            f.write(b'{"half": ')
            raise KeyboardInterrupt
    _assert_untouched(target)


def test_a_finished_write_replaces_the_file_as_open_would_make_it(tmp_path):
    from alpac.runtime.data import save
    target = _previous(tmp_path, "outputs.npz")
    save(target, [np.arange(3.0)])
    assert np.load(target)["out0"].tolist() == [0.0, 1.0, 2.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs.npz"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


def _file_size_limit(limit: int):
    """For a child process: writes past `limit` bytes fail with EFBIG (a full disk, midway)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


WRITERS = {  # what writes `target` (a file of more than 64 bytes), as Python code
    "report": "from alpac.runtime.report import write; write({'x': list(range(100))}, target)",
    "trace": "from alpac.plan.trace import write_trace; write_trace({'e': [0] * 100}, target)",
    "cluster file": "from alpac.plan.io import write_replacing; "
                    "write_replacing(target, 'calibration: ' + '1' * 100, 'cluster file')",
}


@pytest.mark.parametrize("what", sorted(WRITERS))
def test_a_full_disk_midway_leaves_the_previous_file(tmp_path, what):
    target = _previous(tmp_path, "out.json")
    code = (f"import sys; from pathlib import Path; from alpac.errors import UserError\n"
            f"target = Path({str(target)!r})\n"
            f"try:\n    {WRITERS[what]}\n"
            f"except UserError as e:\n    sys.exit(str(e))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       preexec_fn=_file_size_limit(64), timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == \
        f"{target}: cannot write the {what}: File too large", r.stderr
    _assert_untouched(target)


def test_explain_trace_on_a_full_disk(tmp_path):
    plan = tmp_path / "plan"
    subprocess.run([str(BIN / "alpac"), "compile", str(TESTDATA / "models" / "mlp_train.hlo"),
                    "--mesh", "2", "--time-limit", "10", "-o", str(plan)], check=True,
                   capture_output=True)
    out = tmp_path / "traces"
    out.mkdir()
    target = _previous(out, "trace.json")
    r = subprocess.run([str(BIN / "alpac"), "explain", str(plan), "--trace", str(target)],
                       capture_output=True, text=True, preexec_fn=_file_size_limit(64),
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"alpac: error: {target}: cannot write the trace: File too large"
    _assert_untouched(target)
