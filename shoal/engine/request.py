"""Engine requests, their lifecycle and the events they produce."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum

import numpy as np

from ..text.prompt import PromptSession
from .audio import ChunkSchedule
from .sampling import SamplingParams


class Priority(IntEnum):
    """Lower value = more urgent. Preemption takes from the least urgent first."""

    REALTIME = 0
    INTERACTIVE = 1
    BATCH = 2

    @classmethod
    def parse(cls, value: "str | int | Priority") -> "Priority":
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown priority {value!r}; use realtime, interactive or batch") from None
        return cls(value)


class Status(Enum):
    WAITING = "waiting"  # queued: no KV blocks
    PREFILL = "prefill"  # admitted, prompt partly computed
    DECODE = "decode"  # in the decode batch
    FINISHED = "finished"


@dataclass
class FramesEvent:
    request_id: str
    codes: np.ndarray  # int64 [10, n]: new frames, in order
    batch_index: int  # text batch the frames belong to


@dataclass
class AudioEvent:
    request_id: str
    pcm: np.ndarray  # float32 mono
    sample_rate: int


@dataclass
class FinishEvent:
    request_id: str
    reason: str  # "eos" | "length" | "cancelled" | "error"
    codes: np.ndarray  # int64 [10, frames]: every frame of every text batch
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None


Event = FramesEvent | AudioEvent | FinishEvent

_ids = itertools.count()


@dataclass(eq=False)  # identity semantics: requests live in lists and dicts
class EngineRequest:
    """One synthesis request: a prompt session (one or more text batches) and its settings."""

    session: PromptSession
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    max_new_tokens: int = 1024  # frames per text batch; 0 = up to the context limit
    priority: Priority = Priority.INTERACTIVE
    stream_audio: bool = False
    audio_schedule: ChunkSchedule | None = None  # audio chunk sizes; None = the engine's
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    ignore_eos: bool = False  # benchmarks: <|im_end|> does not stop (its frame counts)
    prefill_only: bool = False  # compute the prompt's K/V into the prefix cache, then finish


    # ------------------------------------------------------------------ runtime state
    status: Status = Status.WAITING
    arrival: float = field(default_factory=time.perf_counter)
    batch_index: int = 0
    grid: np.ndarray | None = None  # current batch: prompt + generated columns so far
    prompt_len: int = 0  # prompt length of the current batch
    num_computed: int = 0  # grid columns whose K/V are in the cache
    budget: int = 0  # frames allowed for the current batch
    new_columns: list[np.ndarray] = field(default_factory=list)  # current batch
    frames_total: int = 0  # frames generated over all batches (noise counter)
    ras_window: list[int] = field(default_factory=list)  # allowed-space main-token indices
    all_codes: list[np.ndarray] = field(default_factory=list)
    slot: int | None = None
    last_input: np.ndarray | None = None  # the column the next decode step consumes
    # decode steps launched on the device whose columns the host has not read yet (the engine
    # keeps one step in flight); ``decode_gen`` changes whenever such columns become stale
    # (preemption, end of a text batch, finish), so the engine drops them on arrival
    pending: int = 0
    decode_gen: int = 0
    preemptions: int = 0
    cancelled: bool = False
    first_frame_time: float | None = None
    first_audio_time: float | None = None
    finish_time: float | None = None

    def current_frames(self) -> int:
        return len(self.new_columns)

    def wants_frame(self) -> bool:
        """Whether another decode step may be launched: frames known + in flight < budget."""
        return len(self.new_columns) + self.pending < self.budget

    def invalidate_pending(self) -> None:
        """Columns still in flight no longer belong to this request's current state."""
        self.pending = 0
        self.decode_gen += 1


class GridSession:
    """A prompt given directly as a token grid (benchmarks, pre-built prompts): one batch."""

    family = "grid"

    def __init__(self, grid: np.ndarray) -> None:
        self._grid = np.asarray(grid, dtype=np.int64)
        self.batches = ["<grid>"]
        self.generated: list[np.ndarray] = []

    def grid(self) -> np.ndarray:
        if self.generated:
            raise RuntimeError("session is done")
        return self._grid

    def commit(self, codes: np.ndarray) -> None:
        self.generated.append(codes)

    def done(self) -> bool:
        return bool(self.generated)
