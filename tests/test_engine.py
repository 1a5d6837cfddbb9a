"""The continuous-batching engine against the batch-1 reference loop (CPU, tiny checkpoints)."""

import numpy as np
import pytest
import torch

from shoal.checkpoint import load_dualar
from shoal.codec import load_codec
from shoal.engine.engine import Engine, EngineConfig
from shoal.engine.generate import generate
from shoal.engine.request import AudioEvent, EngineRequest, FinishEvent, FramesEvent, Priority
from shoal.engine.sampling import SamplingParams
from shoal.engine.audio import ChunkSchedule
from shoal.text import Reference, build_session

TEXTS = ["Hello world, this is a test.", "How are you doing today my friend?",
         "Speech synthesis is fun.", "The quick brown fox jumps over the lazy dog."]
GREEDY = SamplingParams(greedy=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.8, top_k=30)


@pytest.fixture(scope="module")
def s2(tiny_s2_checkpoint):
    model, tok = load_dualar(tiny_s2_checkpoint, dtype=torch.float32)
    return model, tok, tiny_s2_checkpoint


@pytest.fixture(scope="module")
def voice():
    return np.random.default_rng(3).integers(0, 1024, size=(10, 40))


def session(tok, i, voice, family="s2"):
    refs = [Reference("A voice reference transcript.", voice)] if i % 2 else []
    return build_session(family, tok, TEXTS[i % len(TEXTS)], refs, None)


def solo(model, tok, i, voice, params, seed, n, family="s2"):
    s = session(tok, i, voice, family)
    return generate(model, s.grid(), params, tok.im_end_id, n, seed=seed).codes


def run(engine):
    events = engine.run_until_done()
    return {e.request_id: e for e in events if isinstance(e, FinishEvent)}, events


@pytest.mark.parametrize("prefill_chunk", [1024, 7])
def test_engine_equals_reference_loop_in_a_batch_mix(s2, voice, prefill_chunk):
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=4, num_blocks=96,
                                                           prefill_chunk=prefill_chunk))
    want = {}
    for i in range(7):
        params = GREEDY if i % 3 else SAMPLED
        n = 6 + i
        want[f"r{i}"] = solo(model, tok, i, voice, params, 100 + i, n)
        eng.add_request(EngineRequest(session=session(tok, i, voice), params=params, seed=100 + i,
                                      max_new_tokens=n, request_id=f"r{i}"))
    done, _ = run(eng)
    assert set(done) == set(want)
    for rid, codes in want.items():
        assert np.array_equal(done[rid].codes, codes), rid
    assert eng.pool.num_used == 0 and eng.pool.num_seqs == 0
    eng.pool.check_invariants()


def test_seeded_request_same_alone_and_among_eight(s2, voice):
    model, tok, _ = s2
    alone = Engine(model, tok.im_end_id, config=EngineConfig(max_running=1, num_blocks=64))
    alone.add_request(EngineRequest(session=session(tok, 1, voice), params=SAMPLED, seed=42,
                                    max_new_tokens=12, request_id="x"))
    a, _ = run(alone)
    crowd = Engine(model, tok.im_end_id, config=EngineConfig(max_running=9, num_blocks=128))
    for j in range(8):
        crowd.add_request(EngineRequest(session=session(tok, j, voice), params=SAMPLED, seed=j,
                                        max_new_tokens=5 + j, request_id=f"o{j}"))
    crowd.add_request(EngineRequest(session=session(tok, 1, voice), params=SAMPLED, seed=42,
                                    max_new_tokens=12, request_id="x"))
    c, _ = run(crowd)
    assert np.array_equal(a["x"].codes, c["x"].codes)


def test_prefix_cache_hits_for_a_shared_voice(s2, voice):
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=64))
    eng.add_request(EngineRequest(session=session(tok, 1, voice), params=GREEDY, max_new_tokens=3,
                                  request_id="first"))
    run(eng)
    before = eng.pool.hit_tokens
    eng.add_request(EngineRequest(session=session(tok, 3, voice), params=GREEDY, max_new_tokens=3,
                                  request_id="second"))
    done, _ = run(eng)
    assert eng.pool.hit_tokens - before >= 32  # the reference prompt's full blocks were reused
    assert np.array_equal(done["second"].codes, solo(model, tok, 3, voice, GREEDY, 0, 3))


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n]).all(axis=0)
    return n if same.all() else int(np.argmin(same))


@pytest.mark.parametrize("block_size,prefill_chunk,partial", [(16, 1024, True), (64, 1024, True),
                                                              (64, 5, True), (64, 1024, False)])
