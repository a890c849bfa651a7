"""LoRA adapters as one group on their base against each merged into a copy of it, side by side in one process.

    python -m tools.bench_lora_group [--config configs/smollm2.yaml] [--prompts 32] [--tokens 16]

For the config's specialists that are LoRA adapters of the producer's base (activated LoRAs too; any other is
left out, said so):
- memory: the weights' bytes of the group (the base once, the adapters' factors as the group stacks them)
  against one merged copy per adapter;
- a fan-out over one prefix of --fanout-tokens: the group's engine answering every adapter (the base's layers
  once; an adapter's own layers from the first it changes; an adapter on every layer rebuilt by its plan, with
  --artifacts or --plan-shapes, else its own prefill) against each merged model's own prefill, and the share of
  a prefill each adapter's part is;
- decode tokens/s of a batch of 8 rows mixed over the adapters against 8 rows on one merged model, from caches of
  --cache tokens (medians of interleaved rounds);
- greedy answers: each adapter's --tokens greedy tokens after each of --prompts held-out prompts (its own
  prefill of the prompt, then the decode in batches of rows of every adapter) against the merged model's.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engines.group import GroupEngine
from cluster.config import load_config
from scd.data.samples import pair_data
from scd.online import activated, fast_decode
from scd.online.cache import cache_of
from scd.online.decode import GenParams
from scd.online.lora_group import AdapterError, LoraGroup, read_adapter
from scd.online.model_files import is_adapter, named_base
from scd.online.models import ModelSpec, load


def weight_bytes(model) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel() * p.element_size()
    return n


def batch_caches(rows: list[tuple[list, list]]):
    """Keys and values per layer for a batch of rows of equal length."""
    layers = len(rows[0][0])
    return ([torch.cat([r[0][i] for r in rows]) for i in range(layers)],
            [torch.cat([r[1][i] for r in rows]) for i in range(layers)])


def own_extend(model):
    """A merged model's own run of a prompt (1, S): an activated LoRA's on its base's weights up to its
    invocation (scd.online.activated), the adapted ones from there."""
    fast = fast_decode.step_for(model)
    act = activated.of(model)

    def run(keys, values, ids):
        at = activated.switch(model, ids)
        if act is None or at == 0:
            return fast.extend(keys, values, ids)
        logits, keys, values = fast_decode.step_for(act.base).extend(keys, values, ids[:, :at])
        return (logits, keys, values) if at == ids.shape[1] else fast.extend(keys, values, ids[:, at:])
    return run


def tokens_per_s(run_step, b: int, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        run_step()
    return b * steps / (time.perf_counter() - t)


def greedy(extend, step, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """(rows, n) greedy tokens: extend(row, ids) -> (logits, keys, values) per row, then batched steps."""
    rows = [extend(i, prompts[i:i + 1]) for i in range(prompts.shape[0])]
    keys, values = batch_caches([(k, v) for _, k, v in rows])
    logits = torch.cat([lg for lg, _, _ in rows])
    b, t = prompts.shape
    mask, pos, out = torch.ones(b, t, dtype=torch.long), torch.full((b,), t), []
    for _ in range(n):
        tok = logits.argmax(-1)
        out.append(tok)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits, keys, values = step(keys, values, mask, pos, tok)
        pos = pos + 1
    return torch.stack(out, 1)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2.yaml")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts per adapter for the greedy check")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--cache", type=int, default=512, help="cache length of the decode rate's rows")
    p.add_argument("--fanout-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--artifacts", metavar="STORE",
                   help="serve each adapter on every layer from its pair's latest artifact in this store")
    p.add_argument("--plan-shapes", metavar="NAME=ENTRY[:STOP],...", type=plan_shapes,
                   help="instead: each named adapter from random codes below a block of its own layers entered at "
                        "ENTRY, up to the top or below STOP with the codes above it (a calibrated plan's shape: its "
                        "compute, not its quality), e.g. qa=17:27,code=8")
    args = p.parse_args(argv)
    with torch.no_grad():
        return run(args)


def run(args) -> dict:
    cfg = load_config(args.config)
    base, tok, _ = load(cfg.producer.path)
    base.eval()
    adapters, left_out = [], []
    for s in cfg.specialists:
        if not is_adapter(s.path):
            left_out.append(f"{s.name} (not an adapter)")
            continue
        try:
            adapters.append(read_adapter(s.name, s.path, base))
        except AdapterError as e:
            left_out.append(f"{s.name} ({e})")
    group = LoraGroup(base, adapters)
    names = [a.name for a in adapters]
    merged = {s.name: load(s.path, base=named_base(s.path) or cfg.producer.path)[0].eval()
              for s in cfg.specialists if s.name in names}
    print(f"adapters: {', '.join(names)}; left out: {', '.join(left_out) or 'none'}")
    engine = GroupEngine(group, tok)
    plans = with_plans(engine, cfg, args)
    return {"adapters": names, "left_out": left_out, "memory": memory(base, adapters, group, merged),
            "plans": plans, "fanout": fanout(engine, merged, len(tok), args),
            "decode": decode_rate(base, group, merged, len(tok), args),
            "greedy": greedy_answers(group, merged, tok, args)}


def memory(base, adapters, group: LoraGroup, merged: dict) -> dict:
    """The weights' bytes: the group's (the base, its stacked factors) against the merged copies'."""
    factor_bytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                       for ad in adapters for a, b in ad.factors.values())
    base_bytes = weight_bytes(base)
    m = {"base_bytes": base_bytes, "adapter_bytes": factor_bytes, "group_stack_bytes": group.stack_bytes(),
         "merged_bytes": sum(weight_bytes(x) for x in merged.values())}
    m["group_over_base_plus_adapters"] = (base_bytes + m["group_stack_bytes"]) / (base_bytes + factor_bytes)
    print(f"weights: group {(base_bytes + m['group_stack_bytes']) / 2**20:.1f} MiB (base {base_bytes / 2**20:.1f}, "
          f"adapters {factor_bytes / 2**20:.1f}, stacked {m['group_stack_bytes'] / 2**20:.1f}: "
          f"{m['group_over_base_plus_adapters']:.3f} x base + adapters) against {len(merged)} merged copies "
          f"{m['merged_bytes'] / 2**20:.1f} MiB")
    return m


