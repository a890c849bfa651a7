"""Every plan kind timed at a model size, side by side in one process: a timing family (scd/online/shapes.py:
a real architecture's shape, random weights) against the specialist's own prefill. Timing-only: the weights
and artifacts are random, so only the times and bytes mean anything.

    python -m tools.bench_size --shape llama-3.1-8b --tokens 4096,16384,32768 --out OUT   # on a GPU
    python -m tools.bench_size --shape tiny --tokens 256,512                              # CPU rehearsal

For each prefix length and each plan kind of jobs.timing_family (codes, blocks at 2/3 and 1/3, exact at half,
aLoRA): the oracle's prefill, the producer's prefill and encode, the payload as sent (and over the raw bf16 KV),
the consumer's side (the payload kept on the GPU, as served over cuda_ipc or nixl; host bytes on a CPU), time
to first token modeled at 25, 100 and 400 Gbps with the prefix cold (the producer prefills) and cached (the
producer holds it), and a fan-out of 4 and 8 specialists' device time against as many own prefills
(cli.bench's measure_methods, fanout, ttft). Then decode tokens/s at batch 1, 8 and 32 from a
cache of the first prefix length, rebuilt from codes and from the specialist's own prefill: the CPU engines'
step (decode.Batch: FastStep, the cache grown by a copy per token) and the GPU engines' (decode.StaticBatch:
static caches, each step shape replayed from a CUDA graph), against the limit memory bandwidth sets (the
weights and the KV read per step over the bandwidth a device-to-device copy reaches in this run). Writes
size.md and size.json under --out.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cli.bench import fanout, measure_methods, ttft
from jobs.timing_family import PLAN_KINDS, random_artifact
from scd.evaluation import methods
from scd.online import fast_decode, selective, shapes
from scd.online.api import GenParams
from scd.online.cache import cache_of
from scd.online.decode import Batch, Decoder, Row, StaticBatch
from scd.online.models import ModelSpec
from scd.online.trace import capture
from tools import profile_phases

GBPS = (25.0, 100.0, 400.0)
FANOUT = (4, 8)
BATCHES = (1, 8, 32)
DECODE_STEPS = 32
PAYLOAD = {"device": "kept on the device (codec.encode_wire: quantised and checksummed there, as a producer sends "
                     "them over cuda_ipc or nixl)",
           "host": "host bytes (codec.encode: quantised on the host, zstd, crc32, as over the object store)"}


def attention_kernel(model, device: str) -> str:
    """The attention implementation the model runs, and on a GPU the scaled-dot-product backends torch may pick."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if not device.startswith("cuda") or impl != "sdpa":
        return impl
    b = torch.backends.cuda
    on = [n for n, f in (("flash", b.flash_sdp_enabled), ("mem_efficient", b.mem_efficient_sdp_enabled),
                         ("cudnn", b.cudnn_sdp_enabled), ("math", b.math_sdp_enabled)) if f()]
    return f"sdpa ({', '.join(on)} enabled; torch picks the first that fits)"


def _timed(fn, n: int) -> float:
    """Seconds per call of fn, over n calls after one warm-up call."""
    fn()
    methods.sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    methods.sync()
    return (time.perf_counter() - t) / n


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves, counting what it reads and what it writes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), 5)


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every parameter but the input embedding (a step reads one
    row of it per token), unless the output head shares it."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p is not embed or p is head)


def engine_stepper(consumer, kv, b: int, steps: int):
    """A call that runs the CPU engines' decode step (FastStep, the cache grown by a copy per token) for b rows
    continuing the cache kv; every `steps` calls the rows go back to the prefix, so that every round is alike."""
    dev, base_len = kv[0][0].device, kv[0][0].shape[2]
    # the batch that b rows joining one by one make, built at once (joins copy the growing batch each time:
    # quadratic in b, minutes for 32 rows of a long cache at 8B)
    batch = Batch(keys=[k.expand(b, -1, -1, -1).contiguous() for k, _ in kv],
                  values=[v.expand(b, -1, -1, -1).contiguous() for _, v in kv],
                  mask=torch.ones(b, base_len, dtype=torch.long, device=dev),
                  pos=torch.full((b,), base_len, device=dev), adapters=torch.zeros(b, dtype=torch.long, device=dev))
    token = torch.zeros(b, dtype=torch.long, device=dev)

    def step():
        if batch.mask.shape[1] >= base_len + steps + 1:
            batch.keys = [k[:, :, :base_len] for k in batch.keys]
            batch.values = [v[:, :, :base_len] for v in batch.values]
            batch.mask, batch.pos = batch.mask[:, :base_len], batch.pos - (batch.mask.shape[1] - base_len)
        batch.step(consumer, token)
    return step


