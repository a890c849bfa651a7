"""A Ray actor that holds one model and returns its calibration traces (valid rows only, on CPU)."""
from __future__ import annotations

import ray
import torch

from cluster.runtime import cpu_threads, device
from scd.fitting.traces import trace_rows
from scd.online import activated
from scd.online.models import load
from scd.online.trace import capture


@ray.remote
class TraceActor:
    def __init__(self, model_path: str, side: str, base: str | None = None):
        torch.set_num_threads(cpu_threads())
        self.device = device()
        self.model, _, self.spec = load(model_path, base=base, device=self.device)
        activated.to(self.model, self.device)
        self.side = side                      # "a" producer, "b" consumer: the chunk's key prefix

    def rows(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        tr = capture(self.model, ids.to(self.device), mask.to(self.device))
        return {k: v.cpu() for k, v in trace_rows(tr, self.side).items()}

    def where(self) -> str:
        return self.device
