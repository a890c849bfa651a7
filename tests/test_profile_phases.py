"""tools.profile_phases: the device's busy time is the union of its kernels' intervals (overlapping kernels on
two streams count once), and the tables name each phase and its top operators."""
from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from tools.profile_phases import _busy_ms, markdown, profile_phase


def _event(device: DeviceType, start: int, end: int):
    return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_the_busy_time_is_the_union_of_the_kernels_intervals_and_host_events_do_not_count():
    events = [_event(DeviceType.CUDA, 0, 1000), _event(DeviceType.CUDA, 500, 1500),     # overlap: 1500 us
              _event(DeviceType.CUDA, 1200, 1300),                                      # inside: nothing more
              _event(DeviceType.CUDA, 3000, 3500),                                      # a gap, then 500 us
              _event(DeviceType.CPU, 0, 10_000)]                                        # host time: not busy
    assert _busy_ms(events) == 2.0, _busy_ms(events)
    assert _busy_ms([]) == 0.0


def test_a_profiled_phase_on_the_cpu_reports_its_host_operators_and_the_tables_show_them(tmp_path):
    import torch
    a = torch.randn(64, 64)
    p = profile_phase("two matmuls", lambda: (a @ a) @ a, "cpu", tmp_path)
    assert p["device_busy_ms"] is None and p["kernels"] == [] and p["wall_ms"] > 0, p
    assert any(r["op"] == "aten::mm" and r["calls"] == 2 for r in p["host"]), p["host"]
    assert (tmp_path / "trace_two_matmuls.json.gz").stat().st_size > 0
    md = markdown([p])
    assert "| two matmuls |" in md and "`aten::mm` | 2 |" in md, md
