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


# Interpreter workers (tests/interpreter_worker.py) are started right after collection, for every
# file with a selected interpreter test, so that they run alongside the rest of the suite.
_WORKER_FIXTURES = {"interp_results", "interpreted"}


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    if config.option.collectonly:
        return
    try:
        from shoal.kernels.paged_attention import HAS_TRITON
    except Exception:  # noqa: BLE001 - the tests themselves report an unusable install
        return
    if not HAS_TRITON:
        return
    uses = [bool(_WORKER_FIXTURES & set(getattr(item, "fixturenames", ()))) for item in items]
    files = sorted({str(item.path) for item, u in zip(items, uses) if u})
    if files:
        # the tests that read a worker's results run last (in their order), so the rest of the
        # suite runs on one core while the workers run on the other instead of waiting on them
        items[:] = [it for it, u in zip(items, uses) if not u] + [it for it, u in zip(items, uses) if u]
        from interpreter_worker import prelaunch

        prelaunch(files)
        # the workers take every core but one: this process's intra-op threads keep to the rest
        # (oversubscribed OpenMP threads spin against the workers and slow both)
        import os

        import torch

        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1)))


def pytest_sessionfinish(session, exitstatus):
    import sys

    if "interpreter_worker" in sys.modules:
        sys.modules["interpreter_worker"].stop_all()
