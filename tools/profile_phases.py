"""Where a phase's time goes: one call of it under torch.profiler, reduced to the share of the wall clock the
device was busy and the operators that took the most time. A phase whose device is busy for most of its wall
clock is bound by its kernels (the top rows say which); one whose device waits is bound by the host (Python,
kernel launches: the rows' CPU times and launch counts say where).

tools.bench_size calls `profile_phase` for each phase at one prefix length (`--profile TOKENS`) and writes
`markdown`'s tables as profile.md, with each phase's Chrome trace (trace_<phase>.json.gz) beside it.
"""
from __future__ import annotations

import gzip
import re
import shutil
import time
from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from scd.evaluation import methods

TOP = 12
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _busy_ms(events) -> float:
    """Milliseconds in which at least one kernel ran: the union of the device events' intervals."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type != DeviceType.CPU)
    total, until = 0, None
    for a, b in spans:
        if until is None or a > until:
            total += b - a
            until = b
        elif b > until:
            total += b - until
            until = b
    return total / 1e3


def _rows(ops, device: bool, top: int) -> list[dict]:
    """The `top` operators by their own time: kernels by device time (device=True), host operators by CPU time."""
    if device:
        chosen = sorted((e for e in ops if e.device_type != DeviceType.CPU), key=lambda e: e.device_time_total,
                        reverse=True)
        return [{"op": e.key, "calls": e.count, "ms": e.device_time_total / 1e3} for e in chosen[:top]]
    chosen = sorted((e for e in ops if e.device_type == DeviceType.CPU), key=lambda e: e.self_cpu_time_total,
                    reverse=True)
    return [{"op": e.key, "calls": e.count, "ms": e.self_cpu_time_total / 1e3} for e in chosen[:top]]


def profile_phase(name: str, fn, device: str, trace_dir: Path | None = None, top: int = TOP) -> dict:
    """One warm-up call of fn, then one call under the profiler. Returns the wall milliseconds; on a GPU the
    milliseconds in which a kernel ran, the kernel launches (a replayed CUDA graph counts one) and the `top`
    kernels by device time; everywhere the `top` host operators by their own CPU time."""
    cuda = device.startswith("cuda")
    fn()
    methods.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        fn()
        methods.sync()
        wall_ms = (time.perf_counter() - t) * 1e3
    ops = prof.key_averages()
    busy_ms = _busy_ms(prof.events()) if cuda else None
    out = {"phase": name, "wall_ms": wall_ms, "device_busy_ms": busy_ms,
           "busy_share": busy_ms / wall_ms if busy_ms is not None and wall_ms > 0 else None,
           "launches": sum(e.count for e in ops if e.key in LAUNCHES) if cuda else None,
           "kernels": _rows(ops, True, top) if cuda else [], "host": _rows(ops, False, top)}
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        raw = trace_dir / f"trace_{_slug(name)}.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        out["trace"] = f"{raw.name}.gz"
    return out


def markdown(phases: list[dict]) -> str:
    """One summary table (wall, device busy, launches per phase), then each phase's top operators."""
    lines = ["| phase | wall ms | device busy ms | busy / wall | kernel launches |",
             "|---|---|---|---|---|"]
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    for p in phases:
        lines.append(f"| {p['phase']} | {p['wall_ms']:.1f} | {fmt(p['device_busy_ms'], '.1f')} | "
                     f"{fmt(p['busy_share'], '.2f')} | {fmt(p['launches'], 'd')} |")
    for p in phases:
        lines += ["", f"**{p['phase']}**" + (f" (trace: {p['trace']})" if p.get("trace") else "")]
        for what, rows in (("kernel", p["kernels"]), ("host operator (self CPU time)", p["host"])):
            if rows:
                lines += ["", f"| {what} | calls | ms |", "|---|---|---|"]
                lines += [f"| `{r['op'][:70]}` | {r['calls']} | {r['ms']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"
