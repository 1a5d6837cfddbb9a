"""Location of the shared golden vectors (``../shared/golden`` beside the repository)."""

from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"

requires_golden = pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"golden vectors not found at {GOLDEN}")
