"""Delivery time of a payload by transport, payload sizes side by side in one run.

    python -m tools.bench_transport [--sizes-mb 0.1,1,10,50] [--repeats 10] [--json out.json]

A sender actor offers a payload through the product's transport (`actors.transport`) and a receiver actor, in
another process, receives it through its end of that transport, as a specialist replica does; the time is the
receiver's, from asking to holding the payload (on a GPU: after the copy has finished on the device). Medians
over --repeats after one warm-up per size. Backends:
  object_store   bytes put in Ray's object store by the sender, fetched by the receiver (host memory)
  nixl (host)    a `codec.Wire` whose body is a host tensor, pulled through Ray Direct Transport (UCX)
  nixl (cuda)    the same with the body in the sender's GPU memory, landing in the receiver's (GPU only)
  cuda_ipc       the receiver maps the sender's GPU memory and copies it once (GPU only; one GPU shared)
Encode and decode are not in these times (`scd bench` measures those).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import torch

from actors.transport import make_transport
from scd.online.codec import Wire


@ray.remote(max_concurrency=4)
class Sender:
    def __init__(self, kind: str):
        self.kind, self.t = kind, make_transport(kind, inline_bytes=0)      # every size by the transport itself

    def offer(self, nbytes: int, device: str):
        body = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        payload = body.numpy().tobytes() if self.kind == "object_store" else Wire(b"bench", body)
        return self.t.offer(payload)

    @ray.method(tensor_transport="nixl")
    def pull(self, key: str):
        return self.t.take(key)

    @ray.method(tensor_transport="cuda_ipc")
    def pull_ipc(self, key: str):
        return self.t.take(key)


@ray.remote(max_concurrency=4)
class Receiver:
    def __init__(self, kind: str, sender):
        self.r = make_transport(kind).receiver(lambda name: sender, 120.0)

    def receive(self, ticket) -> tuple[float, str]:
        t0 = time.perf_counter()
        got = self.r.receive(ticket)
        where = str(got.body.device) if isinstance(got, Wire) else "host bytes"
        if where.startswith("cuda"):
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3, where


def backends() -> list[tuple[str, str, str]]:
    """(label, transport, device of the payload) runnable here."""
    import importlib.util
    has_nixl, has_cuda = importlib.util.find_spec("nixl") is not None, torch.cuda.is_available()
    out = [("object_store", "object_store", "cpu")]
    if has_nixl:
        out.append(("nixl (host)", "nixl", "cpu"))
    if has_nixl and has_cuda:
        out.append(("nixl (cuda)", "nixl", "cuda"))
    if has_cuda:
        out.append(("cuda_ipc", "cuda_ipc", "cuda"))
    return out


def measure(sizes_mb: list[float], repeats: int) -> list[dict]:
    gpus = 0.25 if torch.cuda.is_available() else 0
    rows = []
    for label, kind, device in backends():
        s = Sender.options(num_gpus=gpus if device == "cuda" else 0).remote(kind)
        r = Receiver.options(num_gpus=gpus if device == "cuda" else 0).remote(kind, s)
        for mb in sizes_mb:
            nbytes = int(mb * 1e6)
            times, where = [], ""
            for i in range(repeats + 1):                      # the first is the warm-up (agents, registration)
                ms, where = ray.get(r.receive.remote(ray.get(s.offer.remote(nbytes, device))))
                if i:
                    times.append(ms)
            med = statistics.median(times)
            rows.append({"backend": label, "mb": mb, "median_ms": round(med, 3), "min_ms": round(min(times), 3),
                         "gb_per_s": round(nbytes / med / 1e6, 2), "arrived": where})
            print(f"{label:14s} {mb:7.1f} MB  median {med:9.3f} ms  min {min(times):9.3f} ms  "
                  f"{nbytes / med / 1e6:7.2f} GB/s  ({where})", flush=True)
        ray.kill(s)
        ray.kill(r)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", default="0.1,1,10,50")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", help="write the rows here as well")
    args = ap.parse_args(argv)
    try:
        sizes = [float(x) for x in args.sizes_mb.split(",")]
    except ValueError:
        raise SystemExit(f"--sizes-mb takes numbers separated by commas, got {args.sizes_mb!r}") from None
    if any(s <= 0 for s in sizes) or args.repeats < 1:
        raise SystemExit("sizes and --repeats must be positive")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
        print(f"transport delivery, {device}, medians of {args.repeats}", flush=True)
        rows = measure(sizes, args.repeats)
    finally:
        if started:
            ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
