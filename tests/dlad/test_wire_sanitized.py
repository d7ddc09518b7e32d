"""The daemon's request decoder under AddressSanitizer and UndefinedBehaviorSanitizer: a short
run of ``bench/fuzz_wire.py`` (docs/reliability.md records the long one)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ builds the sanitized decoder"),
]


def test_fuzzed_messages_raise_no_sanitizer_report_and_keep_every_promise() -> None:
    done = subprocess.run(
        [sys.executable, "bench/fuzz_wire.py", "--messages", "30000", "--seed", "7"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.match(r"(\d+) messages read under ASan \+ UBSan, (\d+) taken", done.stdout)
    assert found is not None, done.stdout
    read, taken = int(found[1]), int(found[2])
    assert read == 30000
    assert taken > 1000  # the taken path is exercised, not only the refusals
