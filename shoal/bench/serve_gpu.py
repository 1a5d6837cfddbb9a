"""``python -m shoal.bench.serve_gpu OUT``: the HTTP and realtime benchmarks in one bounded run.

Starts ``shoal serve --random-model s2-pro`` (random weights at the real S2-Pro shapes, the
normal serving path: engine, CUDA graphs, fused kernels, audio worker) on a free loopback port,
waits for ``/v1/ready`` (graph capture), creates a library voice from a synthetic WAV through
``POST /model``, then runs

* ``shoal bench serve`` (closed-loop ``POST /v1/tts``, pcm streaming, half the requests cloning
  the synthetic voice inline, multilingual corpus) over a concurrency sweep, and
* ``shoal bench live`` (``WS /v1/tts/live`` sockets typing text word by word, cloning the
  library voice, so the voice prefix is prefilled at ``start``) over a socket sweep,

and always stops the server, also on failure or interruption. Everything lands in ``OUT``:
``serve.json``/``serve.png``, ``live.json``/``live.png``, ``server.log``, ``metrics.prom`` (the
server's Prometheus metrics after the runs) and ``summary.json`` (phase timings, exit codes,
headline numbers). Progress goes to stdout, flushed. Each phase runs in its own process with
a time limit, under one overall ``--deadline-s``.

Profiles (``--profile``): ``quick`` (default: HTTP c = 1, 16, 64 x 3 requests of 300 frames,
live 1, 8, 32 sockets x 2; about 3-5 minutes on an H200 with start-up, never over 500 s),
``full`` (HTTP c up to 128, live up to 64; up to 560 s), ``smoke`` (the tiny random model on
CPU, seconds: tests).
The GPU machine has the server's wheels in ``/tmp/site`` (``scripts/gpu-wheels.sh``)::

    PYTHONPATH=/tmp/site:$PWD python3 -m shoal.bench.serve_gpu "$OUT" --profile quick
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

VOICE_TEXT = ("This is the voice every cloned request of the benchmark borrows, about six seconds "
              "of speech read at an easy pace.")


@dataclass(frozen=True)
class Profile:
    model: str  # shoal serve --random-model
    serve_concurrency: str
    serve_requests_per_client: int
    serve_frames: int  # max_new_tokens per /v1/tts request (= frames: EOS is ignored)
    live_concurrency: str
    live_sockets_per_client: int
    live_sentences: int
    live_frames: int  # max_new_tokens per live segment (a sentence)
    words_per_second: float
    ready_timeout_s: float  # start-up: model build + graph capture + warm-up
    serve_budget_s: float
    live_budget_s: float
    request_timeout_s: float
    deadline_s: float  # the whole run


PROFILES: dict[str, Profile] = {
    "quick": Profile("s2-pro", "1,16,64", 3, 300, "1,8,32", 2, 3, 100, 8.0,
                     ready_timeout_s=240, serve_budget_s=180, live_budget_s=120, request_timeout_s=90,
                     deadline_s=500),
    "full": Profile("s2-pro", "1,4,16,32,64,128", 3, 400, "1,8,32,64", 2, 3, 100, 8.0,
                    ready_timeout_s=240, serve_budget_s=240, live_budget_s=150, request_timeout_s=120,
                    deadline_s=560),
    "smoke": Profile("tiny", "1,2", 1, 8, "1,2", 1, 1, 8, 0.0,
                     ready_timeout_s=90, serve_budget_s=60, live_budget_s=60, request_timeout_s=30,
                     deadline_s=240),
}


class Clock:
    def __init__(self, deadline_s: float) -> None:
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self, reserve: float = 0.0) -> float:
        return self.deadline_s - self.elapsed - reserve

    def say(self, msg: str) -> None:
        print(f"[serve_gpu +{self.elapsed:6.1f}s] {msg}", flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------- the server
def server_command(p: Profile, port: int, voices_dir: Path, device: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--random-model", p.model, "--host", "127.0.0.1",
           "--port", str(port), "--voices-dir", str(voices_dir),
           "--max-new-tokens-cap", str(max(p.serve_frames, p.live_frames)), "--log-level", "info"]
    return cmd + (["--device", device] if device else [])


def start_server(cmd: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    finally:
        log.close()  # the child holds its own descriptor


def stop_server(proc: subprocess.Popen, clock: Clock) -> int | None:
    """SIGTERM (uvicorn shuts down gracefully), SIGKILL after 20 s; returns the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            clock.say(f"server {proc.pid} ignored SIGTERM: killing it")
            proc.kill()
            proc.wait(10)
    return proc.returncode


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout: float, clock: Clock) -> dict:
    """Poll ``/v1/ready`` until 200; fails when the server exits or ``timeout`` passes."""
    import httpx

    start = time.monotonic()
    last_note = start
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready:\n"
                               + _tail(log_path, 30))
        try:
            r = httpx.get(url + "/v1/ready", timeout=5, trust_env=False)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        now = time.monotonic()
        if now - start > timeout:
            raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n" + _tail(log_path, 30))
        if now - last_note >= 15:
            last_note = now
            clock.say(f"waiting for /v1/ready ({now - start:.0f} s); server log: "
                      + (_tail(log_path, 1) or "(empty)"))
        time.sleep(1.0)


