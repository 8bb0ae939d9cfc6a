"""Where things are: the repository's root and the tests' folder, for every test and helper."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