def test_prefix_hits_to_the_token_copy_the_partial_page(s2, voice, block_size, prefill_chunk, partial):
    """A second request sharing a voice prompt that ends mid-page: with partial copies every
    shared column is a hit (the page's K/V copied), without only whole pages; the codes (greedy
    and seeded sampled, chunked prefill starting mid-page) equal the reference loop's either way."""
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(
        max_running=3, num_blocks=64, block_size=block_size, prefill_chunk=prefill_chunk,
        prefix_copy_partial=partial))
    g1, g3 = session(tok, 1, voice).grid(), session(tok, 3, voice).grid()
    shared = _common_prefix(g1, g3)
    # copies come from registered (full) pages: the first request generates past the end of
    # the page the shared part ends in (its columns there are its own, not the second's)
    fill = -(-shared // block_size) * block_size - g1.shape[1] + 2
    eng.add_request(EngineRequest(session=session(tok, 1, voice), params=GREEDY, ignore_eos=True,
                                  max_new_tokens=max(3, fill), request_id="first"))
    run(eng)
    assert shared % block_size and shared < g3.shape[1] - 1  # the shared part ends mid-page
    before, copied = eng.pool.hit_tokens, eng.pool.copied_tokens
    for rid, params, seed in (("greedy", GREEDY, 0), ("sampled", SAMPLED, 7)):
        eng.add_request(EngineRequest(session=session(tok, 3, voice), params=params, seed=seed,
                                      max_new_tokens=4, request_id=rid))
    done, _ = run(eng)
    per_request = shared if partial else shared - shared % block_size
    # the second of the two also hits the first's pages (and its own copy's successors)
    assert eng.pool.hit_tokens - before >= 2 * per_request
    assert (eng.pool.copied_tokens > copied) == partial
    assert np.array_equal(done["greedy"].codes, solo(model, tok, 3, voice, GREEDY, 0, 4))
    assert np.array_equal(done["sampled"].codes, solo(model, tok, 3, voice, SAMPLED, 7, 4))
    assert eng.pool.num_used == 0
    eng.pool.check_invariants()


def test_a_burst_cloning_one_voice_prefills_the_voice_once(s2, voice):
    """Six requests with one voice submitted together: with prefix-aware admission the first
    computes the voice's pages and the others are admitted once they are cached (a step later),
    so they prefill only their own text; the codes equal the reference loop either way."""
    model, tok, _ = s2
    prefilled, codes = {}, {}
    for wait in (False, True):
        eng = Engine(model, tok.im_end_id, config=EngineConfig(
            max_running=8, num_blocks=128, prefill_chunk=64, prefix_wait=wait))
        for j in range(6):
            eng.add_request(EngineRequest(session=session(tok, 1 + 2 * (j % 2), voice), params=GREEDY,
                                          max_new_tokens=3, request_id=f"v{j}"))
        done, _ = run(eng)
        prefilled[wait] = eng.stats["prefill_tokens"]
        codes[wait] = {rid: e.codes for rid, e in done.items()}
        assert (eng.scheduler.deferred_admissions > 0) == wait
        sch = eng.scheduler
        assert not sch._inflight and not sch._producing and not sch._waited and not sch._hashes
        eng.pool.check_invariants()
    g = session(tok, 1, voice).grid()
    assert prefilled[True] < prefilled[False] - 3 * (g.shape[1] // 2)  # the voice once, not six times
    for j in range(2):
        want = solo(model, tok, 1 + 2 * j, voice, GREEDY, 0, 3)
        for rid in (f"v{j}", f"v{j + 2}", f"v{j + 4}"):
            assert np.array_equal(codes[True][rid], want) and np.array_equal(codes[False][rid], want), rid


def test_waiters_are_admitted_when_the_producer_is_cancelled(s2, voice):
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=4, num_blocks=128, prefill_chunk=16))
    reqs = [EngineRequest(session=session(tok, 1, voice), params=GREEDY, max_new_tokens=3, request_id=f"c{j}")
            for j in range(3)]
    for r in reqs:
        eng.add_request(r)
    eng.step()  # c0 admitted and prefilling its first 16 columns; c1, c2 wait for its pages
    assert eng.scheduler.deferred_admissions >= 2 and reqs[0].status.name == "PREFILL"
    assert reqs[1].status.name == reqs[2].status.name == "WAITING"
    eng.abort("c0")
    events = eng.step()  # the producer is gone: c1 is admitted at once and computes the rest of the
    #             voice (c0's committed pages are cached); c2 now waits for c1's pages
    sch = eng.scheduler
    assert reqs[1].status.name == "PREFILL" and reqs[2].status.name == "WAITING"
    assert reqs[0] not in sch._producing and reqs[1] in sch._producing
    assert set(sch._inflight) == set(sch._producing[reqs[1]])
    assert [e.reason for e in events if isinstance(e, FinishEvent)] == ["cancelled"]
    done, _ = run(eng)
    want = solo(model, tok, 1, voice, GREEDY, 0, 3)
    assert np.array_equal(done["c1"].codes, want) and np.array_equal(done["c2"].codes, want)
    assert eng.pool.num_used == 0


def test_a_request_waiting_for_pages_keeps_its_turn(s2, voice):
    """Two slots; P and W share a voice, X (same priority) arrives after W: W waits for P's
    pages holding the free slot, so X cannot take it; W is admitted the next step."""
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=128))
    P, W, X = (EngineRequest(session=session(tok, i, voice), params=GREEDY, max_new_tokens=3, request_id=rid)
               for rid, i in (("P", 1), ("W", 3), ("X", 0)))
    for r in (P, W, X):
        eng.add_request(r)
    eng.step()  # P prefills the voice; W waits for it and keeps the second slot
    assert P.status.name != "WAITING" and W.status.name == "WAITING" and X.status.name == "WAITING"
    eng.step()  # P's pages are cached: W is admitted, X still waits for a slot
    sch = eng.scheduler
    assert W.status.name != "WAITING" and X.status.name == "WAITING"
    assert P not in sch._producing  # done prefilling: its pages are cached, not in flight
    done, _ = run(eng)
    for rid, i in (("P", 1), ("W", 3), ("X", 0)):
        assert np.array_equal(done[rid].codes, solo(model, tok, i, voice, GREEDY, 0, 3)), rid


def test_preemption_under_memory_pressure_keeps_outputs_exact(s2, voice):
    model, tok, _ = s2
    # 12 blocks of 16 tokens cannot hold 4 growing sequences: requests get preempted and resumed
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=4, num_blocks=12,
                                                           prefill_chunk=32, enable_prefix_cache=False))
    want = {}
    for i in range(4):
        params = GREEDY if i % 2 else SAMPLED
        want[f"p{i}"] = solo(model, tok, 2 * (i % 2), voice, params, 7 + i, 40)
        eng.add_request(EngineRequest(session=session(tok, 2 * (i % 2), voice), params=params,
                                      seed=7 + i, max_new_tokens=40, request_id=f"p{i}"))
    done, _ = run(eng)
    assert eng.stats["preemptions"] > 0
    for rid, codes in want.items():
        assert np.array_equal(done[rid].codes, codes), rid
    eng.pool.check_invariants()


