"""``shoal serve --random-model``: random weights at real shapes for benchmarks, and the one-shot
GPU benchmark driver ``python -m shoal.bench.serve_gpu`` (run here with the tiny model on CPU)."""

from __future__ import annotations

import argparse
import json
import base64
import os
from collections.abc import Iterator

import httpx
import pytest
import torch
from live_server import LiveServer, sine_wav

from shoal.bench.random_tts import s2_layout_tokenizer
from shoal.server.cli import RANDOM_MODEL_DEFAULT_CAP, _frames_cap, add_serve_parser

CAP = 12
FRAME = 2048  # samples per codec frame at 44.1 kHz


def test_s2_layout_tokenizer_has_the_s2_pro_ids():
    tok = s2_layout_tokenizer()
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>",
                                            "<|audio_pad|>", "<|semantic:0|>", "<|semantic:4095|>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|pad|>": 151669,
                   "<|audio_pad|>": 151677, "<|semantic:0|>": 151678, "<|semantic:4095|>": 155773}
    assert (tok.semantic_begin_id, tok.semantic_end_id, tok.im_end_id) == (151678, 155773, 151645)
    assert tok.vocab_size == 155774  # < the model's 155776
    text = "Grüß dich! 你好，世界。 <|im_end|>"
    enc = tok.encode(text)
    assert enc[-1] == 151645 and max(enc[:-1]) < 151643  # text ids stay in the BPE range
    assert tok.decode(enc) == text
    assert len(tok.encode("The train to Edinburgh has been delayed by twenty minutes.")) < 25


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_serve_flags():
    assert _frames_cap(_serve_args("--random-model", "tiny")) == RANDOM_MODEL_DEFAULT_CAP
    assert _frames_cap(_serve_args("--random-model", "s2-pro", "--max-new-tokens-cap", "50")) == 50
    assert _frames_cap(_serve_args()) is None
    with pytest.raises(SystemExit):  # a checkpoint or random weights, not both
        _serve_args("--random-model", "tiny", "--checkpoint", "x")
    with pytest.raises(SystemExit):
        _serve_args("--random-model", "s1-mini")


@pytest.fixture(scope="module")
def random_server() -> Iterator[LiveServer]:
    from shoal.bench.random_tts import random_tts
    from shoal.server.app import create_app
    from shoal.server.config import ServerConfig
    from shoal.server.service import TTSService

    svc = TTSService.from_tts(random_tts("tiny", device="cpu"), max_running=4, model_name="random tiny",
                              random_weights=True)
    try:
        with LiveServer(create_app(svc, ServerConfig(max_new_tokens_cap=CAP)), timeout=60) as srv:
            yield srv
    finally:
        svc.close()