def _alike_rows(kv, b: int, steps: int, **row) -> tuple[int, list[Row]]:
    """(a static cache's capacity with room for two rounds of `steps` tokens, b rows continuing the cache kv
    that generate at most that many; `row`: the rows' other fields)."""
    params = GenParams(max_tokens=2 * steps + 2, ignore_eos=True)
    rows = [Row(keys=[k for k, _ in kv], values=[v for _, v in kv], params=params, **row) for _ in range(b)]
    return kv[0][0].shape[2] + 2 * steps + 4, rows


def static_stepper(consumer, kv, b: int, steps: int):
    """The engines' step on a GPU (decode.StaticBatch: static caches, each step shape captured in a CUDA graph
    at its first use) for b rows continuing the cache kv: (the StaticBatch, a call that runs one step)."""
    dev = kv[0][0].device
    capacity, rows = _alike_rows(kv, b, steps, logits=torch.zeros(1, device=dev))
    batch = StaticBatch(consumer, b, capacity, graphs=dev.type == "cuda")
    for row in rows:
        batch.join(row)
    token = torch.zeros(b, dtype=torch.long, device=dev)
    return batch, lambda: batch.step(consumer, token)


def loop_stepper(consumer, kv, b: int, steps: int):
    """One step of the engines' whole decode loop on this device (decode.Decoder: every row's pick, then the
    batch's step: static caches with CUDA graphs on a GPU) for b greedy rows continuing the cache kv."""
    dev = kv[0][0].device
    gpu = dev.type == "cuda"
    capacity, rows = _alike_rows(kv, b, steps, logits=torch.zeros(consumer.config.vocab_size, device=dev),
                                 on_token=lambda token, lp: True, on_done=lambda finish, n: None)
    dec = Decoder(consumer, eos_id=None, max_batch=b, static_capacity=capacity if gpu else None, graphs=gpu)
    dec.waiting.extend(rows)
    dec.admit()
    return dec.step


def decode_rates(consumer, kv_rebuilt, kv_own, batches, steps: int, bandwidth: float) -> list[dict]:
    """Tokens/s of a batch of rows continuing one cache (all rows alike), per batch size: the CPU engines' step
    from the rebuilt cache, the GPU engines' from the rebuilt cache and from the own prefill's, this device's
    engines' whole loop (each row's pick too) from the rebuilt cache, and the limit
    that memory bandwidth sets for that batch and cache length."""
    t = kv_rebuilt[0][0].shape[2]
    kv_token = sum(k[0, :, :1].numel() * k.element_size() * 2 for k, _ in kv_rebuilt)
    wbytes = weight_bytes(consumer)
    rows = []
    for b in batches:
        r = {"batch": b, "cache_tokens": t,
             "limit_tok_s": b / ((wbytes + b * (t + steps) * kv_token) / bandwidth)}
        r["engine_tok_s"] = (b / _timed(engine_stepper(consumer, kv_rebuilt, b, steps), steps)
                             if fast_decode.step_for(consumer) is not None else None)
        r["loop_tok_s"] = b / _timed(loop_stepper(consumer, kv_rebuilt, b, steps), steps)
        for name, kv in (("static_rebuilt_tok_s", kv_rebuilt), ("static_own_tok_s", kv_own)):
            batch, step = static_stepper(consumer, kv, b, steps)
            r[name] = b / _timed(step, steps)
            r["graph"] = bool(batch.st.graphs)
            del batch, step
        rows.append(r)
    return rows


def profile_request(producer, consumer, arts: dict, ids: torch.Tensor, device: str, trace_dir: Path | None,
                   steps: int = 8) -> list[dict]:
    """Each phase of a request at the prefix `ids` under the profiler (tools.profile_phases): the oracle's
    prefill, the producer's, every plan kind's encode and consumer side, and `steps` decode steps at batch 1
    from the rebuilt cache, by the CPU engines' step, by the GPU engines' (static caches) and by this device's
    engines' whole loop (each row's pick too)."""
    mask = torch.ones_like(ids)
    hidden = any(a.needs_hidden for a in arts.values())
    trace = capture(producer, ids, mask, want_hidden=hidden)
    reader = ids[:, -selective.WINDOW:]
    wire = device.startswith("cuda")
    built = lambda art: methods.built_for(methods.SCDMethod(art, wire=wire), consumer, ids, mask, trace,  # noqa: E731
                                          reader)
    phases = [("oracle prefill", lambda: capture(consumer, ids, mask, want_xnorm=False)),
              ("producer prefill", lambda: capture(producer, ids, mask, want_hidden=hidden))]
    phases += [(f"{kind}: encode + consumer side", lambda art=art: built(art)) for kind, art in arts.items()]
    out = [profile_phases.profile_phase(name, fn, device, trace_dir) for name, fn in phases]
    kv = built(arts["codes"]).kv
    del trace
    engine = engine_stepper(consumer, kv, 1, steps)
    _, static = static_stepper(consumer, kv, 1, steps)
    loop = loop_stepper(consumer, kv, 1, steps)
    for name, step in ((f"decode batch 1, dynamic batch x{steps}", engine),
                       (f"decode batch 1, static caches x{steps}", static),
                       (f"decode batch 1, the engines' whole loop x{steps}", loop)):
        out.append(profile_phases.profile_phase(name, lambda step=step: [step() for _ in range(steps)], device,
                                                trace_dir))
    return out