def test_cancel_frees_all_blocks(s2, voice):
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=64))
    for i in range(3):
        eng.add_request(EngineRequest(session=session(tok, i, voice), params=GREEDY,
                                      max_new_tokens=50, request_id=f"c{i}"))
    for _ in range(3):
        eng.step()
    assert eng.pool.num_used > 0
    for i in range(3):
        eng.abort(f"c{i}")
    done, _ = run(eng)
    assert {e.reason for e in done.values()} == {"cancelled"}
    assert eng.pool.num_seqs == 0 and eng.pool.num_used == 0 and not eng.requests
    assert sorted(eng.scheduler.free_slots) == [0, 1]
    eng.pool.check_invariants()


def test_realtime_priority_is_admitted_first_and_preempts_batch(s2, voice):
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=64))
    for i in range(2):
        eng.add_request(EngineRequest(session=session(tok, i, voice), params=GREEDY, max_new_tokens=30,
                                      priority=Priority.BATCH, request_id=f"b{i}"))
    eng.step()
    eng.add_request(EngineRequest(session=session(tok, 2, voice), params=GREEDY, max_new_tokens=3,
                                  priority=Priority.REALTIME, request_id="rt"))
    order = []
    while eng.has_work():
        order += [e.request_id for e in eng.step() if isinstance(e, FinishEvent)]
    assert order[0] == "rt"
    assert eng.stats["preemptions"] >= 1


def test_multibatch_dialogue_through_the_engine(s2, voice):
    model, tok, ckpt = s2
    text = "<|speaker:0|>Hi there, how are you? <|speaker:1|>Fine, thanks. And you?"
    ref = build_session("s2", tok, text, [], 10)
    want = []
    while not ref.done():
        codes = generate(model, ref.grid(), GREEDY, tok.im_end_id, 4).codes
        want.append(codes)
        ref.commit(codes)
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=64))
    eng.add_request(EngineRequest(session=build_session("s2", tok, text, [], 10), params=GREEDY,
                                  max_new_tokens=4, request_id="d"))
    done, events = run(eng)
    assert np.array_equal(done["d"].codes, np.concatenate(want, axis=1))
    assert {e.batch_index for e in events if isinstance(e, FramesEvent)} == {0, 1}
    assert eng.pool.hit_tokens > 0  # batch 1's prompt extends batch 0's sequence


@pytest.mark.parametrize("audio_thread,max_call,fill,hold", [
    (False, 32, False, 0.0), (True, 32, False, 0.0), (False, 1, False, 0.0), (True, None, False, 0.0),
    (False, 32, True, 0.0), (True, 2, True, 0.0),
    (True, 32, True, 0.05)])  # the threaded worker wakes for held calls (every later chunk waits)
def test_streaming_audio_equals_one_shot_decode(s2, voice, audio_thread, max_call, fill, hold):
    model, tok, ckpt = s2
    codec = load_codec(ckpt / "codec.pth")
    eng = Engine(model, tok.im_end_id, codec=codec,
                 config=EngineConfig(max_running=3, num_blocks=64, audio_thread=audio_thread,
                                     audio_schedule=ChunkSchedule(first=2, growth=2.0, max_frames=8),
                                     audio_max_call_streams=max_call, audio_fill_calls=fill,
                                     audio_hold_s=hold, audio_hold_streams=3))
    assert eng.audio.streamer.hold_s == hold
    for i in range(3):
        eng.add_request(EngineRequest(session=session(tok, i, voice), params=SAMPLED, seed=i,
                                      max_new_tokens=13 + i, stream_audio=True, request_id=f"a{i}"))
    done, events = run(eng)
    for i in range(3):
        rid = f"a{i}"
        chunks = [e.pcm for e in events if isinstance(e, AudioEvent) and e.request_id == rid]
        assert len(chunks) >= 2 and len(chunks[0]) == 2 * 2048  # small first chunk
        # the summary comes after the request's last audio chunk
        last_audio = max(j for j, e in enumerate(events) if isinstance(e, AudioEvent) and e.request_id == rid)
        finish = next(j for j, e in enumerate(events) if isinstance(e, FinishEvent) and e.request_id == rid)
        assert finish > last_audio
        streamed = np.concatenate(chunks)
        with torch.inference_mode():
            ref = codec.decode(torch.as_tensor(done[rid].codes)[None])[0, 0].numpy()
        assert streamed.shape == ref.shape
        assert np.abs(streamed - ref).max() < 1e-4
        assert done[rid].timings["first_audio_s"] <= done[rid].timings["total_s"]