def plan_shapes(text: str) -> dict[str, tuple[int, int | None]]:
    """--plan-shapes: adapter -> (entry, stop or None: up to the top)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, block = item.partition("=")
        entry, colon, stop = block.partition(":")
        if not name or not entry.isdigit() or (colon and not stop.isdigit()):
            raise argparse.ArgumentTypeError(f"{item!r}: NAME=ENTRY or NAME=ENTRY:STOP, layers as numbers")
        out[name] = (int(entry), int(stop) if stop else None)
    return out


def with_plans(engine: GroupEngine, cfg, args) -> dict[str, str]:
    """Give the adapters on every layer their plans (--artifacts: the published ones; --plan-shapes: random
    codes of the named shapes, for their compute only); returns adapter -> what it is served from."""
    from actors.messages import pair_id
    from artifacts_store import ArtifactNotFound, ArtifactStore
    from jobs.timing_family import random_artifact
    plans = {}
    if args.artifacts:
        store = ArtifactStore(args.artifacts)
        for n in engine.names:
            if engine.share(n) < 1.0:
                continue
            try:
                art, manifest = store.load(pair_id(cfg.producer.name, n))
            except ArtifactNotFound:
                continue
            engine.set_artifact(n, art, manifest.version)
            plans[n] = f"{manifest.version} (blocks {art.blocks})"
    for n, (entry, stop) in (args.plan_shapes or {}).items():
        spec = ModelSpec.from_config(engine.group.base.config)
        try:
            art = random_artifact("codes", pair_id(cfg.producer.name, n), spec, len(engine.tok), entry=entry,
                                  stop=stop)
        except ValueError as e:
            raise SystemExit(f"--plan-shapes {n}: {e}") from None
        engine.set_artifact(n, art, "random")
        plans[n] = f"random codes, block {art.blocks} (compute only)"
    for n, what in plans.items():
        print(f"plan of {n}: {what}")
    return plans


def fanout(engine: GroupEngine, merged: dict, vocab: int, args) -> dict:
    """A fan-out over one prefix: the group engine's answers (one token each, one after another: the
    compute) against every merged model's own prefill."""
    names = list(merged)
    g = torch.Generator().manual_seed(0)
    one = GenParams(max_tokens=1, temperature=0.0)
    own = {n: own_extend(merged[n]) for n in names}
    times = {"group": [], "own": []}
    for r in range(args.rounds):
        prefix = torch.randint(vocab, (1, args.fanout_tokens), generator=g)   # a new prefix: the base prefills
        t = time.perf_counter()
        modes = {n: engine.complete(n, prefix[0].tolist(), [1], one)[1].mode for n in names}
        times["group"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for n in names:
            own[n]([], [], prefix)
        times["own"].append(time.perf_counter() - t)
    share = {n: engine.share(n) for n in names}
    f = {"tokens": args.fanout_tokens, "group_s": statistics.median(times["group"]),
         "own_s": statistics.median(times["own"]), "share": share, "modes": modes}
    f["ratio"] = f["group_s"] / f["own_s"]
    print(f"fan-out to {len(names)} over {args.fanout_tokens} tokens: the group {f['group_s']:.2f} s against "
          f"{len(names)} own prefills {f['own_s']:.2f} s ({f['ratio']:.2f} x; each adapter's share of a prefill: "
          + ", ".join(f"{n} {v:.2f}" for n, v in share.items()) + ", plus the base's once)")
    return f


def decode_rate(base, group: LoraGroup, merged: dict, vocab: int, args, b: int = 8) -> dict:
    """Tokens/s of b rows mixed over the adapters against b rows on one merged model."""
    names = list(merged)
    ids = torch.randint(vocab, (1, args.cache), generator=torch.Generator().manual_seed(0))
    out = cache_of(base(input_ids=ids, use_cache=True))
    keys, values = batch_caches([([layer.keys for layer in out.layers], [layer.values for layer in out.layers])] * b)
    mask, pos = torch.ones(b, args.cache + 1, dtype=torch.long), torch.full((b,), args.cache)
    tok_in = torch.zeros(b, dtype=torch.long)
    idx = torch.tensor([group.index(names[i % len(names)]) for i in range(b)])
    fast_merged = fast_decode.step_for(merged[names[0]])
    rates = {"mixed": [], "merged": []}
    for _ in range(args.rounds + 1):                     # the first round warms up
        rates["mixed"].append(tokens_per_s(lambda: group.step(keys, values, mask, pos, tok_in, idx), b, args.steps))
        rates["merged"].append(tokens_per_s(lambda: fast_merged(keys, values, mask, pos, tok_in), b, args.steps))
    d = {k: statistics.median(v[1:]) for k, v in rates.items()}
    d["ratio"] = d["mixed"] / d["merged"]
    print(f"decode, batch of {b} from {args.cache} tokens: mixed over {len(names)} adapters {d['mixed']:.0f} "
          f"tokens/s, one merged model {d['merged']:.0f} ({d['ratio']:.2f} x)")
    return d


def greedy_answers(group: LoraGroup, merged: dict, tok, args) -> dict:
    """Greedy answers on each pair's held-out samples (as calibration's evaluation draws them), every adapter's
    rows decoded in mixed batches of 8, against each merged model's."""
    names = list(merged)
    prompts_by = {}
    for n in names:
        held = pair_data(n, tok, 0, 0, args.prompts, prefix_tokens=args.prompt_tokens)[2]
        prompts_by[n] = torch.stack([x.prefix[:args.prompt_tokens] for x in held
                                     if x.prefix.shape[0] >= args.prompt_tokens])
    own = {n: own_extend(merged[n]) for n in names}
    fm = {n: fast_decode.step_for(merged[n]) for n in names}
    rows = [(n, prompts_by[n][j]) for j in range(args.prompts) for n in names if j < len(prompts_by[n])]
    per = {n: {"prompts": 0, "equal": 0} for n in names}
    for c in range(0, len(rows), 8):
        chunk = rows[c:c + 8]
        idx = torch.tensor([group.index(n) for n, _ in chunk])
        got = greedy(lambda i, x: group.extend([], [], x, int(idx[i])),
                     lambda k, v, mk, ps, tk: group.step(k, v, mk, ps, tk, idx),
                     torch.stack([x for _, x in chunk]), args.tokens)
        for r, (n, x) in enumerate(chunk):
            want = greedy(lambda i, y: own[n]([], [], y), fm[n], x[None], args.tokens)
            per[n]["prompts"] += 1
            per[n]["equal"] += int(torch.equal(got[r], want[0]))
    for n, v in per.items():
        print(f"greedy, {n}: {v['equal']} of {v['prompts']} held-out prompts give the merged model's "
              f"{args.tokens} tokens (decoded in batches mixed over the adapters)")
    return per


if __name__ == "__main__":
    main()