def _pcm_frames(srv: LiveServer, body: dict) -> float:
    r = httpx.post(srv.url + "/v1/tts", json={"format": "pcm", **body}, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return len(r.content) / 2 / FRAME


def test_random_model_serves_exact_frame_counts(random_server):
    ready = httpx.get(random_server.url + "/v1/ready", trust_env=False).json()
    assert ready["random_weights"] is True and "benchmark only" in ready["warning"]
    assert ready["model"] == "random tiny" and ready["model_family"] == "s2"
    assert ready["codec_dtype"] == {"encode": "fp32", "decode": "fp32"}  # --codec-dtype auto on CPU
    # EOS is ignored: a request yields exactly min(max_new_tokens, cap) frames
    assert _pcm_frames(random_server, {"text": "Hello there, how are you?", "max_new_tokens": 5}) == 5
    assert _pcm_frames(random_server, {"text": "你好，世界。", "max_new_tokens": 0}) == CAP
    assert _pcm_frames(random_server, {"text": "Cloned.", "max_new_tokens": 1000,
                                       "references": [{"audio": base64.b64encode(sine_wav()).decode(),
                                                       "text": "a reference"}]}) == CAP


def test_serve_gpu_smoke_profile(tmp_path, capsys):
    """The GPU driver end to end with the tiny random model on CPU: ``shoal serve --random-model
    tiny`` in a subprocess, readiness, a library voice, both sweeps, and the server stopped."""
    from shoal.bench import serve_gpu

    out = tmp_path / "out"
    assert serve_gpu.main([str(out), "--profile", "smoke", "--device", "cpu"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "error" not in summary and summary["phases"]["serve"]["exit"] == 0
    assert summary["phases"]["live"]["exit"] == 0 and summary["live_reference_id"]
    assert summary["server"]["random_weights"] is True
    assert summary["server_exit"] is not None  # stopped
    with pytest.raises(ProcessLookupError):
        os.kill(summary["server_pid"], 0)
    serve = json.loads((out / "serve.json").read_text())
    assert serve["meta"]["server"]["random_weights"] is True
    assert [(r["concurrency"], r["ok"], r["errors"]) for r in serve["results"]] == [(1, 1, 0), (2, 2, 0)]
    frames = serve_gpu.PROFILES["smoke"].serve_frames
    assert all(r["audio_s_per_request_mean"] == pytest.approx(frames * FRAME / 44100) for r in serve["results"])
    live = json.loads((out / "live.json").read_text())
    assert live["meta"]["args"]["reference_id"] == summary["live_reference_id"]
    assert [(r["concurrency"], r["errors"]) for r in live["results"]] == [(1, 0), (2, 0)]
    assert all(r["ttfa_p50_ms"] is not None for r in live["results"])
    assert "RANDOM WEIGHTS" in (out / "server.log").read_text()
    assert "shoal_frames_total" in (out / "metrics.prom").read_text()
    assert "bench live (WS /v1/tts/live)" in capsys.readouterr().out


def test_serve_gpu_stops_the_server_when_startup_fails(tmp_path):
    from shoal.bench import serve_gpu

    p = serve_gpu.Profile(**{**serve_gpu.asdict(serve_gpu.PROFILES["smoke"]), "model": "no-such-model"})
    summary = serve_gpu.run(tmp_path, p, profile_name="bad", port=None, device="cpu")
    assert serve_gpu.failed(summary) and "exited with status" in summary["error"]
    assert summary["server_exit"] not in (None, 0) and "serve" not in summary["phases"]


def test_serve_quantization_flag_loads_fp8(tiny_s2_checkpoint):
    """`shoal serve --quantization fp8` quantizes the checkpoint at load (CPU: the PyTorch FP8 path)."""
    from shoal.quant.fp8 import FP8Linear
    from shoal.server.service import TTSService

    assert _serve_args("--quantization", "fp8").quantization == "fp8"
    assert _serve_args().quantization == "none"
    assert _serve_args().codec_dtype == "auto" and _serve_args("--codec-dtype", "bf16").codec_dtype == "bf16"
    svc = TTSService.load(tiny_s2_checkpoint, device="cpu", max_running=2, quantization="fp8",
                          codec_dtype="bf16")
    try:
        assert isinstance(svc.tts.model.layers[0].attention.wqkv, FP8Linear)
        assert next(svc.tts.codec.parameters()).dtype == torch.bfloat16
    finally:
        svc.close()


def test_prefill_chunk_reaches_the_engine_and_is_validated():
    from shoal.bench.random_tts import random_tts
    from shoal.server.service import TTSService

    def parse(*argv):
        p = argparse.ArgumentParser()
        add_serve_parser(p.add_subparsers(dest="command"))
        return p.parse_args(["serve", *argv])

    tts = random_tts("tiny", device="cpu")
    svc = TTSService.from_tts(tts, max_running=2, prefill_chunk=64)
    try:
        assert svc.engine.engine.config.prefill_chunk == 64
        assert svc.engine.engine.scheduler.prefill_chunk == 64
    finally:
        svc.close()
    with pytest.raises(ValueError, match="prefill_chunk"):
        TTSService.from_tts(tts, max_running=2, prefill_chunk=8)
    assert parse("--prefill-chunk", "4096").prefill_chunk == 4096
    assert parse().prefill_chunk == 1024