def test_audio_pool_position_bound_follows_live_streams_not_traffic(s2):
    """A row reused by stream after stream: the pool's position bound (which sizes an eager
    call's RoPE table) is the longest live stream's frame count, not the sum of everything
    the row has decoded (which grew without end on a long-running server), and the audio of
    a late stream equals the same codes decoded alone."""
    from shoal.codec.streaming import StreamingDecoder
    from shoal.engine.audio import AudioStreamer

    _, _, ckpt = s2
    codec = load_codec(ckpt / "codec.pth")
    st = AudioStreamer(codec, 1, ChunkSchedule(first=4, growth=2.0, max_frames=8), max_call_streams=1)
    key = codec.quantizer.post_module.state_key
    rng = np.random.default_rng(3)
    for i in range(4):
        codes = rng.integers(0, 1000, (10, 12)).astype(np.int64)
        st.push(f"s{i}", codes)
        st.finish(f"s{i}")
        pcm = []
        while f"s{i}" not in st.take_done():
            audio, failed = st.decode_ready()
            assert not failed
            pcm += [p for _, p in audio]
        assert st.state.bounds[key] <= 12  # was 12 * (i + 1): the row's whole history
        assert list(st.rows) == []
    assert st.row_frames == {}
    dec = StreamingDecoder(codec)
    alone = dec.decode_chunk(torch.as_tensor(codes)[None], dec.new_state(1))[0, 0].float().numpy()
    np.testing.assert_allclose(np.concatenate(pcm), alone, atol=1e-5)
    st.push("a", rng.integers(0, 1000, (10, 4)).astype(np.int64))
    st.decode_ready()
    assert st.state.bounds[key] == 4 and st.row_frames == {0: 4}


def test_audio_calls_are_earliest_deadline_first_and_bounded(s2):
    """First chunks (no audio yet: overdue) go before a playing stream's next chunk, oldest
    first; a call takes at most max_call_streams streams of one chunk size; a stream's deadline
    is when its delivered audio finishes playing."""
    from shoal.engine.audio import AudioStreamer

    _, _, ckpt = s2
    now = [0.0]
    st = AudioStreamer(load_codec(ckpt / "codec.pth"), 6, ChunkSchedule(first=2, growth=2.0, max_frames=8),
                       max_call_streams=2, clock=lambda: now[0])
    calls = []
    real = st._decode

    def spy(rids, n, lane=None):
        calls.append((n, list(rids)))
        return real(rids, n, lane)

    st._decode = spy
    frames = np.zeros((10, 1), np.int64)
    st.push("old", np.repeat(frames, 2, 1))
    assert [r for r, _ in st.decode_ready()[0]] == ["old"]
    chunk_s = 2 * 2048 / st.sample_rate
    assert st.play_end["old"] == pytest.approx(chunk_s)  # delivered at t=0, plays 2 frames
    st.push("old", np.repeat(frames, 4, 1))  # its next chunk (4 frames) is complete
    for i, rid in enumerate(["n3", "n1", "n2"]):  # first chunks, arriving in this order
        now[0] = 0.01 * (i + 1)
        st.push(rid, np.repeat(frames, 2, 1))
    assert st.next_call() == (2, ["n3", "n1"])
    calls.clear()
    audio, failed = st.decode_ready(max_calls=1)
    assert not failed and [r for r, _ in audio] == ["n3", "n1"] and calls == [(2, ["n3", "n1"])]
    audio, _ = st.decode_ready()
    assert calls[1:] == [(2, ["n2"]), (4, ["old"])]  # n2 is overdue; old still has audio playing
    assert [len(p) for _, p in audio] == [2 * 2048, 4 * 2048]
    # old's audio ran out before this delivery: playback restarts at delivery
    now[0] = 1.0
    st.push("old", np.repeat(frames, 8, 1))
    st.decode_ready()
    assert st.play_end["old"] == pytest.approx(1.0 + 8 * 2048 / st.sample_rate)
    st.finish("old")
    assert st.take_done() == ["old"]  # nothing left to decode: done at once, row freed
    assert "old" not in st.play_end and "old" not in st.since and "old" not in st.rows
    # finished streams' last, shorter chunks are batched like any other chunk size
    calls.clear()
    for rid in ("p", "q"):
        st.push(rid, np.repeat(frames, 2, 1))
    st.decode_ready()
    for rid in ("p", "q"):
        st.push(rid, np.repeat(frames, 3, 1))  # 3 of a 4-frame chunk, then the request ends
        st.finish(rid)
    assert st.take_done() == []  # audio still to decode
    audio, _ = st.decode_ready()
    assert calls[-1] == (3, ["p", "q"]) and [len(p) for _, p in audio] == [3 * 2048] * 2
    assert st.take_done() == ["p", "q"] and len(st.free_rows) == 3  # n1, n2, n3 still hold theirs
    with pytest.raises(ValueError, match="max_call_streams"):
        AudioStreamer(load_codec(ckpt / "codec.pth"), 2, max_call_streams=0)
    from shoal.engine.audio import AudioWorker

    AudioWorker(st).warmup()  # delegates to the streamer (a no-op for the eager CPU decoder)


def test_audio_fill_calls_take_playing_streams_with_enough_frames(s2):
    """With fill_calls, a call's spare rows take streams that already play audio and hold at
    least the call's chunk size of frames (most urgent first), though their own next chunk is
    not complete; a stream with no audio yet still waits for its whole first chunk."""
    from shoal.engine.audio import AudioStreamer

    _, _, ckpt = s2
    now = [0.0]
    frames = np.zeros((10, 1), np.int64)

    def streamer(fill):
        st = AudioStreamer(load_codec(ckpt / "codec.pth"), 6, ChunkSchedule(first=2, growth=2.0, max_frames=8),
                           max_call_streams=3, clock=lambda: now[0], fill_calls=fill)
        for rid in ("a", "b", "c"):  # all three play their first 2-frame chunk
            st.push(rid, np.repeat(frames, 2, 1))
        st.decode_ready()
        now[0] = 0.01
        st.push("a", np.repeat(frames, 4, 1))  # a's next chunk (4 frames) is complete
        st.push("b", np.repeat(frames, 3, 1))  # b holds 3 of its 4: enough to ride a 2-frame call
        st.push("c", np.repeat(frames, 1, 1))  # c holds 1: too few
        st.push("n", np.repeat(frames, 1, 1))  # a new stream, 1 of its 2-frame first chunk
        st.push("m", np.repeat(frames, 2, 1))  # a new stream whose first chunk is complete
        return st

    assert streamer(False).next_call() == (2, ["m"])
    st = streamer(True)
    assert st.next_call() == (2, ["m", "a", "b"])  # a and b ride along (equal deadlines: row order)
    audio, _ = st.decode_ready(max_calls=1)
    assert [(r, len(p)) for r, p in audio] == [("m", 2 * 2048), ("a", 2 * 2048), ("b", 2 * 2048)]
    assert sum(f.shape[1] for f in st.pending["a"]) == 2 and sum(f.shape[1] for f in st.pending["b"]) == 1
    assert st.chunks["b"] == 2  # the shorter chunk counts as one of b's chunks


