"""GPU consistency check: the engine (CUDA graphs, paged Triton attention) against the plain
reference loop, on a small random model in fp32 and at S2-Pro shapes in bf16.

    python -m shoal.bench.engine_check
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from ..engine.engine import Engine, EngineConfig
from ..engine.generate import generate
from ..engine.request import EngineRequest, FinishEvent, GridSession
from ..engine.sampling import SamplingParams
from .random_model import S2_IM_END, random_dualar, random_prompt, s2_pro_config, tiny_config


def check(cfg, dtype, n_requests: int, frames: int, label: str) -> bool:
    dev = torch.device("cuda")
    model = random_dualar(cfg, dev, dtype, seed=1)
    # sharpen the random model's logits so greedy decisions have margins (as the golden models do)
    model.norm.weight.fill_(28.0)
    model.fast_norm.weight.fill_(28.0)
    rng = np.random.default_rng(0)
    prompts = [random_prompt(cfg, 40 + 7 * i, 30 + 5 * i, rng) for i in range(n_requests)]
    params = [SamplingParams(greedy=True) if i % 2 else SamplingParams(temperature=0.8, top_p=0.8, top_k=30)
              for i in range(n_requests)]
    t = time.perf_counter()
    want = [generate(model, g, p, S2_IM_END, frames, seed=i).codes for i, (g, p) in enumerate(zip(prompts, params))]
    t_ref = time.perf_counter() - t
    eng = Engine(model, S2_IM_END, config=EngineConfig(max_running=8, max_seq_len=1024, prefill_chunk=64,
                                                       num_blocks=512))
    eng.warmup(show_progress=False)
    for i, (g, p) in enumerate(zip(prompts, params)):
        eng.add_request(EngineRequest(session=GridSession(g), params=p, seed=i, max_new_tokens=frames,
                                      ignore_eos=True, request_id=str(i)))
    t = time.perf_counter()
    got = {int(e.request_id): e.codes for e in eng.run_until_done() if isinstance(e, FinishEvent)}
    t_eng = time.perf_counter() - t
    ok = True
    agree = []
    for i in range(n_requests):
        same = got[i].shape == want[i].shape and np.array_equal(got[i], want[i])
        n = min(got[i].shape[1], want[i].shape[1])
        first_diff = next((f for f in range(n) if not np.array_equal(got[i][:, f], want[i][:, f])), n)
        agree.append(first_diff)
        ok &= same
    print(f"{label}: engine==reference for {sum(a == frames for a in agree)}/{n_requests} requests; "
          f"frames agreeing before first difference: {agree}; ref {t_ref:.1f}s engine {t_eng:.1f}s",
          flush=True)
    return ok


def main() -> int:
    ok = check(tiny_config(), torch.float32, 8, 48, "tiny fp32")
    check(s2_pro_config(4096), torch.bfloat16, 4, 24, "S2-Pro bf16 (bf16 may diverge at near-ties)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
