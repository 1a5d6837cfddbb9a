"""``shoal bench interference``: the LLM decode step with and without concurrent codec work.

When the engine streams audio, the codec runs on its own thread and CUDA stream beside the
LLM's decode steps. This benchmark measures what that sharing costs each side, at S2-Pro
shapes with random weights:

* the decode step (CUDA-graph replay at batch ``--batch``, ~``--context``-token contexts) alone;
* one streaming codec call (batch x frames, CUDA graph) alone;
* both at once for ``--seconds``: a thread loops codec calls on its own stream while the main
  thread replays decode steps; each side's rate under load.

``sharing`` = LLM rate under load / alone + codec rate under load / alone: 1.0 means the two
time-share the GPU with no loss, above 1 they overlap usefully, below 1 they get in each
other's way. ``--priorities 1,0`` repeats the LLM side with its graphs captured on the
highest-priority stream and on a default one (``SHOAL_LLM_PRIORITY``). ``--device cpu
--shape tiny`` is a smoke run of the benchmark itself (eager, no streams).

    shoal bench interference --batch 64 --codec 64x32 --out interference.json   (+ .png)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..engine.engine import Engine, EngineConfig
from ..engine.request import EngineRequest, GridSession
from ..engine.sampling import SamplingParams
from .codec import HOP, SR, build_codec, random_codes
from .random_model import S2_IM_END, random_dualar, random_prompt, s2_pro_config, tiny_config


def log(msg: str) -> None:
    print(f"[interference {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def decoding_engine(model, cfg, batch: int, context: int) -> Engine:
    """An engine with ``batch`` requests prefilled and decoding (contexts of ~``context``)."""
    eng = Engine(model, S2_IM_END, config=EngineConfig(max_running=batch, max_seq_len=4096,
                                                       num_blocks=batch * (context // 16 + 64) + 64))
    rng = np.random.default_rng(0)
    ref = min(200, context // 2)
    for i in range(batch):
        eng.add_request(EngineRequest(session=GridSession(random_prompt(cfg, context - ref, ref, rng)),
                                      params=SamplingParams(temperature=0.8, top_p=0.8, top_k=30), seed=i,
                                      max_new_tokens=1_000_000, ignore_eos=True))
    while eng.num_running < batch or any(r.status.value != "decode" for r in eng.scheduler.running):
        eng.step()
    ids = torch.tensor([r.slot for r in eng.scheduler.running], dtype=torch.long, device=model.device)
    eng.runner.slot_ids[:batch].copy_(ids)
    return eng


class LLMStep:
    """One decode step of the engine's runner at a fixed batch: a graph replay on CUDA (the
    decode graphs re-captured with ``SHOAL_LLM_PRIORITY=priority``), eager elsewhere.
    :meth:`rewind` puts the requests' positions and frame counters back where they were
    between measurements. Steps past a request's prompt get no new blocks: their K/V go to the
    scratch block that unused block-table entries name (values are irrelevant to timing)."""

    def __init__(self, eng: Engine, batch: int, priority: str | None) -> None:
        self.runner, self.batch = eng.runner, batch
        self.graph = None
        r = self.runner
        if eng.model.device.type == "cuda":
            before = os.environ.get("SHOAL_LLM_PRIORITY")
            if priority is not None:
                os.environ["SHOAL_LLM_PRIORITY"] = priority
            try:
                r.graphs, r.capture_stream = {}, None
                r._capture_decode_graphs(show_progress=False)
            finally:
                if before is None:
                    os.environ.pop("SHOAL_LLM_PRIORITY", None)
                else:
                    os.environ["SHOAL_LLM_PRIORITY"] = before
            self.graph = r.graphs[r.bucket_for(batch)]
        self._saved = (r.position.clone(), r.frame.clone())

    def rewind(self) -> None:
        self.runner.position.copy_(self._saved[0])
        self.runner.frame.copy_(self._saved[1])

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self.runner._decode_body(self.batch)


def _sync(dev) -> None:
    """Wait for this thread's stream only (a device-wide sync would also wait for the codec's
    work on the other thread's stream)."""
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def rate_alone(fn, dev, seconds: float) -> float:
    """Calls per second of ``fn`` run back to back for about ``seconds`` (after a warm-up)."""
    for _ in range(2):
        fn()
    _sync(dev)
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if n % 4 == 0:
            _sync(dev)
            if time.perf_counter() - t0 >= seconds:
                break
    _sync(dev)
    return n / (time.perf_counter() - t0)


def codec_stream(dev, sms: int):
    """The codec side's stream: an ordinary one (``sms`` 0) or one confined to ``sms`` SMs
    (:mod:`shoal.engine.sm_partition`); None off CUDA."""
    if dev.type != "cuda":
        return None
    if sms:
        from ..engine.sm_partition import sm_partition

        return sm_partition(dev, sms).stream()
    return torch.cuda.Stream(dev)