def test_audio_hold_waits_for_fuller_calls_while_streams_have_audio(s2):
    """With hold_s / hold_streams, a call of later chunks waits while it would decode fewer
    than hold_streams streams and each of them has at least hold_s of audio left to play; it
    launches once enough streams are ready or the most urgent one's audio runs low. First
    chunks and finished requests' last chunks never wait; the synchronous decode ignores it."""
    from shoal.engine.audio import AudioStreamer

    _, _, ckpt = s2
    now = [0.0]
    frames = np.zeros((10, 1), np.int64)
    st = AudioStreamer(load_codec(ckpt / "codec.pth"), 6, ChunkSchedule(first=2, growth=2.0, max_frames=8),
                       max_call_streams=4, clock=lambda: now[0], hold_s=0.05, hold_streams=3)
    for rid in ("a", "b", "c"):
        st.push(rid, np.repeat(frames, 2, 1))
    assert st.next_call() == (2, ["a", "b", "c"])  # first chunks: never held
    st.decode_ready()
    chunk_s = 2 * 2048 / st.sample_rate  # each now plays until chunk_s (~0.09 s)
    st.push("a", np.repeat(frames, 4, 1))
    assert st.next_call() is None  # one stream ready, all with > 0.05 s of audio left
    assert st.held_until == pytest.approx(chunk_s - 0.05)  # when it falls due
    assert st.next_call(hold=False) == (4, ["a"])
    st.push("b", np.repeat(frames, 4, 1))
    assert st.next_call() is None
    st.push("c", np.repeat(frames, 4, 1))
    assert st.next_call() == (4, ["a", "b", "c"]) and st.held_until is None  # full enough
    # the most urgent stream's audio runs low: launched with what is ready
    st2 = AudioStreamer(load_codec(ckpt / "codec.pth"), 6, ChunkSchedule(first=2, growth=2.0, max_frames=8),
                        max_call_streams=4, clock=lambda: now[0], hold_s=0.05, hold_streams=3)
    now[0] = 0.0
    for rid in ("a", "b"):
        st2.push(rid, np.repeat(frames, 2, 1))
    st2.decode_ready()
    st2.push("a", np.repeat(frames, 4, 1))
    assert st2.next_call() is None
    now[0] = chunk_s - 0.05 + 1e-6
    assert st2.next_call() == (4, ["a"])
    # a finishing stream's last chunk is never held; neither is the synchronous decode
    now[0] = 0.0
    st2.push("b", np.repeat(frames, 3, 1))
    st2.finish("b")
    assert st2.next_call() == (3, ["b"])  # a's group is held; b's last chunk goes ahead
    audio, _ = st2.decode_ready()
    assert sorted(r for r, _ in audio) == ["a", "b"]
    with pytest.raises(ValueError, match="hold"):
        AudioStreamer(load_codec(ckpt / "codec.pth"), 2, hold_s=-1.0)


def test_failed_stream_takes_no_frames_until_released(s2):
    """After a codec call fails for a stream, frames the engine pushed before it saw the error
    do not restart the stream on a new row (no audio after the error summary)."""
    from shoal.engine.audio import AudioStreamer

    _, _, ckpt = s2
    st = AudioStreamer(load_codec(ckpt / "codec.pth"), 2, ChunkSchedule(first=2, growth=1.0, max_frames=2))
    real = st._decode

    def boom(rids, n, lane=None):
        raise RuntimeError("CUDA out of memory (simulated)")

    st._decode = boom
    st.push("x", np.zeros((10, 2), np.int64))
    audio, failed = st.decode_ready()
    assert not audio and [r for r, _ in failed] == ["x"]
    st._decode = real
    st.push("x", np.zeros((10, 2), np.int64))  # in flight when the codec failed
    assert "x" not in st.rows and st.decode_ready() == ([], [])
    assert len(st.free_rows) == 2
    st.release("x")  # the engine failed the request; the id may be used afresh
    st.push("x", np.zeros((10, 2), np.int64))
    assert [r for r, _ in st.decode_ready()[0]] == ["x"]


