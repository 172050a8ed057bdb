"""Test session setup: 8 virtual CPU devices for XLA, set before anything imports jax."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
TESTDATA = ROOT / "testdata"
# plans the module-level caches of the tests write: this run's own (two runs of the suite may
# share a machine), removed when it exits
_SCRATCH = tempfile.TemporaryDirectory(prefix="alpac-tests-")
SCRATCH = Path(_SCRATCH.name)
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def mlp_plan(tmp_path_factory) -> Path:
    """A one-stage plan of the MLP training step on two devices (copy it to change it)."""
    out = tmp_path_factory.mktemp("plans") / "mlp"
    subprocess.run([str(BIN / "alpac"), "compile", str(TESTDATA / "models" / "mlp_train.hlo"),
                    "--mesh", "2", "--time-limit", "10", "-o", str(out)], check=True,
                   capture_output=True)
    return out
