"""Asynchronous face of the engine: one thread owns the device and loops ``Engine.step``.

    engine = AsyncEngine(Engine(...))
    async for event in engine.generate(request):   # FramesEvent / AudioEvent / FinishEvent
        ...

Submissions and cancellations cross into the engine thread through a queue; events cross
back through ``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue``, so the event
loop never waits on model work. Leaving the ``async for`` early (or cancelling the task)
aborts the request and frees its slot and KV blocks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from collections.abc import AsyncIterator

from .engine import Engine
from .request import EngineRequest, Event, FinishEvent


class EngineStopped(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._inbox.qsize()

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def submit(self, request: EngineRequest, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Queue:
        if self._error is not None or self._stop.is_set():
            raise EngineStopped(f"engine is not running: {self._error!r}")
        loop = loop or asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._sinks[request.request_id] = (loop, q)
        self._inbox.put(("add", request))
        self._wake.set()
        return q

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the engine thread between steps (e.g. CUDA graph capture, which
        must not overlap the engine's own device work); returns a concurrent Future."""
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, args, fut)))
        self._wake.set()
        return fut

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    async def generate(self, request: EngineRequest) -> AsyncIterator[Event]:
        q = self.submit(request)
        finished = False
        try:
            while True:
                event = await q.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, FinishEvent):
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            sink = self._sinks.get(request_id)
            if sink is not None and isinstance(item, (FinishEvent, BaseException)):
                self._sinks.pop(request_id, None)
        if sink is None:
            return
        loop, q = sink
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(payload)
                except Exception as e:  # bad request: answer it, keep serving others
                    self._deliver(payload.request_id, e)
            elif kind == "abort":
                self.engine.abort(payload)
            elif kind == "call":
                fn, args, fut = payload
                try:
                    fut.set_result(fn(*args))
                except Exception as e:  # reported to the caller
                    fut.set_exception(e)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain_inbox()
                if not self.engine.has_work():
                    self._wake.wait(0.1)
                    continue
                for event in self.engine.step():
                    self._deliver(event.request_id, event)
        except BaseException as e:  # the device failed: fail every waiter, stop
            self._error = e
            traceback.print_exc()
            with self._lock:
                sinks = list(self._sinks)
            for rid in sinks:
                self._deliver(rid, EngineStopped(f"engine failed: {e!r}"))