@pytest.mark.parametrize("first_lane", [False, True])
def test_threaded_audio_worker_makes_one_call_per_lane_at_a_time(s2, first_lane):
    """The worker thread launches at most one codec call per lane, then reads its inbox again
    (so a first chunk that arrives meanwhile is next), rather than every ready chunk at once;
    with a first lane, first chunks and later chunks go to their own lanes."""
    import time

    from shoal.engine.audio import AudioStreamer, AudioWorker

    _, _, ckpt = s2
    st = AudioStreamer(load_codec(ckpt / "codec.pth"), 4, ChunkSchedule(first=2, growth=1.0, max_frames=2),
                       max_call_streams=1, first_lane=first_lane)
    assert len(st.lanes) == (2 if first_lane else 1)
    launched = []
    real = st._decode

    def spy(rids, n, lane=None):
        launched.append((lane.name, st.chunks[rids[0]], list(rids)))
        return real(rids, n, lane)

    st._decode = spy
    worker = AudioWorker(st, threaded=True)
    for rid in ("a", "b", "c"):
        worker.push(rid, np.zeros((10, 6), np.int64))  # three 2-frame chunks each
    got, deadline = [], time.monotonic() + 60
    while len(got) < 9 and time.monotonic() < deadline:
        got += [item for item in worker.poll(timeout=0.5) if item[0] == "audio"]
    assert sorted(item[1] for item in got) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert len(launched) == 9 and all(len(rids) == 1 for _, _, rids in launched)
    if first_lane:  # a starting stream's first two chunks on the first lane, the rest on the bulk lane
        assert {(name, chunk) for name, chunk, _ in launched} == {("first", 0), ("first", 1), ("bulk", 2)}
    else:
        assert {name for name, _, _ in launched} == {"bulk"}


def test_stale_call_of_a_released_id_leaves_its_successor_alone(s2):
    """A call still running for a released stream id neither delivers audio to a new stream of
    the same id nor counts down that stream's calls in flight (its row stays held until its own
    call is delivered)."""
    from shoal.engine.audio import AudioStreamer

    _, _, ckpt = s2
    st = AudioStreamer(load_codec(ckpt / "codec.pth"), 3, ChunkSchedule(first=2, growth=1.0, max_frames=2),
                       first_lane=True)
    frames = np.zeros((10, 2), np.int64)
    for _ in range(3):  # chunks 0 and 1 (first lane) delivered; chunk 2 goes to the bulk lane
        st.push("x", frames)
    st.decode_ready(max_calls=2)
    assert st.launch(st.bulk) and st.bulk.inflight is not None  # chunk 2 launched, not collected
    stale, st.bulk.inflight = st.bulk.inflight, None
    st.release("x")  # cancelled while its call runs
    st.push("x", frames)  # the id starts afresh on a new row
    assert st.launch(st.first)
    st.finish("x")
    assert st._complete(stale) == []  # nothing for the new stream
    assert st._inflight["x"] == 1 and st.take_done() == []  # its own call is still out
    audio, _ = st.collect()
    assert [r for r, _ in audio] == ["x"] and st.take_done() == ["x"]


def test_worker_round_keeps_audio_collected_with_a_failure(s2):
    """When one lane's launch fails in a worker round, audio another lane finished in that round
    is still delivered (the failure report collects it too)."""
    from shoal.engine.audio import AudioStreamer, AudioWorker

    _, _, ckpt = s2
    st = AudioStreamer(load_codec(ckpt / "codec.pth"), 4, ChunkSchedule(first=2, growth=1.0, max_frames=2),
                       first_lane=True)
    real = st._decode

    def flaky(rids, n, lane=None):
        if lane is st.first:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(rids, n, lane)

    frames = np.zeros((10, 2), np.int64)
    for _ in range(3):
        st.push("good", frames)
    st.decode_ready(max_calls=2)  # good's first two chunks: good now plays, chunk 2 is a bulk call
    st._decode = flaky
    worker = AudioWorker(st, threaded=False)
    worker._round([("push", "bad", frames, None)])  # bad's first chunk fails, good's chunk 2 runs
    out = worker._outbox
    items = []
    while not out.empty():
        items.append(out.get())
    kinds = sorted((k, rid) for k, rid, *_ in items)
    assert ("audio", "good") in kinds and ("error", "bad") in kinds


def test_first_lane_calls_take_riders_from_their_own_lane(s2):
    """With two lanes and call filling, a first-lane call's spare rows take starting streams
    that already play their first chunk (as one lane would: that kept playback gapless), and a
    bulk call's take only streams past their start."""
    from shoal.engine.audio import AudioStreamer

    _, _, ckpt = s2
    st = AudioStreamer(load_codec(ckpt / "codec.pth"), 6, ChunkSchedule(first=2, growth=2.0, max_frames=8),
                       max_call_streams=4, first_lane=True, fill_calls=True)
    frames = np.zeros((10, 1), np.int64)
    for rid in ("s", "old"):
        st.push(rid, np.repeat(frames, 2, 1))
    st.decode_ready()  # both play their first chunk
    st.push("old", np.repeat(frames, 4, 1))
    st.decode_ready()  # old's second chunk: old is past its start (2 chunks on the first lane)
    st.push("s", np.repeat(frames, 3, 1))  # s: 3 of its 4-frame second chunk (first lane)
    st.push("old", np.repeat(frames, 3, 1))  # old: 3 of its 8-frame third chunk (bulk lane)
    st.push("new", np.repeat(frames, 2, 1))  # a new stream's complete first chunk
    assert st.next_call(st.first) == (2, ["new", "s"])  # s rides; old (bulk lane's) does not
    st.push("old", np.repeat(frames, 5, 1))  # old's 8-frame chunk complete
    st.push("s", np.repeat(frames, 5, 1))  # s holds 8 frames: enough to ride, but it is starting
    assert st.next_call(st.bulk) == (8, ["old"])  # no starting stream rides a bulk call


