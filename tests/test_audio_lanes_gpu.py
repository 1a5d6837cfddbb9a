"""The threaded audio worker on CUDA with its two lanes (first chunks on their own decoder and
higher-priority stream, later chunks on the bulk lane, asynchronous calls): every stream's audio
equals a one-stream eager streaming decode of its codes, while streams start, overlap, finish
and reuse rows. Random tiny codec (no golden files needed), so it runs on any GPU machine."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from shoal.bench.codec import build_codec
from shoal.codec.streaming import StreamingDecoder
from shoal.engine.audio import AudioStreamer, AudioWorker, ChunkSchedule

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.parametrize("dtype,window_state", [(torch.float32, "kv"), (torch.bfloat16, "kv"),
                                                (torch.float32, "hidden"), (torch.bfloat16, "hidden"),
                                                (torch.float32, "ring"), (torch.bfloat16, "ring")])
def test_gpu_two_lane_worker_equals_eager(dtype, window_state, monkeypatch):
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setenv("SHOAL_CODEC_WINDOW_STATE", window_state)  # the serving decoders read it
    codec = build_codec(True, torch.device("cuda")).to(dtype)
    rng = np.random.default_rng(0)
    n_streams, frames = 12, 40
    codes = {f"s{i}": np.stack([rng.integers(0, 1024, frames) for _ in range(codec.num_codebooks)])
             for i in range(n_streams)}
    st = AudioStreamer(codec, 6, ChunkSchedule(first=4, growth=2.0, max_frames=8), max_call_streams=4,
                       first_lane=True, fill_calls=True)
    worker = AudioWorker(st, threaded=True)
    assert st.first is not None and st.first.stream is not None
    worker.warmup()
    audio: dict[str, list[np.ndarray]] = {}
    done: set[str] = set()
    active: list[str] = []
    sent = {rid: 0 for rid in codes}
    waiting = list(codes)
    deadline = time.monotonic() + 240
    while len(done) < n_streams and time.monotonic() < deadline:
        while waiting and len(active) < 6:  # at most 6 rows: finished streams free theirs
            active.append(waiting.pop(0))
        for rid in list(active):  # every active stream gets 1-3 frames per round
            if sent[rid] < frames:
                k = min(frames - sent[rid], int(rng.integers(1, 4)))
                worker.push(rid, codes[rid][:, sent[rid]:sent[rid] + k])
                sent[rid] += k
                if sent[rid] == frames:
                    worker.finish(rid)
        for item in worker.poll(timeout=0.002):
            if item[0] == "audio":
                audio.setdefault(item[1], []).append(item[2])
            elif item[0] == "done":
                done.add(item[1])
                active.remove(item[1])
            else:
                pytest.fail(f"worker error: {item}")
    assert done == set(codes)
    eager = StreamingDecoder(codec)
    for rid, c in codes.items():
        ref = eager.decode_chunk(torch.as_tensor(c[None], device="cuda"), eager.new_state(1))[0, 0].float().cpu().numpy()
        got = np.concatenate(audio[rid])
        assert got.shape == ref.shape
        err = got - ref
        if dtype == torch.float32:
            assert np.abs(err).max() <= 1e-4, (rid, np.abs(err).max())
        else:  # bf16: batched Triton convs vs a one-stream one-shot decode round differently;
            # a lost or misplaced chunk would be ~0 dB
            snr = 10 * np.log10(np.sum(ref ** 2) / max(np.sum(err ** 2), 1e-30))
            assert snr >= 20, (rid, snr)
    stats = st.first.decoder.stats
    assert stats.replays > 0  # first chunks replayed the first lane's graphs
