"""The live-server harness shared by the HTTP tests: uvicorn on a free 127.0.0.1 port in a
background thread, a ``TTSService`` over the tiny S2 checkpoint on CPU, and the small helpers
the tests use around them (polling, engine idleness, test audio, error bodies)."""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import uvicorn

from shoal.server.service import TTSService

SR = 44100  # the tiny S2 checkpoint's output rate
ERROR_KEYS = {"status", "message"}


class LiveServer:
    """uvicorn serving ``app`` on a free loopback port; started (and, with ``ready``, answering
    ``/v1/ready`` with 200) within ``timeout`` seconds. A context manager that stops it on exit."""

    def __init__(self, app, *, ready: bool = True, timeout: float = 30.0) -> None:
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        if ready:
            self.wait_ready(deadline - time.monotonic())

    @property
    def state(self):
        return self.app.state.shoal

    @property
    def store(self):
        return self.app.state.voice_store

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/v1/ready", trust_env=False).status_code != 200:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server not ready")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def server_factory(build_app: Callable[..., Any]) -> Iterator[Callable[..., LiveServer]]:
    """``make(*args, **kw)`` starts a LiveServer over ``build_app(*args, **kw)``; all are stopped on exit."""
    started: list[LiveServer] = []

    def make(*args: Any, **kw: Any) -> LiveServer:
        srv = LiveServer(build_app(*args, **kw))
        started.append(srv)
        return srv

    try:
        yield make
    finally:
        for srv in started:
            srv.stop()


@contextmanager
def tiny_service(checkpoint: Path, max_running: int) -> Iterator[TTSService]:
    """A ``TTSService`` over ``checkpoint`` on CPU in fp32, closed on exit."""
    svc = TTSService.load(checkpoint, device="cpu", dtype="fp32", max_running=max_running)
    try:
        yield svc
    finally:
        svc.close()


def service_fixture(max_running: int):
    """A module-scoped ``service`` fixture: ``tiny_service`` over the ``tiny_s2_checkpoint`` fixture.
    Bind it in a test module as ``service = service_fixture(max_running=...)``."""

    @pytest.fixture(scope="module")
    def service(tiny_s2_checkpoint: Path) -> Iterator[TTSService]:
        with tiny_service(tiny_s2_checkpoint, max_running) as svc:
            yield svc

    return service


def wait_until(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Polls ``cond`` until it is truthy or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def engine_idle(service: TTSService) -> bool:
    eng = service.engine.engine
    return service.engine.num_running == 0 and not eng.requests and eng.pool.num_seqs == 0


def sine_wav(freq: float = 220.0, seconds: float = 1.0, rate: int = 22050) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def decode(fmt: str, data: bytes, pcm_rate: int = SR) -> tuple[np.ndarray, int]:
    """Decode with a real decoder: FFmpeg through PyAV (streamed WAV/FLAC declare an unknown
    length, which libsndfile's reader trips on), numpy for headerless pcm."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, pcm_rate
    import av

    demuxer = {"opus": "ogg", "aac": "aac"}.get(fmt, fmt)
    with av.open(io.BytesIO(data), format=demuxer) as box:
        frames = [f.to_ndarray().reshape(-1) for f in box.decode(audio=0)]
        rate = box.streams.audio[0].codec_context.sample_rate
    return (np.concatenate(frames) if frames else np.zeros(0, np.float32)), rate


def assert_error(resp: httpx.Response, status: int, contains: str = "") -> dict:
    """``resp`` is shoal's JSON error body ``{status, message}`` with ``status`` and ``contains``."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == ERROR_KEYS and body["status"] == status, body
    assert isinstance(body["message"], str) and contains.lower() in body["message"].lower(), body
    return body
