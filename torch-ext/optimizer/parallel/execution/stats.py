"""Timing and traffic of the last step's Muon pipeline (``Muon.last_step_stats``)."""

from __future__ import annotations

import time

import torch

STAGES = ("gather", "orthogonalize", "scatter", "exchange", "update", "qk_clip")


class PipelineStats:
    """Per-stage seconds and bytes of the last step.

    On CUDA the stages are bracketed by events on the current stream and
    ``seconds`` waits for them when read (never during the step); on CPU they are
    ``perf_counter`` intervals.
    """

    def __init__(self, device: torch.device | None = None):
        self._cuda = device is not None and device.type == "cuda"
        self._seconds = {k: 0.0 for k in STAGES}
        self._events: list[tuple[str, object, object]] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.matrices = 0  # distributed jobs this step (every owner's), plus local units
        self.owned = 0  # jobs this rank orthogonalised
        self.chunks = 0
        self.all_to_alls = 0
        self.all_gathers = 0
        self.split_units = 0  # blocks of cut units this rank orthogonalised with their group (ns_split)
        self.split_bytes = 0  # what this rank sent in their collectives (modelled; = received)
        self.moved_units = 0  # units (or blocks) held whole by another rank that this rank orthogonalised

    @property
    def seconds(self) -> dict[str, float]:
        for stage, start, end in self._events:
            end.synchronize()
            self._seconds[stage] += start.elapsed_time(end) / 1e3
        self._events.clear()
        return dict(self._seconds)

    def time(self, stage: str) -> "_Span":
        return _Span(self, stage)


class _Span:
    def __init__(self, stats: PipelineStats, stage: str):
        self.stats, self.stage = stats, stage

    def __enter__(self):
        if self.stats._cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.stats._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats._events.append((self.stage, self.start, end))
        else:
            self.stats._seconds[self.stage] += time.perf_counter() - self.start
        return False
