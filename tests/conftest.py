"""Test session setup: 8 virtual CPU devices for XLA, set before anything imports jax."""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
TESTDATA = ROOT / "testdata"
sys.path.insert(0, str(ROOT))
