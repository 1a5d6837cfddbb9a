"""Streaming audio for the engine: frames in, PCM chunks out, batched across requests.

Each streaming request owns a row of one batched :class:`StreamingDecoder` state (carried conv
contexts and windowed-attention KV), so every frame is decoded exactly once. The first chunk of
a request leaves after ``ChunkSchedule.first`` frames; later chunks grow geometrically up to
``max_frames`` (small first chunk = low time to first audio; large later chunks = efficient
batched decode). Requests whose next chunk has the same size are decoded in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..codec import StreamingDecoder


@dataclass(frozen=True)
class ChunkSchedule:
    first: int = 4  # frames in the first audio chunk (4 frames = 186 ms of audio)
    growth: float = 2.0
    max_frames: int = 32

    def size(self, index: int) -> int:
        return int(min(self.max_frames, max(1, round(self.first * self.growth ** index))))

    def validate(self) -> None:
        if self.first < 1 or self.max_frames < self.first or self.growth < 1.0:
            raise ValueError("chunk schedule needs 1 <= first <= max_frames and growth >= 1")


class AudioStreamer:
    def __init__(self, codec, max_streams: int, schedule: ChunkSchedule = ChunkSchedule()) -> None:
        schedule.validate()
        self.codec = codec
        self.schedule = schedule
        self.decoder = StreamingDecoder(codec)
        self.sample_rate = codec.sample_rate
        self.device = next(codec.parameters()).device
        self.state = self.decoder.new_state(max_streams)
        self.free_rows = list(range(max_streams - 1, -1, -1))
        self.rows: dict[str, int] = {}
        self.pending: dict[str, list[np.ndarray]] = {}
        self.chunks: dict[str, int] = {}
        self.schedules: dict[str, ChunkSchedule] = {}

    def _row(self, rid: str, schedule: ChunkSchedule | None = None) -> int:
        row = self.rows.get(rid)
        if row is None:
            if not self.free_rows:
                raise RuntimeError("no free audio stream rows")
            row = self.free_rows.pop()
            self.state.reset_([row])
            self.rows[rid] = row
            self.pending[rid] = []
            self.chunks[rid] = 0
            self.schedules[rid] = schedule or self.schedule
        return row

    def push(self, rid: str, frames: np.ndarray, schedule: ChunkSchedule | None = None) -> None:
        """Queue frames of ``rid``; ``schedule`` (first push only) overrides the default."""
        self._row(rid, schedule)
        self.pending[rid].append(frames)

    def _decode(self, rids: list[str], n: int) -> list[np.ndarray]:
        rows = [self.rows[r] for r in rids]
        codes = []
        for r in rids:
            buf = np.concatenate(self.pending[r], axis=1)
            codes.append(buf[:, :n])
            rest = buf[:, n:]
            self.pending[r] = [rest] if rest.shape[1] else []
        batch = torch.as_tensor(np.stack(codes), dtype=torch.long, device=self.device)
        index = torch.tensor(rows, device=self.device)
        sub = self.state.select(index)
        with torch.inference_mode():
            audio = self.decoder.decode_chunk(batch, sub)
        self.state.update_(index, sub)
        for r in rids:
            self.chunks[r] += 1
        pcm = audio[:, 0].float().cpu().numpy()
        return [pcm[i] for i in range(len(rids))]

    def decode_ready(self) -> list[tuple[str, np.ndarray]]:
        """Decode every stream whose next chunk is complete; one codec call per chunk size."""
        by_size: dict[int, list[str]] = {}
        for rid, frames in self.pending.items():
            have = sum(f.shape[1] for f in frames)
            need = self.schedules[rid].size(self.chunks[rid])
            if have >= need:
                by_size.setdefault(need, []).append(rid)
        out: list[tuple[str, np.ndarray]] = []
        for n, rids in sorted(by_size.items()):
            out.extend(zip(rids, self._decode(rids, n)))
        return out

    def finish(self, rid: str) -> np.ndarray | None:
        """Decode whatever is left for ``rid`` and release its row."""
        if rid not in self.rows:
            return None
        have = sum(f.shape[1] for f in self.pending[rid])
        pcm = self._decode([rid], have)[0] if have else np.zeros(0, np.float32)
        self.free_rows.append(self.rows.pop(rid))
        self.pending.pop(rid, None)
        self.chunks.pop(rid, None)
        self.schedules.pop(rid, None)
        return pcm

    def release(self, rid: str) -> None:
        if rid in self.rows:
            self.free_rows.append(self.rows.pop(rid))
            self.pending.pop(rid, None)
            self.chunks.pop(rid, None)
            self.schedules.pop(rid, None)
