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


def skip_nested_lang_patches() -> bool:
    """Make Triton's interpreter patch ``triton.language`` once per launch, not once per call.

    A launch (``GridExecutor.__call__``) patches the language modules for the interpreter and
    restores them at its end; every call of a nested ``@triton.jit`` function inside it -- a
    helper, or a ``tl.reduce`` combine function, called once per pair of elements -- patches
    them again: a scan of every member of ``tl`` (about 1 ms) that finds nothing left to patch.
    The sampler's top-8 merges made that 80% of their interpreted time. Nested calls whose
    language modules the launch has patched now skip it; a nested function that sees another
    language module is patched as before, and so is every launch. Interpreter internals: when a
    Triton version lacks them, nothing is changed (returns False)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except Exception:  # noqa: BLE001 - no Triton: nothing to speed up
        return False
    real = getattr(ti, "_patch_lang", None)
    if real is None or getattr(real, "_shoal_once_per_launch", False):
        return real is not None
    import inspect

    launch: list[frozenset] = []  # the language modules the launch in progress patched

    seen: dict[object, frozenset] = {}

    def langs(fn) -> frozenset:
        got = seen.get(fn)
        if got is None:
            got = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                       if inspect.ismodule(v) and v in (tl, tl.core))
        return got

    class _LaunchScope:
        def __init__(self, scope):
            self.scope = scope

        def restore(self) -> None:
            launch.clear()
            self.scope.restore()

    class _NoScope:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        if not launch:  # a launch: patch, and remember what for its nested calls
            scope = real(fn)
            launch.append(langs(fn))
            return _LaunchScope(scope)
        if langs(fn) <= launch[0]:
            return _NoScope()
        return real(fn)

    patch_lang._shoal_once_per_launch = True
    ti._patch_lang = patch_lang
    return True


def report_cases(names: Iterable[str], run_case: Callable[[str], dict]) -> None:
    """Child side: run every case, print {name: {"checks": {k: [value, limit]}, "flags": {...}}}."""
    skip_nested_lang_patches()
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


_waiting = 0  # run_worker calls blocked on a worker: the parent's core is free meanwhile
_collecting: list[subprocess.Popen] = []  # the workers those calls wait on (still running)


def _max_running() -> int:
    """One worker per core the parent leaves free: every core but one while the parent runs
    tests, one more for each core the parent spends waiting on a worker's results."""
    cores = os.cpu_count() or 2
    return max(1, min(cores, cores - 1 + _waiting))


def _pump() -> None:
    """Start queued workers while fewer than ``_max_running()`` are running."""
    with _lock:
        running = sum(1 for p, _, _ in _started.values() if p.poll() is None)
        running += sum(1 for p in _collecting if p.poll() is None)
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
    global _waiting
    path = os.path.abspath(test_file)
    with _lock:
        if path in _queue:
            _queue.remove(path)
        proc, out, err = _started.pop(path, None) or _spawn(path)
        _waiting += 1
        _collecting.append(proc)
    try:
        _pump()  # while this process waits, its core runs the next queued worker
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finally:
        with _lock:
            _waiting -= 1
            _collecting.remove(proc)
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
