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
import threading
import time
from collections.abc import Callable, Iterable

import pytest

MARKER = "@@RESULTS@@"


def report_cases(names: Iterable[str], run_case: Callable[[str], dict]) -> None:
    """Child side: run every case, print {name: {"checks": {k: [value, limit]}, "flags": {...}}}."""
    results = {}
    times = os.environ.get("SHOAL_INTERP_TIMES")  # a file to append "file case seconds" lines to
    for name in names:
        t0 = time.perf_counter()
        try:
            res = run_case(name)
            results[name] = {"checks": {k: [float(a), float(b)] for k, (a, b) in res["checks"].items()},
                             "flags": {k: bool(v) for k, v in res["flags"].items()}}
        except Exception as e:  # noqa: BLE001 - reported per case by the parent
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        if times:
            with open(times, "a") as f:
                f.write(f"{os.path.basename(sys.argv[0])} {name} {time.perf_counter() - t0:.1f}\n")
    print(MARKER + json.dumps(results))


_started: dict[str, tuple[subprocess.Popen, object, object]] = {}
_queue: list[str] = []  # prelaunched files not started yet, in order
_lock = threading.Lock()


def _die_with_parent() -> None:  # the child's preexec: killed when the pytest process dies (Linux)
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: workers just run to their end
        pass


def _spawn(path: str) -> tuple[subprocess.Popen, object, object]:
    import tempfile

    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # workers share the machine's cores with the main run
    out = tempfile.TemporaryFile(mode="w+")  # files, not pipes: a chatty worker never blocks
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, path], env=env, stdout=out, stderr=err, text=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    return proc, out, err


def _max_running() -> int:
    return max(1, (os.cpu_count() or 2) - 1)


def _pump() -> None:
    """Start queued workers while fewer than ``_max_running()`` are running."""
    with _lock:
        running = sum(1 for p, _, _ in _started.values() if p.poll() is None)
        while _queue and running < _max_running():
            path = _queue.pop(0)
            if path not in _started:
                _started[path] = _spawn(path)
                running += 1


_pumping = threading.Event()


def _pump_loop() -> None:
    # stays alive for the session: a child's PR_SET_PDEATHSIG fires when the *thread* that
    # spawned it exits, so the spawning thread must outlive its workers
    while True:
        _pump()
        time.sleep(0.5)


def prelaunch(test_files: Iterable[str]) -> None:
    """Run the workers of ``test_files`` in the background, at most ``cpu_count - 1`` at a time
    (the conftest calls this after collection and deselection, for every file with a selected
    interpreter test), so they run while the rest of the suite does; :func:`run_worker` then
    collects the result (starting the worker at once if its turn has not come)."""
    with _lock:
        for f in test_files:
            path = os.path.abspath(f)
            if path not in _started and path not in _queue:
                _queue.append(path)
    if not _pumping.is_set():
        _pumping.set()
        threading.Thread(target=_pump_loop, name="interpreter-workers", daemon=True).start()


def stop_all() -> None:
    """Kill workers whose results nobody collected (end of the session)."""
    with _lock:
        _queue.clear()
        while _started:
            proc, out, err = _started.popitem()[1]
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()


def run_worker(test_file: str, timeout: float = 1500) -> dict:
    """Parent side: the results of ``test_file`` run as a script with the interpreter on (its
    prelaunched worker's, or a worker started now)."""
    path = os.path.abspath(test_file)
    with _lock:
        if path in _queue:
            _queue.remove(path)
        proc, out, err = _started.pop(path, None) or _spawn(path)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
    out.close()
    err.close()
    _pump()  # this worker's slot is free
    marker = [ln for ln in stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not marker:
        pytest.fail(f"interpreter worker failed (rc={proc.returncode}):\n{stdout[-3000:]}\n{stderr[-5000:]}")
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