def create_voice(url: str) -> str:
    """A library voice from the benchmark's synthetic 6 s WAV, through the Fish ``POST /model``."""
    import httpx

    from .serve import synthetic_voice

    r = httpx.post(url + "/model", data={"title": "bench voice", "texts": VOICE_TEXT},
                   files={"voices": ("voice.wav", synthetic_voice(), "audio/wav")}, timeout=120, trust_env=False)
    if r.status_code != 201:
        raise RuntimeError(f"POST /model: HTTP {r.status_code}: {r.text[:300]}")
    return str(r.json()["_id"])


# --------------------------------------------------------------------------- the benchmarks
def serve_command(p: Profile, url: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "shoal.bench.serve", "--url", url, "--concurrency", p.serve_concurrency,
            "--requests-per-client", str(p.serve_requests_per_client), "--max-new-tokens", str(p.serve_frames),
            "--voice-text", VOICE_TEXT, "--timeout", str(p.request_timeout_s),
            "--max-level-s", str(p.serve_budget_s), "--ready-timeout", "30", "--no-progress", "--out", str(out)]


def live_command(p: Profile, url: str, out: Path, reference_id: str | None) -> list[str]:
    ws = "ws://" + url.removeprefix("http://")
    cmd = [sys.executable, "-m", "shoal.bench.live", "--url", ws, "--concurrency", p.live_concurrency,
           "--sockets-per-client", str(p.live_sockets_per_client), "--sentences", str(p.live_sentences),
           "--words-per-second", str(p.words_per_second), "--max-new-tokens", str(p.live_frames),
           "--seed", "0", "--timeout", str(p.request_timeout_s), "--out", str(out)]
    return cmd + (["--reference-id", reference_id] if reference_id else [])


def run_phase(name: str, cmd: list[str], budget: float, clock: Clock) -> dict:
    """Run one benchmark process (its output inherited) within ``budget`` seconds."""
    budget = max(min(budget, clock.left(reserve=30)), 10.0)
    clock.say(f"{name}: {' '.join(cmd[1:])}  (limit {budget:.0f} s)")
    t = time.monotonic()
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        rc: int | str = proc.wait(budget)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        rc = "timeout"
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    seconds = time.monotonic() - t
    clock.say(f"{name}: exit {rc} after {seconds:.0f} s")
    return {"exit": rc, "seconds": round(seconds, 1)}


def scrape_metrics(url: str, path: Path) -> None:
    import httpx

    try:
        path.write_text(httpx.get(url + "/metrics", timeout=10, trust_env=False).text)
    except httpx.HTTPError as e:
        path.write_text(f"# metrics unavailable: {e!r}\n")


