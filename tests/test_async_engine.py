"""The asyncio face of the engine: concurrent streams, cancellation, errors."""

import asyncio

import numpy as np
import pytest
import torch

from shoal.checkpoint import load_dualar
from shoal.engine.async_engine import AsyncEngine
from shoal.engine.engine import Engine, EngineConfig
from shoal.engine.generate import generate
from shoal.engine.request import EngineRequest, FinishEvent, FramesEvent
from shoal.engine.sampling import SamplingParams
from shoal.text import build_session


@pytest.fixture(scope="module")
def engine(tiny_s2_checkpoint):
    model, tok = load_dualar(tiny_s2_checkpoint, dtype=torch.float32)
    eng = AsyncEngine(Engine(model, tok.im_end_id, config=EngineConfig(max_running=4, num_blocks=64)))
    yield eng, model, tok
    eng.shutdown()


def test_concurrent_streams_match_solo(engine):
    eng, model, tok = engine
    texts = [f"Request number {i} says hello." for i in range(6)]
    params = SamplingParams(temperature=0.8, top_p=0.8, top_k=30)

    async def one(i):
        req = EngineRequest(session=build_session("s2", tok, texts[i], [], None), params=params,
                            seed=i, max_new_tokens=8)
        frames, final = [], None
        async for ev in eng.generate(req):
            if isinstance(ev, FramesEvent):
                frames.append(ev.codes)
            elif isinstance(ev, FinishEvent):
                final = ev
        return np.concatenate(frames, axis=1), final

    async def main():
        return await asyncio.gather(*(one(i) for i in range(6)))

    results = asyncio.run(main())
    for i, (streamed, final) in enumerate(results):
        want = generate(model, build_session("s2", tok, texts[i], [], None).grid(), params,
                        tok.im_end_id, 8, seed=i).codes
        assert np.array_equal(streamed, want) and np.array_equal(final.codes, want)


def test_leaving_the_stream_cancels_and_frees(engine):
    eng, model, tok = engine

    async def main():
        req = EngineRequest(session=build_session("s2", tok, "A long one.", [], None),
                            params=SamplingParams(greedy=True), max_new_tokens=500)
        n = 0
        async for ev in eng.generate(req):
            n += 1
            if n == 3:
                break
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not eng.engine.requests:
                break

    asyncio.run(main())
    assert not eng.engine.requests and eng.engine.pool.num_seqs == 0


def test_bad_request_raises_and_engine_keeps_serving(engine):
    eng, model, tok = engine

    async def main():
        bad = EngineRequest(session=build_session("s2", tok, "x " * 5000, [], None), max_new_tokens=4)
        with pytest.raises(ValueError, match="context"):
            async for _ in eng.generate(bad):
                pass
        good = EngineRequest(session=build_session("s2", tok, "fine", [], None),
                             params=SamplingParams(greedy=True), max_new_tokens=2)
        return [ev async for ev in eng.generate(good)]

    events = asyncio.run(main())
    assert isinstance(events[-1], FinishEvent) and events[-1].codes.shape == (10, 2)


def test_call_runs_on_the_engine_thread(engine):
    import threading

    eng, model, tok = engine
    fut = eng.call(lambda x: (threading.current_thread().name, x * 2), 21)
    assert fut.result(timeout=10) == ("shoal-engine", 42)
    bad = eng.call(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result(timeout=10)