def rates_together(llm, codec_call, dev, seconds: float, stream=None) -> tuple[float, float]:
    """(LLM steps/s, codec calls/s) while a thread loops codec calls on its own stream."""
    stop = threading.Event()
    done = [0]
    started = threading.Event()
    errors: list[BaseException] = []
    stream = stream if stream is not None else (torch.cuda.Stream(dev) if dev.type == "cuda" else None)

    def loop():
        try:
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                codec_call()
                _sync(dev)
                started.set()
                while not stop.is_set():
                    codec_call()
                    if stream is not None:
                        stream.synchronize()
                    done[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
            started.set()

    th = threading.Thread(target=loop, name="codec-load", daemon=True)
    th.start()
    started.wait()
    c0, t0, n = done[0], time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        llm()
        n += 1
        if n % 4 == 0:
            _sync(dev)
    _sync(dev)
    t = time.perf_counter() - t0
    c = done[0] - c0
    stop.set()
    th.join()
    if errors:
        raise errors[0]
    return n / t, c / t


def plot(report: dict, path: Path) -> None:
    """Bars: each side's rate under load as a share of its rate alone, per LLM priority."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    labels = [f"prio {r['llm_priority']}" + (f", codec {r['codec_sms']} SMs" if r.get("codec_sms") else "")
              for r in runs]
    llm = [r["frames_per_s_loaded"] / r["frames_per_s_alone"] for r in runs]
    codec = [r["codec_audio_s_per_s_loaded"] / report["codec_audio_s_per_s_alone"] for r in runs]
    x = np.arange(len(runs))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(runs)), 4))
    ax.bar(x - 0.2, llm, 0.4, label="LLM frames/s (loaded / alone)")
    ax.bar(x + 0.2, codec, 0.4, bottom=0, label="codec audio s/s (loaded / alone)")
    ax.axhline(1.0, color="gray", ls="--")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set(ylabel="share of the rate alone", ylim=(0, 1.1),
           title=f"LLM batch {report['batch']} vs codec {report['codec_batch']}x{report['codec_frames']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="LLM decode batch")
    p.add_argument("--context", type=int, default=500, help="prompt tokens per request")
    p.add_argument("--codec", default="64x32", help="codec call: streams x frames")
    p.add_argument("--seconds", type=float, default=3.0, help="duration of each measurement")
    p.add_argument("--priorities", default="1,0", help="SHOAL_LLM_PRIORITY values to compare (CUDA)")
    p.add_argument("--codec-sms", default="0",
                   help="comma list: SMs the codec's stream may use (0 = all, an ordinary stream; "
                        "else a green-context partition, shoal.engine.sm_partition)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=["s2-pro", "tiny"], default="s2-pro")
    p.add_argument("--out", default="interference.json")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu --shape tiny)", file=sys.stderr)
        return 2
    tiny = args.shape == "tiny"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = tiny_config() if tiny else s2_pro_config(4096)
    model = random_dualar(cfg, dev, dtype)
    cb, ct = (int(v) for v in args.codec.split("x"))
    codec = build_codec(tiny, dev).to(dtype)
    from ..codec.streaming import serving_decoder

    dec = serving_decoder(codec, batch_buckets=(cb,), chunk_frames=(ct,)) if dev.type == "cuda" \
        else serving_decoder(codec, graphs=False)
    state = dec.new_state(cb)
    codes = random_codes(cb, ct, dev, seed=3)

    def codec_call():
        with torch.inference_mode():
            dec.decode_chunk(codes, state)

    log(f"engine at batch {args.batch}, contexts ~{args.context} tokens")
    eng = decoding_engine(model, cfg, args.batch, args.context)
    audio_per_call = cb * ct * HOP / SR
    report: dict = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "commit": os.environ.get("SHOAL_COMMIT", ""),
                    "shape": args.shape, "batch": args.batch, "context": args.context,
                    "codec_batch": cb, "codec_frames": ct, "codec_triton": bool(codec.decoder.triton_conv),
                    "seconds": args.seconds, "runs": []}
    codec_alone = rate_alone(codec_call, dev, args.seconds)
    report["codec_call_ms_alone"] = 1e3 / codec_alone
    report["codec_audio_s_per_s_alone"] = codec_alone * audio_per_call
    log(f"codec {cb}x{ct} alone: {1e3 / codec_alone:.2f} ms per call, "
        f"{codec_alone * audio_per_call:.0f} audio s/s")
    prios = args.priorities.split(",") if dev.type == "cuda" else [None]
    sms_list = [int(v) for v in args.codec_sms.split(",")] if dev.type == "cuda" else [0]
    for prio in prios:
        llm = LLMStep(eng, args.batch, prio)
        alone = rate_alone(llm, dev, args.seconds)
        llm.rewind()
        for sms in sms_list:
            stream = codec_stream(dev, sms)
            run = {"llm_priority": prio, "codec_sms": sms}
            if hasattr(dec, "capture_stream"):
                # graphs keep the SMs of their capture stream: re-capture on this one
                dec.capture_stream = stream if sms else None
                dec.graphs.clear()
            if sms:
                from ..engine.sm_partition import sm_partition

                run["codec_sms_granted"] = sm_partition(dev, sms).sm_count
                with torch.cuda.stream(stream):
                    part_alone = rate_alone(codec_call, dev, args.seconds)
                run["codec_call_ms_alone_partition"] = 1e3 / part_alone
            llm_rate, codec_rate = rates_together(llm, codec_call, dev, args.seconds, stream)
            llm.rewind()
            run.update({"step_ms_alone": 1e3 / alone, "frames_per_s_alone": alone * args.batch,
                        "step_ms_loaded": 1e3 / llm_rate if llm_rate else float("inf"),
                        "frames_per_s_loaded": llm_rate * args.batch,
                        "codec_call_ms_loaded": 1e3 / codec_rate if codec_rate else float("inf"),
                        "codec_audio_s_per_s_loaded": codec_rate * audio_per_call,
                        "sharing": llm_rate / alone + codec_rate / codec_alone})
            report["runs"].append(run)
            log(f"priority {prio}, codec SMs {sms or 'all'}: step {run['step_ms_alone']:.2f} ms alone, "
                f"{run['step_ms_loaded']:.2f} ms with the codec ({run['frames_per_s_loaded']:.0f} frames/s); "
                f"codec {run['codec_call_ms_loaded']:.1f} ms per call under load "
                f"({run['codec_audio_s_per_s_loaded']:.0f} audio s/s); sharing {run['sharing']:.2f}")
            Path(args.out).write_text(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))
    try:
        plot(report, Path(args.out).with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
