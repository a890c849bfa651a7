"""Every plan kind timed at a model size, side by side in one process: a timing family (scd/online/shapes.py:
a real architecture's shape, random weights) against the specialist's own prefill. Timing-only: the weights
and artifacts are random, so only the times and bytes mean anything.

    python -m tools.bench_size --shape llama-3.1-8b --tokens 4096,16384,32768 --out OUT   # on a GPU
    python -m tools.bench_size --shape tiny --tokens 256,512                              # CPU rehearsal

For each prefix length and each plan kind of jobs.timing_family (codes, blocks at 2/3 and 1/3, exact at half,
aLoRA): the oracle's prefill, the producer's prefill and encode, the payload as sent (and over the raw bf16 KV),
the consumer's side, time to first token modeled at 25, 100 and 400 Gbps with the prefix cold (the producer
prefills) and cached (the producer holds it), and a fan-out of 4 and 8 specialists' device time against as
many own prefills (cli.bench's measure, fanout, ttft). Writes size.md and size.json under --out.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cli.bench import fanout, measure, ttft
from jobs.timing_family import PLAN_KINDS, random_artifact
from scd.online import shapes
from scd.online.models import ModelSpec

GBPS = (25.0, 100.0, 400.0)
FANOUT = (4, 8)


def attention_kernel(model, device: str) -> str:
    """The attention implementation the model runs, and on a GPU the scaled-dot-product backends torch may pick."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if not device.startswith("cuda") or impl != "sdpa":
        return impl
    b = torch.backends.cuda
    on = [n for n, f in (("flash", b.flash_sdp_enabled), ("mem_efficient", b.mem_efficient_sdp_enabled),
                         ("cudnn", b.cudnn_sdp_enabled), ("math", b.math_sdp_enabled)) if f()]
    return f"sdpa ({', '.join(on)} enabled; torch picks the first that fits)"


def run(shape: str, tokens: list[int], repeats: int, device: str) -> dict:
    producer, tok = shapes.build(f"{shapes.SCHEME}{shape}", device)
    consumer, _ = shapes.build(f"{shapes.SCHEME}{shape}?seed=1", device)
    spec = ModelSpec.from_config(producer.config)
    arts = {k: random_artifact(k, f"base:{k}", spec, len(tok)).to(device) for k in PLAN_KINDS}
    g = torch.Generator().manual_seed(0)
    out = {"shape": shape, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
           "dtype": str(producer.dtype), "attention": attention_kernel(consumer, device), "timing_only": True,
           "date": time.strftime("%Y-%m-%d"), "rows": []}
    for t in tokens:
        ids = torch.randint(len(tok), (1, t), generator=g).to(device)
        for kind, art in arts.items():
            m = measure(producer, consumer, art, ids, repeats)
            s = m["methods"]["scd"]
            raw = spec.kv_bytes_per_token * t
            cold, warm = ttft(m, list(GBPS)), ttft(m, list(GBPS), prefilled=True)
            out["rows"].append({
                "tokens": t, "kind": kind, "oracle_ms": m["prefill_ms"], "producer_prefill_ms": m["producer_prefill_ms"],
                "encode_ms": s["producer_ms"], "consumer_ms": s["consumer_ms"], "payload_bytes": s["payload_bytes"],
                "payload_ratio": s["payload_bytes"] / raw,
                "ttft_cold_ms": dict(zip(GBPS, cold["scd"])), "ttft_cached_ms": dict(zip(GBPS, warm["scd"])),
                "fanout": {r["n"]: r["ratio"] for r in fanout(m, list(FANOUT))}})
    return out


def markdown(r: dict) -> str:
    lines = [f"### {r['shape']} on {r['device']} ({r['dtype']}), {r['date']}: timing-only (random weights)",
             "", f"Attention: {r['attention']}.", "",
             "| tokens | plan | oracle ms | producer prefill ms | encode ms | consumer ms | payload / raw KV | "
             + " | ".join(f"TTFT cached {g:g} Gbps / oracle" for g in GBPS) + " | "
             + " | ".join(f"fan-out {n} / {n} prefills" for n in FANOUT) + " |",
             "|" + "---|" * (7 + len(GBPS) + len(FANOUT))]
    for x in r["rows"]:
        lines.append(f"| {x['tokens']} | {x['kind']} | {x['oracle_ms']:.1f} | {x['producer_prefill_ms']:.1f} | "
                     f"{x['encode_ms']:.1f} | {x['consumer_ms']:.1f} | {x['payload_ratio']:.3f} | "
                     + " | ".join(f"{x['ttft_cached_ms'][g] / x['oracle_ms']:.3f}" for g in GBPS) + " | "
                     + " | ".join(f"{x['fanout'][n]:.3f}" for n in FANOUT) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools.bench_size", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=sorted(shapes.SHAPES))
    p.add_argument("--tokens", default="256,512", help="prefix lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="rounds after a warm-up one; medians are reported")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="folder for size.md and size.json")
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    context = shapes.SHAPES[args.shape]["max_position_embeddings"]
    if max(tokens) > context:
        p.error(f"--tokens {max(tokens)} is over the {args.shape} shape's context of {context}")
    with torch.inference_mode():
        r = run(args.shape, tokens, args.repeats, args.device)
    text = markdown(r)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "size.md").write_text(text)
        (out / "size.json").write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
