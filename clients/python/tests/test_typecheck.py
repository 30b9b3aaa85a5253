"""The package type-checks under mypy --strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import idemq

PACKAGE = Path(idemq.__file__).resolve().parent


def test_mypy_strict_is_clean(tmp_path: Path) -> None:
    cache = Path(sys.prefix) / ".mypy_cache"
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), "-p", "idemq"],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no issues found in" in res.stdout
