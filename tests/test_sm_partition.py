"""SM partitions (CUDA green contexts) for the codec's stream.

On CPU: the partition is refused with a clear error and the audio worker falls back. On a GPU:
work on a partition stream is correct (PyTorch ops, a Triton kernel, a CUDA-graph replay) and is
confined to the partition: a compute-bound GEMM on a few SMs takes several times longer than on
the whole device (a loose bound: it checks the confinement, not a speed)."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.sm_partition import SMPartitionError, sm_partition

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_is_refused_clearly():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(SMPartitionError, match="CUDA"):
        sm_partition("cpu", 16)


def test_audio_worker_without_cuda_ignores_the_partition():
    from shoal.engine.audio import AudioWorker

    class _Streamer:  # the worker only reads these before it is used
        sample_rate = 44100
        device = torch.device("cpu")

    w = AudioWorker(_Streamer(), threaded=False, sms=16)
    assert w.sms is None and w._cuda_stream is None


def _gemm_ms(a, b, stream, reps=5) -> float:
    with torch.cuda.stream(stream):
        a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


@cuda
def test_gpu_partition_bounds():
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(SMPartitionError):
        sm_partition(0, total)
    with pytest.raises(SMPartitionError):
        sm_partition(0, 0)


@cuda
def test_gpu_partition_stream_is_correct_and_confined():
    try:
        part = sm_partition(0, 16)
    except SMPartitionError as e:
        pytest.skip(f"no green contexts here: {e}")
    assert 1 <= part.sm_count <= part.total_sms
    s = part.stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ref = a @ b
    with torch.cuda.stream(s):
        out = a @ b
    s.synchronize()
    assert torch.equal(out, ref)
    full = _gemm_ms(a, b, torch.cuda.Stream())
    confined = _gemm_ms(a, b, s)
    # 16 of ~132 SMs: ~8x the time when confined; 2x is the loosest sign of confinement
    assert confined > 2.0 * full, (confined, full, part.sm_count)

    # a CUDA graph captured on the partition stream (a graph runs on the SMs of the stream
    # it was captured on, not of the one that replays it: measured on an H200, 2026-12-01)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        y = a @ b
    s.synchronize()
    with torch.cuda.graph(g, stream=s):
        y = a @ b
    with torch.cuda.stream(s):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
    end.synchronize()
    assert torch.equal(y, ref)
    assert start.elapsed_time(end) > 2.0 * full


@cuda
def test_gpu_triton_kernel_on_partition_stream():
    try:
        s = sm_partition(0, 16).stream()
    except SMPartitionError as e:
        pytest.skip(f"no green contexts here: {e}")
    from shoal.kernels.snake import snake_ref, snake_triton

    x = torch.randn(4, 96, 4096, device="cuda", dtype=torch.bfloat16)
    alpha = torch.rand(96, device="cuda", dtype=torch.float32) + 0.5
    with torch.cuda.stream(s):
        y, _ = snake_triton(x, alpha)
    s.synchronize()
    torch.testing.assert_close(y.float(), snake_ref(x, alpha)[0].float(), atol=2e-2, rtol=2e-2)
