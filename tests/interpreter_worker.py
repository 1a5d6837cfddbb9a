"""Run Triton kernel cases under the interpreter in a child process.

Triton fixes its interpreter mode when it is first imported, so kernel tests on CPU run their
cases in a subprocess that imports triton with ``TRITON_INTERPRET=1`` (the rest of the suite
may already have imported it in compiled mode). The child prints one JSON line of results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable

import pytest

MARKER = "@@RESULTS@@"


def report_cases(names: Iterable[str], run_case: Callable[[str], dict]) -> None:
    """Child side: run every case, print {name: {"checks": {k: [value, limit]}, "flags": {...}}}."""
    results = {}
    for name in names:
        try:
            res = run_case(name)
            results[name] = {"checks": {k: [float(a), float(b)] for k, (a, b) in res["checks"].items()},
                             "flags": {k: bool(v) for k, v in res["flags"].items()}}
        except Exception as e:  # noqa: BLE001 - reported per case by the parent
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    print(MARKER + json.dumps(results))


def run_worker(test_file: str, timeout: float = 600) -> dict:
    """Parent side: run ``test_file`` as a script with the interpreter on; its results."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run([sys.executable, os.path.abspath(test_file)], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    marker = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not marker:
        pytest.fail(f"interpreter worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(marker[-1][len(MARKER):])


def assert_case(res: dict, need_any: bool = False) -> None:
    """Parent side: one case's result passes (no error, every check within its limit, every
    flag true; ``need_any``: at least one check or flag)."""
    assert "error" not in res, res.get("error")
    if need_any:
        assert res["checks"] or res["flags"]
    for k, (value, limit) in res["checks"].items():
        assert value <= limit, (k, value, limit, res)
    for k, ok in res["flags"].items():
        assert ok, (k, res)