def gpu_info() -> list[str]:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        return [line.strip() for line in r.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


# --------------------------------------------------------------------------- summary
SERVE_COLUMNS = {"concurrency": "c", "ok": "ok", "errors": "err", "requests_per_s": "req/s",
                 "audio_s_per_s": "audio-s/s", "frames_per_s": "frames/s", "per_stream_fps_mean": "fps/stream",
                 "ttfa_p50_ms": "ttfa p50", "ttfa_p99_ms": "ttfa p99", "e2e_p50_ms": "e2e p50",
                 "rtf_p50": "rtf p50", "underrun_requests": "underrun", "stall_s_total": "stall s"}
LIVE_COLUMNS = {"concurrency": "c", "sockets": "sockets", "errors": "err", "ttfa_p50_ms": "ttfa p50",
                "ttfa_p99_ms": "ttfa p99", "sentence_to_audio_p50_ms": "sent p50", "sentence_to_audio_p99_ms":
                "sent p99", "total_p50_s": "total p50", "audio_s_mean": "audio s"}


def headline(path: Path, columns: dict[str, str]) -> list[dict] | None:
    """The ``columns`` of each level of a bench JSON (None when it is missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return [{k: (round(r[k], 2) if isinstance(r.get(k), float) else r.get(k)) for k in columns}
            for r in data.get("results", [])]


def print_table(title: str, rows: list[dict] | None, columns: dict[str, str]) -> None:
    """Times in ms, as in the JSON (``sent``: the text ending the first sentence -> first audio)."""
    print(f"== {title}", flush=True)
    if not rows:
        print("   (no results)", flush=True)
        return
    print("   " + " ".join(f"{label:>10}" for label in columns.values()))
    for r in rows:
        print("   " + " ".join(f"{'-' if r.get(k) is None else r[k]!s:>10.10}" for k in columns))
    sys.stdout.flush()


# --------------------------------------------------------------------------- main
def run(out: Path, p: Profile, *, profile_name: str, port: int | None, device: str | None,
        skip_live: bool = False, skip_serve: bool = False) -> dict:
    import tempfile

    clock = Clock(p.deadline_s)
    out.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = out / "server.log"
    summary: dict = {"profile": profile_name, "settings": asdict(p), "url": url,
                     "commit": os.environ.get("SHOAL_COMMIT"), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                     "phases": {}, "gpu": gpu_info()}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-voices-") as voices_dir:
        cmd = server_command(p, port, Path(voices_dir), device)
        clock.say(f"starting: {' '.join(cmd[1:])}  (log: {log_path})")
        proc = start_server(cmd, log_path)
        summary["server_pid"] = proc.pid
        try:
            summary["server"] = wait_ready(url, proc, log_path, min(p.ready_timeout_s, clock.left(60)), clock)
            summary["phases"]["startup"] = {"seconds": round(clock.elapsed, 1)}
            clock.say(f"ready: {json.dumps(summary['server'])}")
            reference_id = None
            if not skip_live:
                try:
                    reference_id = create_voice(url)
                    clock.say(f"library voice {reference_id} created from the synthetic WAV")
                except Exception as e:  # noqa: BLE001 - the live sweep still runs, with the default voice
                    clock.say(f"could not create a library voice ({e}); live runs with the default voice")
            summary["live_reference_id"] = reference_id
            if not skip_serve:
                summary["phases"]["serve"] = run_phase("bench serve", serve_command(p, url, out),
                                                       p.serve_budget_s, clock)
            if not skip_live:
                summary["phases"]["live"] = run_phase("bench live", live_command(p, url, out, reference_id),
                                                      p.live_budget_s, clock)
            scrape_metrics(url, out / "metrics.prom")
            summary["gpu_after"] = gpu_info()
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - reported; SIGTERM lands here too
            summary["error"] = str(e) or type(e).__name__
            clock.say(f"FAILED: {e}")
        finally:
            summary["server_exit"] = stop_server(proc, clock)
            clock.say(f"server stopped (exit {summary['server_exit']})")
    summary["total_s"] = round(clock.elapsed, 1)
    summary["serve"] = headline(out / "serve.json", SERVE_COLUMNS) if not skip_serve else None
    summary["live"] = headline(out / "live.json", LIVE_COLUMNS) if not skip_live else None
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if not skip_serve:
        print_table("bench serve (POST /v1/tts)", summary["serve"], SERVE_COLUMNS)
    if not skip_live:
        print_table("bench live (WS /v1/tts/live)", summary["live"], LIVE_COLUMNS)
    clock.say(f"done in {summary['total_s']:.0f} s; wrote {out}/summary.json")
    return summary


def failed(summary: dict) -> bool:
    return "error" in summary or any(ph.get("exit") not in (None, 0) for ph in summary["phases"].values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.serve_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output directory (serve.json/png, live.json/png, server.log, metrics.prom, "
                                "summary.json)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick",
                    help="quick (default; ~5 min on an H200), full, smoke (tiny model, CPU)")
    ap.add_argument("--quick", action="store_const", const="quick", dest="profile", help="= --profile quick")
    ap.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    ap.add_argument("--device", default=None, help="server --device (default: auto)")
    ap.add_argument("--deadline-s", type=float, default=None, help="overall limit (default: the profile's)")
    ap.add_argument("--skip-serve", action="store_true", help="only the live sweep")
    ap.add_argument("--skip-live", action="store_true", help="only the HTTP sweep")
    args = ap.parse_args(argv)
    p = PROFILES[args.profile]
    if args.deadline_s is not None:
        p = Profile(**{**asdict(p), "deadline_s": args.deadline_s})

    def on_term(signum, frame):  # run() stops the server and still writes summary.json
        raise KeyboardInterrupt(f"interrupted by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    summary = run(Path(args.out), p, profile_name=args.profile, port=args.port, device=args.device,
                  skip_live=args.skip_live, skip_serve=args.skip_serve)
    return 1 if failed(summary) else 0


if __name__ == "__main__":
    sys.exit(main())