def run(shape: str, tokens: list[int], repeats: int, device: str, save=lambda r: None,
        profile_tokens: int | None = None, profile_dir: Path | None = None) -> dict:
    """Decode rates first (short), then a row per plan kind at each prefix length, shortest first, the kinds
    side by side round by round over one prefix (cli.bench.measure_methods); `save(out)` after each part, so
    that a run stopped at its time limit keeps what it measured. At `profile_tokens`, after
    its rows, every phase under the profiler (out["profile"], traces in profile_dir)."""
    producer, tok = shapes.build(f"{shapes.SCHEME}{shape}", device)
    consumer, _ = shapes.build(f"{shapes.SCHEME}{shape}?seed=1", device)
    spec = ModelSpec.from_config(producer.config)
    arts = {k: random_artifact(k, f"base:{k}", spec, len(tok)).to(device) for k in PLAN_KINDS}
    hidden = any(a.needs_hidden for a in arts.values())          # the producer's trace serves every kind
    g = torch.Generator().manual_seed(0)
    out = {"shape": shape, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
           "dtype": str(producer.dtype), "attention": attention_kernel(consumer, device), "timing_only": True,
           "payload": "device" if device.startswith("cuda") else "host",
           "date": time.strftime("%Y-%m-%d"), "rows": []}
    t0 = time.perf_counter()
    ids = torch.randint(len(tok), (1, tokens[0]), generator=g).to(device)
    mask = torch.ones_like(ids)
    trace = capture(producer, ids, mask, want_hidden=arts["codes"].needs_hidden)
    rebuilt = methods.SCDMethod(arts["codes"]).build(consumer, ids, mask, trace).kv
    del trace
    own = cache_of(consumer(input_ids=ids, use_cache=True))
    own = [(layer.keys, layer.values) for layer in own.layers]
    out["bandwidth_gb_s"] = copy_bandwidth(device) / 1e9
    out["decode"] = decode_rates(consumer, rebuilt, own, BATCHES, DECODE_STEPS, out["bandwidth_gb_s"] * 1e9)
    del rebuilt, own
    print(f"decode measured in {time.perf_counter() - t0:.1f} s", flush=True)
    save(out)
    for t in tokens:
        ids = torch.randint(len(tok), (1, t), generator=g).to(device)
        t0 = time.perf_counter()
        chosen = [methods.SCDMethod(art, name=kind, wire=out["payload"] == "device") for kind, art in arts.items()]
        m = measure_methods(producer, consumer, chosen, ids, repeats, hidden)
        raw = spec.kv_bytes_per_token * t
        for kind in arts:
            s = m["methods"][kind]
            one = {**m, "methods": {"oracle": m["methods"]["oracle"], "scd": s}}      # cli.bench's views of SCD
            cold, warm = ttft(one, list(GBPS)), ttft(one, list(GBPS), prefilled=True)
            out["rows"].append({
                "tokens": t, "kind": kind, "oracle_ms": m["prefill_ms"],
                "producer_prefill_ms": m["producer_prefill_ms"],
                "encode_ms": s["producer_ms"], "consumer_ms": s["consumer_ms"], "payload_bytes": s["payload_bytes"],
                "payload_ratio": s["payload_bytes"] / raw, "phases_ms": s,
                "ttft_cold_ms": dict(zip(GBPS, cold["scd"])), "ttft_cached_ms": dict(zip(GBPS, warm["scd"])),
                "fanout": {r["n"]: r["ratio"] for r in fanout(one, list(FANOUT))}})
            print(f"{t} tokens, {kind}: oracle {m['prefill_ms']:.1f} ms, consumer {s['consumer_ms']:.1f} ms",
                  flush=True)
        out.setdefault("wall_s", {})[t] = time.perf_counter() - t0
        print(f"{t} tokens: every plan kind measured in {out['wall_s'][t]:.1f} s", flush=True)
        save(out)
        if t == profile_tokens:             # a profiler that fails costs its tables, not the longer rows
            t0 = time.perf_counter()
            try:
                out["profile"] = {"tokens": t, "phases": profile_request(producer, consumer, arts, ids, device,
                                                                          profile_dir)}
                print(f"{t} tokens profiled in {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001
                out["profile_error"] = f"{type(e).__name__}: {e}"
                print(f"the profile at {t} tokens failed: {out['profile_error']}", flush=True)
            save(out)
    return out


def markdown(r: dict) -> str:
    lines = [f"### {r['shape']} on {r['device']} ({r['dtype']}), {r['date']}: timing-only (random weights)",
             "", f"Attention: {r['attention']}. Payloads: {PAYLOAD[r['payload']]}.", "",
             "| tokens | plan | oracle ms | producer prefill ms | encode ms | consumer ms | payload / raw KV | "
             + " | ".join(f"TTFT cached {g:g} Gbps / oracle" for g in GBPS) + " | "
             + " | ".join(f"fan-out {n} / {n} prefills" for n in FANOUT) + " |",
             "|" + "---|" * (7 + len(GBPS) + len(FANOUT))]
    for x in r["rows"]:
        lines.append(f"| {x['tokens']} | {x['kind']} | {x['oracle_ms']:.1f} | {x['producer_prefill_ms']:.1f} | "
                     f"{x['encode_ms']:.1f} | {x['consumer_ms']:.1f} | {x['payload_ratio']:.3f} | "
                     + " | ".join(f"{x['ttft_cached_ms'][g] / x['oracle_ms']:.3f}" for g in GBPS) + " | "
                     + " | ".join(f"{x['fanout'][n]:.3f}" for n in FANOUT) + " |")
    lines += ["", f"Decode from a cache of {r['decode'][0]['cache_tokens']} tokens, tokens/s (all rows); the limit: "
              f"weights and KV read per step over {r['bandwidth_gb_s']:.0f} GB/s (a device-to-device copy here). "
              f"Static caches' steps replayed from CUDA graphs: {'yes' if r['decode'][0]['graph'] else 'no'}.", "",
              "| batch | dynamic batch (CPU engines), rebuilt | static caches (GPU engines), rebuilt | "
              "static caches, own prefill | the engines' whole loop, rebuilt | limit | static / limit |",
              "|---|---|---|---|---|---|---|"]
    for d in r["decode"]:
        eng = f"{d['engine_tok_s']:.0f}" if d["engine_tok_s"] else "n/a"
        lines.append(f"| {d['batch']} | {eng} | {d['static_rebuilt_tok_s']:.0f} | {d['static_own_tok_s']:.0f} | "
                     f"{d['loop_tok_s']:.0f} | {d['limit_tok_s']:.0f} | "
                     f"{d['static_rebuilt_tok_s'] / d['limit_tok_s']:.2f} |")
    return "\n".join(lines) + "\n"


def profile_markdown(r: dict) -> str:
    return (f"### Where the time goes: {r['shape']} at {r['profile']['tokens']} tokens on {r['device']} "
            f"({r['dtype']}), {r['date']}: timing-only (random weights)\n\n"
            + profile_phases.markdown(r["profile"]["phases"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools.bench_size", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=sorted(shapes.SHAPES))
    p.add_argument("--tokens", default="256,512", help="prefix lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="rounds after a warm-up one; medians are reported")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="folder for size.md and size.json")
    p.add_argument("--profile", type=int, metavar="TOKENS",
                   help="after the rows at this prefix length (one of --tokens), every phase under torch.profiler: "
                        "profile.md and a trace per phase under --out")
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.profile is not None and args.profile not in tokens:
        p.error(f"--profile {args.profile} is not one of --tokens {args.tokens}")
    context = shapes.SHAPES[args.shape]["max_position_embeddings"]
    if max(tokens) > context:
        p.error(f"--tokens {max(tokens)} is over the {args.shape} shape's context of {context}")
    out = Path(args.out) if args.out else None

    def save(r: dict) -> None:
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "size.md").write_text(markdown(r))
            (out / "size.json").write_text(json.dumps(r, indent=1))
            if "profile" in r:
                (out / "profile.md").write_text(profile_markdown(r))
    with torch.inference_mode():
        r = run(args.shape, tokens, args.repeats, args.device, save, args.profile, out)
    print(markdown(r))
    if "profile" in r:
        print(profile_markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