def test_audio_stats_count_calls_and_first_chunk_waits(s2):
    """The streamer counts its calls and times a first chunk from complete to launched and a
    call from launch to delivery (here on a fake clock)."""
    from shoal.engine.audio import AudioStreamer

    _, _, ckpt = s2
    now = [0.0]
    st = AudioStreamer(load_codec(ckpt / "codec.pth"), 3, ChunkSchedule(first=2, growth=1.0, max_frames=2),
                       clock=lambda: now[0])
    frames = np.zeros((10, 1), np.int64)
    st.push("a", frames)
    now[0] = 1.0
    st.push("a", frames)  # first chunk complete at t=1
    st.push("b", np.repeat(frames, 2, 1))  # complete at t=1 too
    now[0] = 1.25
    st.decode_ready()  # one call of both at t=1.25
    summary = st.stats.summary()
    assert summary["codec_calls"] == 1 and summary["streams_per_call"] == 2 and summary["frames_per_call"] == 4
    assert summary["first_chunk_queue_p50_ms"] == pytest.approx(250.0)
    assert summary["codec_call_p50_ms"] == pytest.approx(0.0)
    st.push("a", np.repeat(frames, 2, 1))
    st.decode_ready()  # a later chunk: no first-chunk wait recorded
    assert len(st.stats.first_queue_s) == 2 and st.stats.calls == 2
    st.stats.reset()
    assert st.stats.summary()["codec_calls"] == 0 and st.stats.summary()["codec_call_p50_ms"] is None


def test_first_lane_streams_equal_single_lane_audio(s2):
    """The same frames through one lane or through the first + bulk lanes give the same audio,
    whatever the arrival order (the lanes share the state rows; rows are reset on first use)."""
    from shoal.engine.audio import AudioStreamer

    _, _, ckpt = s2
    codec = load_codec(ckpt / "codec.pth")
    rng = np.random.default_rng(0)
    codes = {rid: np.stack([rng.integers(0, 1024, 12) for _ in range(10)]) for rid in ("a", "b", "c")}
    out = {}
    for first_lane in (False, True):
        st = AudioStreamer(codec, 2, ChunkSchedule(first=2, growth=2.0, max_frames=4), max_call_streams=2,
                           first_lane=first_lane)
        audio: dict[str, list] = {}

        def run(rids_frames):
            for rid, (a, b) in rids_frames:
                st.push(rid, codes[rid][:, a:b])
            for rid, pcm in st.decode_ready()[0]:
                audio.setdefault(rid, []).append(pcm)

        run([("a", (0, 3)), ("b", (0, 2))])
        run([("a", (3, 12)), ("b", (2, 7))])
        run([("b", (7, 12))])
        for rid in ("a", "b"):
            st.finish(rid)
        run([])
        assert sorted(st.take_done()) == ["a", "b"]
        run([("c", (0, 12))])  # c takes a freed row: reset before its first call
        st.finish("c")
        run([])
        out[first_lane] = {rid: np.concatenate(v) for rid, v in audio.items()}
    for rid in ("a", "b", "c"):
        assert out[True][rid].shape == (12 * 2048,)
        np.testing.assert_allclose(out[True][rid], out[False][rid], atol=1e-5)


@pytest.mark.parametrize("audio_thread", [False, True])
def test_codec_failure_fails_only_that_request(s2, voice, audio_thread):
    """A codec call that raises (e.g. CUDA out of memory) fails the requests it was decoding with
    an error summary; the audio worker and the other requests go on."""
    model, tok, ckpt = s2
    codec = load_codec(ckpt / "codec.pth")
    eng = Engine(model, tok.im_end_id, codec=codec,
                 config=EngineConfig(max_running=3, num_blocks=64, audio_thread=audio_thread,
                                     audio_schedule=ChunkSchedule(first=2, growth=2.0, max_frames=8)))
    streamer = eng.audio.streamer
    real = streamer._decode

    def flaky(rids, n, lane=None):
        if "bad" in rids:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(rids, n, lane)

    streamer._decode = flaky
    eng.add_request(EngineRequest(session=session(tok, 0, voice), params=SAMPLED, seed=1, max_new_tokens=12,
                                  stream_audio=True, request_id="bad", audio_schedule=ChunkSchedule(first=3)))
    eng.add_request(EngineRequest(session=session(tok, 1, voice), params=SAMPLED, seed=2, max_new_tokens=12,
                                  stream_audio=True, request_id="good"))
    done, events = run(eng)
    assert done["bad"].reason == "error" and "out of memory" in done["bad"].error
    assert done["good"].reason != "error"
    good = [e.pcm for e in events if isinstance(e, AudioEvent) and e.request_id == "good"]
    assert sum(len(c) for c in good) == 12 * 2048
    assert not [e for e in events if isinstance(e, AudioEvent) and e.request_id == "bad"]
    assert len(streamer.free_rows) == 3  # every row released


def test_s1_engine_equals_reference_loop(tiny_s1_checkpoint, voice):
    model, tok = load_dualar(tiny_s1_checkpoint, dtype=torch.float32)
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=3, num_blocks=64))
    params = SamplingParams(temperature=0.8, top_p=0.8, repetition_penalty=1.1)
    want = {}
    for i in range(3):
        want[f"s{i}"] = solo(model, tok, i, voice, params, i, 20, family="s1")
        eng.add_request(EngineRequest(session=session(tok, i, voice, "s1"), params=params, seed=i,
                                      max_new_tokens=20, request_id=f"s{i}"))
    done, _ = run(eng)
    for rid, codes in want.items():
        assert np.array_equal(done[rid].codes, codes), rid


def test_dialogue_outgrowing_the_context_fails_only_that_request(s2, voice):
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=64, max_seq_len=80))
    text = "<|speaker:0|>Hi there, how are you? <|speaker:1|>Fine, thanks. And you?"
    eng.add_request(EngineRequest(session=build_session("s2", tok, text, [], 10), params=GREEDY,
                                  max_new_tokens=0, request_id="long"))
    eng.add_request(EngineRequest(session=session(tok, 0, voice), params=GREEDY, max_new_tokens=3,
                                  request_id="ok"))
    done, _ = run(eng)
    assert done["long"].reason == "error" and "context" in done["long"].error
    assert done["ok"].reason == "length"
    assert eng.pool.num_seqs == 0


