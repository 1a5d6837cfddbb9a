"""A CUDA stream confined to a share of the GPU's SMs (a CUDA green context).

The engine's codec runs on its own stream beside the LLM's decode steps. Stream priority only
orders the blocks waiting for an SM; once the codec's compute-bound convolution blocks hold
the SMs, the memory-bound decode kernels queue behind them. A green context splits the device's
SMs: work on its streams runs on at most ``num_sms`` of them, while work on ordinary streams
may still use every SM. So the codec can never take more than its share, and the decode step
always has the rest.

Built on the CUDA driver API (``cuDevSmResourceSplitByCount`` -> ``cuDevResourceGenerateDesc``
-> ``cuGreenCtxCreate`` -> ``cuGreenCtxStreamCreate``, CUDA 12.5+ drivers) through ctypes, so
it does not depend on the PyTorch version's green-context wrapper; the stream is handed to
PyTorch as a :class:`torch.cuda.ExternalStream`. The driver rounds ``num_sms`` to the
architecture's partition granularity (on Hopper, multiples of 8); :attr:`SMPartition.sm_count`
is what it granted. A green context lives as long as the process (streams must not outlive it).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

__all__ = ["SMPartition", "SMPartitionError", "sm_partition"]

_CU_DEV_RESOURCE_TYPE_SM = 1
_CU_GREEN_CTX_DEFAULT_STREAM = 0x1
_CU_STREAM_NON_BLOCKING = 0x1
# sizeof(CUdevResource) is 144 bytes in CUDA 12.4-13.x (type, 92 bytes of padding, a 48-byte
# union whose first member is the SM resource; 13.x ends with a next pointer inside that
# size); the buffers are oversized so a larger future layout is never overrun
_RESOURCE_BYTES = 512
_SM_COUNT_OFFSET = 96  # CUdevResource.sm.smCount

_lock = threading.Lock()
_cache: dict[tuple[int, int], "SMPartition"] = {}


class SMPartitionError(RuntimeError):
    """The driver (or this machine) cannot make the partition."""


@dataclass
class SMPartition:
    device: torch.device
    requested_sms: int
    sm_count: int  # granted by the driver
    total_sms: int
    green_ctx: int  # CUgreenCtx handle (kept for the process lifetime)
    _streams: list  # the ExternalStreams made so far

    def stream(self, priority: int = 0) -> torch.cuda.ExternalStream:
        """A new non-blocking stream whose kernels run on this partition's SMs."""
        cu = _driver()
        handle = ctypes.c_void_p()
        _check(cu, cu.cuGreenCtxStreamCreate(ctypes.byref(handle), ctypes.c_void_p(self.green_ctx),
                                             ctypes.c_uint(_CU_STREAM_NON_BLOCKING), ctypes.c_int(priority)),
               "cuGreenCtxStreamCreate")
        s = torch.cuda.ExternalStream(handle.value, device=self.device)
        self._streams.append(s)
        return s


_cu = None


def _driver():
    global _cu
    if _cu is None:
        try:
            _cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise SMPartitionError(f"no CUDA driver library: {e}") from e
    return _cu


def _check(cu, rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        try:
            cu.cuGetErrorString(rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else ""
        except Exception:  # noqa: BLE001 - the error code alone is still useful
            text = ""
        raise SMPartitionError(f"{what} failed: CUDA error {rc} {text}".strip())


def sm_partition(device: torch.device | str | int, num_sms: int) -> SMPartition:
    """The (cached) partition of ``num_sms`` SMs of ``device``. Raises :class:`SMPartitionError`
    when the driver lacks green contexts or the count is not possible."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SMPartitionError("SM partitions need a CUDA device")
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not 1 <= num_sms < total:
        raise SMPartitionError(f"an SM partition needs 1 <= num_sms < {total} (the device's SMs), got {num_sms}")
    key = (index, int(num_sms))
    with _lock:
        if key in _cache:
            return _cache[key]
        torch.cuda.init()
        torch.zeros(1, device=device)  # the primary context exists and is current
        cu = _driver()
        for name in ("cuDeviceGetDevResource", "cuDevSmResourceSplitByCount", "cuDevResourceGenerateDesc",
                     "cuGreenCtxCreate", "cuGreenCtxStreamCreate"):
            if not hasattr(cu, name):
                raise SMPartitionError(f"the CUDA driver has no {name} (green contexts need a 12.5+ driver)")
        dev = ctypes.c_int()
        _check(cu, cu.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)), "cuDeviceGet")
        whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
        _check(cu, cu.cuDeviceGetDevResource(dev, whole, ctypes.c_int(_CU_DEV_RESOURCE_TYPE_SM)),
               "cuDeviceGetDevResource")
        group = ctypes.create_string_buffer(_RESOURCE_BYTES)
        rest = ctypes.create_string_buffer(_RESOURCE_BYTES)
        n_groups = ctypes.c_uint(1)
        _check(cu, cu.cuDevSmResourceSplitByCount(group, ctypes.byref(n_groups), whole, rest,
                                                  ctypes.c_uint(0), ctypes.c_uint(num_sms)),
               "cuDevSmResourceSplitByCount")
        if n_groups.value != 1:
            raise SMPartitionError(f"the driver made {n_groups.value} SM groups of {num_sms}, not 1")
        granted = int.from_bytes(group.raw[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 4], "little")
        desc = ctypes.c_void_p()
        _check(cu, cu.cuDevResourceGenerateDesc(ctypes.byref(desc), group, ctypes.c_uint(1)),
               "cuDevResourceGenerateDesc")
        gctx = ctypes.c_void_p()
        _check(cu, cu.cuGreenCtxCreate(ctypes.byref(gctx), desc, dev, ctypes.c_uint(_CU_GREEN_CTX_DEFAULT_STREAM)),
               "cuGreenCtxCreate")
        part = SMPartition(device, int(num_sms), granted, total, gctx.value, [])
        _cache[key] = part
        return part
