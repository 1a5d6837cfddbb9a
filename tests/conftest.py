"""Shared fixtures: tiny checkpoints in the real on-disk formats, golden vectors."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.demo import write_tiny_s1_checkpoint, write_tiny_s2_checkpoint

GOLDEN_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """``shared/golden`` beside the repository; tests using it skip when absent."""
    if not GOLDEN_DIR.is_dir():
        pytest.skip(f"golden vectors not found at {GOLDEN_DIR}")
    return GOLDEN_DIR


@pytest.fixture(scope="session")
def tiny_s2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random S2-Pro-format checkpoint dir (seed 0, incl. codec)."""
    return write_tiny_s2_checkpoint(tmp_path_factory.mktemp("ckpt") / "s2_tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_s1_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random openaudio-s1-mini-format checkpoint dir (seed 0, incl. codec)."""
    return write_tiny_s1_checkpoint(tmp_path_factory.mktemp("ckpt") / "s1_tiny", seed=0)