def test_fused_kernel_path_equals_reference_loop(tiny_s2_checkpoint, voice):
    """The fused decode path (Triton kernels on GPU; their PyTorch references here) gives the
    same codes as the plain layer code of the reference loop."""
    model, tok = load_dualar(tiny_s2_checkpoint, dtype=torch.float32)
    want = {f"f{i}": solo(model, tok, i, voice, SAMPLED if i % 2 else GREEDY, i, 10) for i in range(4)}
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=4, num_blocks=64, fused_kernels=True))
    assert model.fused
    for i in range(4):
        eng.add_request(EngineRequest(session=session(tok, i, voice), params=SAMPLED if i % 2 else GREEDY,
                                      seed=i, max_new_tokens=10, request_id=f"f{i}"))
    done, _ = run(eng)
    for rid, codes in want.items():
        assert np.array_equal(done[rid].codes, codes), rid


def test_prefill_only_request_warms_the_prefix_cache(s2, voice):
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=64))
    full = session(tok, 1, voice).grid()
    eng.add_request(EngineRequest(session=GridSessionFor(full[:, :60]), prefill_only=True, request_id="warm"))
    done, _ = run(eng)
    assert done["warm"].reason == "prefilled" and done["warm"].codes.shape == (10, 0)
    assert eng.pool.num_seqs == 0
    before = eng.pool.hit_tokens
    eng.add_request(EngineRequest(session=session(tok, 1, voice), params=GREEDY, max_new_tokens=3,
                                  request_id="real"))
    done, _ = run(eng)
    assert eng.pool.hit_tokens - before >= 48
    assert np.array_equal(done["real"].codes, solo(model, tok, 1, voice, GREEDY, 0, 3))


def GridSessionFor(grid):
    from shoal.engine.request import GridSession
    return GridSession(grid)


def test_warm_prefill_leaves_the_engine_as_it_was(s2, voice):
    """Engine.warmup(prefill=True) (default on CUDA) runs throw-away prefills of many lengths;
    afterwards nothing is cached or counted, and outputs equal the reference loop."""
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=96, prefill_chunk=64))
    free_before = eng.pool.num_free
    eng.warmup(show_progress=False, prefill=True)
    assert not eng.requests and eng.stats["prefill_tokens"] == 0 and eng.stats["finished"] == 0
    assert eng.pool.hit_tokens == 0 and eng.pool.queried_tokens == 0
    assert eng.pool.num_free == free_before
    eng.add_request(EngineRequest(session=session(tok, 1, voice), params=GREEDY, max_new_tokens=4,
                                  request_id="after"))
    done, _ = run(eng)
    assert np.array_equal(done["after"].codes, solo(model, tok, 1, voice, GREEDY, 0, 4))
    assert eng.pool.hit_tokens == 0  # the warm-up prompts left nothing to hit


def test_request_larger_than_the_kv_pool_is_rejected_not_queued_forever(s2, voice):
    """A prompt that could never fit the whole pool is refused at submission (it used to wait
    at the head of the queue forever, blocking everything behind it); one that fits is capped
    so it stops before outgrowing the pool."""
    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=4, block_size=16))
    big = session(tok, 1, voice)  # a cloning prompt: longer than 4 x 16 columns
    assert big.grid().shape[1] >= 64
    with pytest.raises(ValueError, match="KV cache holds 64"):
        eng.add_request(EngineRequest(session=big, params=GREEDY, max_new_tokens=10, request_id="big"))
    small = EngineRequest(session=session(tok, 0, voice), params=GREEDY, max_new_tokens=0, ignore_eos=True,
                          request_id="small")
    eng.add_request(small)
    done, _ = run(eng)
    assert done["small"].reason == "length"
    assert small.prompt_len + done["small"].codes.shape[1] <= 64
    assert eng.pool.num_seqs == 0


def test_fused_sampling_only_for_s2_in_bf16_or_fp32():
    """The sampling kernels implement the S2 rule for bf16 / fp32 logits: an fp16 model (or an
    S1 model) keeps the PyTorch sampler even when fused sampling is requested."""
    from shoal.bench.random_model import random_dualar, tiny_config
    from shoal.engine.engine import _fused_sampling

    want = EngineConfig(fused_sampling=True)
    assert _fused_sampling(want, random_dualar(tiny_config(256), "cpu", torch.float32))
    assert not _fused_sampling(want, random_dualar(tiny_config(256), "cpu", torch.float16))
    assert not _fused_sampling(EngineConfig(), random_dualar(tiny_config(256), "cpu", torch.float32))  # CPU default


def test_memory_bytes_by_part(s2):
    """The engine's memory account: the DualAR's weights, the KV pool as allocated (and the
    codec's weights when it serves audio); exposed at /metrics as shoal_memory_bytes."""
    from shoal.engine.attention import PagedKVCache

    model, tok, _ = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=48))
    mem = eng.memory_bytes
    tensors = list(model.parameters()) + list(model.buffers())
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    # every storage once (views such as shared tables are not counted twice)
    assert sum(params.values()) <= mem["model_weights"] <= sum(t.numel() * t.element_size() for t in tensors)
    s = model.config.slow
    per_block = PagedKVCache.bytes_per_block(s.n_layer, eng.config.block_size, s.n_local_heads, s.head_dim,
                                             model.dtype, eng.kv_cache_dtype)
    assert mem["kv_cache"] == 48 * per_block > 0
    assert "codec_weights" not in mem and "codec_streamer" not in mem  # no codec, no audio
    mem["kv_cache"] = 0
    assert eng.memory_bytes["kv_cache"] > 0  # a copy
