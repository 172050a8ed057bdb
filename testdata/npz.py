"""Reference data files that are the same bytes every time they are written."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez_compressed, but byte-for-byte reproducible (fixed zip timestamps)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for key, arr in arrays.items():
            data = io.BytesIO()
            np.lib.format.write_array(data, np.array(arr, order="C"), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            info.create_system = 3
            zf.writestr(info, data.getvalue(), compresslevel=9)
    path.write_bytes(buf.getvalue())
