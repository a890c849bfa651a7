"""Selective token recompute across models (scd.online.selective) on a pair's held-out windows: a probe.

    python -m tools.probe_selective --config configs/smollm2.yaml --pair smollm2:code --tokens 512,2048
                                    [--artifact smollm2:code] [--fractions 0.05,0.1,0.2,0.35] [--json F]

For each prefix length T it measures, on the same held-out windows, the teacher-forced KL of the next 32
tokens against the consumer's own prefill for:

  raw_kv                        the producer's K and V as they are (no consumer compute)
  droidspeak@<e>                the consumer's layers e..L-1 from the producer's residual
  raw_kv+<rule>@<f>             raw KV repaired at a fraction f of the positions, chosen by <rule> (learned:
                                a selector fitted here on --learned-samples fine-tuning windows)
  codes, codes+<rule>@<f>       with --artifact: the pair's codes alone (no block, no tail), and repaired
  raw_kv+oracle@<f>             with --oracle (and codes+oracle@<f> with --artifact): the positions the
                                continuation itself reads most in the consumer's own forward (its queries'
                                attention over the own cache, summed over layers and heads). Not a rule
                                anything can serve (it needs the answer and the consumer's own prefill): the
                                most a choice of positions can buy. With --oracle-cache given, its reads
                                over the producer's K and V instead
  raw_kv+suffix@<f>             with --suffix K: the positions the request's own first tokens read most over
                                the given cache (a QA sample's question; else the continuation's first K
                                tokens, as a prompt's suffix): what a specialist knows when a request comes.
                                Every row's KL is then over the continuation's positions from K on. With
                                --artifact codes+suffix@<f> too; with --suffix-rounds R also +suffixxR@<f>:
                                R steps, each reading over the cache the steps before it repaired

and prints each one's consumer compute (multiply-adds counted over the consumer's own prefill:
selective.cost, and DroidSpeak's layers' share) and its KL over raw KV's. No artifact is needed for the raw-KV
rows: CacheBlend's own setting (a cache computed elsewhere, repaired), across models.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from scd.data import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting import points, selector
from scd.online import selective
from scd.online.trace import capture


class ReadSelective(methods.Method):
    """The cache `base` gives (raw KV, or the codes') repaired at the positions some tokens read most: the
    continuation's over the consumer's own cache (`oracle`, an upper bound for any rule: `read`, (1, T), set per
    sample), or the request's first tokens' (`suffix`: `first`, (n,), set per sample) over the cache as it
    stands, in `rounds` steps: each step selects its share of the positions by those tokens' reads over the
    cache the steps before it repaired (their pass counted each time); the last runs every step's positions
    again in one pass over the given cache, so that each attends to the others' own K, V."""

    def __init__(self, fraction: float, rule: str = "oracle", base: methods.Method | None = None, rounds: int = 1):
        self.base = base or methods.RawKV()
        self.fraction, self.rounds, self.read, self.first, self.spent = fraction, rounds, None, None, []
        self.name = f"{self.base.name}+{rule}{f'x{rounds}' if rounds > 1 else ''}@{fraction:g}"

    def build(self, consumer, ids, mask, producer_trace):
        built = self.base.build(consumer, ids, mask, producer_trace)
        kv, total, t = built.kv, selective.count_for(mask, self.fraction), ids.shape[1]
        if self.first is None:
            sel = selective.top(self.read, mask, total)
            self.spent += [selective.cost(consumer.config, t, sel.shape[1], columns=row.tolist()) for row in sel]
            return methods.Built(selective.recompute_tokens(consumer, kv, ids, mask, sel), built.payload_bytes, 0.0)
        done = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
        spent = torch.zeros(ids.shape[0])
        for r in range(self.rounds):
            k = round(total * (r + 1) / self.rounds) - int(done.sum(-1).min())
            read = selective.reads_of(consumer, kv, mask, self.first[None].expand(ids.shape[0], -1))
            sel = selective.top(read, mask.bool() & ~done, k)
            done.scatter_(1, sel, True)
            if r < self.rounds - 1:          # a step's repair, for the next step's reads
                kv = selective.recompute_tokens(consumer, kv, ids, mask, sel)
            else:                            # every step's positions again, in one pass over the given cache
                sel = selective.top(done.float(), mask, int(done.sum(-1).min()))
                kv = selective.recompute_tokens(consumer, built.kv, ids, mask, sel)
            spent += torch.tensor([selective.cost(consumer.config, t, row.numel(), window=self.first.shape[-1],
                                                  columns=row.tolist()) for row in sel])
        self.spent += spent.tolist()
        return methods.Built(kv, built.payload_bytes, 0.0)


def rows_at(ev: Evaluator, held: list, config, rules: list[str], fractions: list[float], entries: list[int],
            codes: methods.Method | None = None, oracle: bool = False, suffix: int = 0,
            oracle_cache: str = "own", selectors: dict | None = None, rounds: int = 1) -> list[dict]:
    """One row per method on `held` (windows of one length): {"method", "tokens", "compute", "kl", "over_raw"}.
    The learned rule repairs each base with its selector in `selectors` (by the base's name)."""
    n, t = config.num_hidden_layers, held[0].prefix.shape[-1]
    bases = [methods.RawKV()] + ([codes] if codes else [])
    oracles = [ReadSelective(f, "oracle", b) for b in bases for f in fractions] if oracle else []
    suffixes = [ReadSelective(f, "suffix", b, r) for b in bases for r in sorted({1, rounds}) for f in fractions] \
        if suffix else []
    ms = bases + [methods.DroidSpeak.entering(e, n) for e in entries] + [
        methods.Selective(b, rule, f, ev.tok, selector=(selectors or {}).get(b.name))
        for b in bases for rule in rules for f in fractions] + oracles + suffixes
    qa = held[0].answer is not None                     # answers: each method's F1 too
    kl = {m.name: 0.0 for m in [methods.Oracle()] + ms}
    f1 = dict(kl)
    for s in tqdm(held, desc=f"selective at {t} tokens"):
        ref = ev.reference(s)
        ids, mask, ptrace, own, _ = ref
        if oracles:
            given = own.kv if oracle_cache == "own" else methods.RawKV().build(ev.consumer, ids, mask, ptrace).kv
            read = selective.reads_of(ev.consumer, given, mask, s.cont[None])
            for m in oracles:
                m.read = read
        for m in suffixes:
            m.first = s.question if s.question is not None else s.cont[:suffix]
        if qa:
            for r in ev.sample(s, [methods.Oracle()] + ms):
                kl[r.method] += r.kl / len(held)
                f1[r.method] += r.f1 / len(held)
            continue
        for m in ms:
            kl[m.name] += ev.kl(s, m, ref, start=suffix) / len(held)

    def compute(m) -> float:
        if isinstance(m, ReadSelective):
            return sum(m.spent) / len(m.spent)
        if isinstance(m, methods.Selective):
            return m.counted(config, t)
        if m.name.startswith("droidspeak@"):
            return points.consumer_ratio(m.start, 0, n, t)
        return 0.0
    raw = kl["raw_kv"]
    return [{"method": m.name, "tokens": t, "compute": compute(m), "kl": kl[m.name], "over_raw": kl[m.name] / raw,
             **({"f1": f1[m.name], "oracle_f1": f1["oracle"]} if qa else {})} for m in ms]


def parser() -> argparse.ArgumentParser:
    """The probe's arguments."""
    p = argparse.ArgumentParser(prog="tools.probe_selective", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2.yaml")
    p.add_argument("--pair", required=True, help="PRODUCER:CONSUMER of the config")
    p.add_argument("--artifact", help="PRODUCER:CONSUMER[@VERSION] in the config's store: also from its codes")
    p.add_argument("--store", help="the store --artifact is in (default: the config's artifacts.uri)")
    p.add_argument("--tokens", default="512,2048", help="prefix lengths, comma-separated")
    p.add_argument("--samples", type=int, default=12, help="held-out windows per length")
    p.add_argument("--fractions", default="0.05,0.1,0.2,0.35", help="shares of the positions recomputed")
    p.add_argument("--rules", default=",".join(selective.RULES), help=f"selection rules ({', '.join(selective.RULES)})")
    p.add_argument("--entries", default="24,19,14", help="DroidSpeak's entry layers")
    p.add_argument("--oracle", action="store_true", help="also the positions the continuation reads most (a bound)")
    p.add_argument("--oracle-cache", choices=("own", "given"), default="own",
                   help="the cache the continuation's reads are taken over (default: the consumer's own)")
    p.add_argument("--suffix", type=int, default=0, help="also the positions a request's first K tokens read "
                   "most over the given cache (a QA sample's question whatever K)")
    p.add_argument("--learned-samples", type=int, default=32, help="with the learned rule: the fine-tuning windows "
                   "its selector is fitted on, over raw KV, and over the codes where the artifact has none")
    p.add_argument("--learned-tokens", default="", help="the lengths of those windows, comma-separated, the "
                   "samples split evenly among them (default: the calibration's prefix_tokens)")
    p.add_argument("--suffix-rounds", type=int, default=1, help="with --suffix: also its positions chosen in this "
                   "many steps, each by the first tokens' reads over the cache the steps before it repaired")
    p.add_argument("--learned-target", choices=("own", "given", "own-x-error"), default="own", help="with the "
                   "learned rule: the continuation's reads it is fitted to, over the consumer's own cache or the "
                   "given one, or over the own cache weighted by the given cache's error at each position")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--plot", help="write the curves here (PNG): KL over raw KV's against consumer compute")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    try:
        lengths, entries, fit_lengths = ([int(x) for x in v.split(",") if x]
                                         for v in (args.tokens, args.entries, args.learned_tokens))
        fractions = [float(x) for x in args.fractions.split(",") if x]
    except ValueError as e:
        raise SystemExit(f"--tokens, --entries and --fractions take comma-separated numbers: {e}") from None
    rules = [r for r in args.rules.split(",") if r]
    if bad := [r for r in rules if r not in selective.RULES]:
        raise SystemExit(f"--rules: {bad} not among {selective.RULES}")
    if "learned" in rules and args.learned_samples < 2:
        raise SystemExit("--learned-samples: a selector is fitted on 2 windows or more")
    if (args.samples < 1 or not lengths or min(lengths) < 2 or not all(0 < f <= 1 for f in fractions)
            or args.suffix < 0 or args.suffix_rounds < 1):
        raise SystemExit("--samples must be >= 1, --tokens >= 2, --fractions in (0, 1], --suffix >= 0 and "
                         "--suffix-rounds >= 1")

    from tools.pairs import config_pair
    cfg, name, producer, consumer, tok, spec = config_pair(args.config, args.pair)
    if any(not 0 < e < spec.num_layers for e in entries):
        raise SystemExit(f"--entries must lie in 1..{spec.num_layers - 1}")
    codes = art = None
    if args.artifact:
        from artifacts_store import ArtifactStore, ArtifactStoreError, Fingerprints
        from tools.probe_tails import codes_alone
        try:
            store = str(Path(args.store).expanduser()) if args.store and "://" not in args.store else args.store
            art, _ = ArtifactStore(store or cfg.artifacts.uri).load(
                args.artifact, expect=Fingerprints.of(producer=producer, consumer=consumer, tokenizer=tok))
        except ArtifactStoreError as e:
            raise SystemExit(f"--artifact {args.artifact}: {e}") from None
        codes = methods.SCDMethod(codes_alone(art), "codes")
    c = cfg.calibration_for(name)
    ev = Evaluator(producer, consumer, tok)
    selectors = fit_selectors(producer, consumer, tok, name, c, args.learned_samples, codes, art,
                              fit_lengths or [c.prefix_tokens], args.learned_target) if "learned" in rules else {}
    rows = []
    for t in lengths:
        try:
            held = samples.pair_data(name, tok, 1, 1, args.samples, t, text_file=c.text_file)[2]
        except ValueError as e:                         # documents shorter than t (qa's notes: about 512)
            raise SystemExit(f"{args.pair}: no {args.samples} held-out prefixes of {t} tokens ({e})") from None
        at = rows_at(ev, held, consumer.config, rules, fractions, entries, codes, args.oracle, args.suffix,
                     args.oracle_cache, selectors, args.suffix_rounds)
        rows += at
        print(f"\n{args.pair} at {t} tokens, {args.samples} held-out windows:")
        print(f"  {'method':30s} {'compute':>8s} {'KL':>8s} {'/ raw KV':>9s}" + ("      F1" if "f1" in at[0] else ""))
        for r in sorted(at, key=lambda r: r["compute"]):
            f1 = f" {r['f1']:7.3f}" if "f1" in r else ""
            print(f"  {r['method']:30s} {r['compute']:8.3f} {r['kl']:8.4f} {r['over_raw']:9.3f}{f1}", flush=True)
        if "f1" in at[0]:
            print(f"  (the consumer's own prefill: F1 {at[0]['oracle_f1']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.pair, args.plot)
    return rows


def fit_selectors(producer, consumer, tok, name: str, c, n: int, codes: methods.Method | None, art,
                  lengths: list[int], target: str = "own") -> dict:
    """The learned rule's selector for each base, by name: fitted here (scd.fitting.selector) on `n`
    fine-tuning windows split evenly among `lengths`, over raw KV, and over the codes unless the artifact
    carries the one its calibration fitted (and `target` is "own", as the calibration's; --learned-target)."""
    per_length = [samples.tune_samples(name, tok, n // len(lengths) + (i < n % len(lengths)), t,
                                       selective.READ_TOKENS, text_file=c.text_file) for i, t in enumerate(lengths)]
    tune = [s for group in itertools.zip_longest(*per_length) for s in group if s is not None]   # lengths interleaved
    layers = selective.selector_layers(consumer.config.num_hidden_layers)
    out = {}
    for base in [methods.RawKV()] + ([codes] if codes else []):
        if base is codes and art.selector is not None and target == "own":
            out[base.name] = (art.selector, art.selector_layers)
            continue
        w, fitted = selector.fit_over(consumer, tune, lambda ids, mask, b=base: b.build(
            consumer, ids, mask, capture(producer, ids, mask)).kv, layers, desc=f"selector over {base.name}",
            target_cache="given" if target == "given" else "own", error_weighted=target == "own-x-error")
        print(f"selector over {base.name}: penalty {fitted['penalty']:g}, top-20 % overlap on held-back windows "
              f"{fitted['overlap'][fitted['penalty']]:.2f}")
        out[base.name] = (w, layers)
    return out


def kind(method: str) -> str:
    """A row's curve: droidspeak, or the method's base and rule (raw_kv+structural), or the base alone."""
    return "droidspeak" if method.startswith("droidspeak@") else method.split("@")[0]


def plot(rows: list[dict], pair: str, path: str) -> None:
    """One panel per prefix length: each curve's KL over raw KV's against its counted consumer compute."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = sorted({r["tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], lengths):
        at = [r for r in rows if r["tokens"] == t]
        raw = next(r for r in at if r["method"] == "raw_kv")
        start = {r["method"]: (0.0, r["over_raw"]) for r in at if r["method"] in ("raw_kv", "codes")}
        start["droidspeak"] = start["raw_kv"]              # entering at the last layer is raw KV
        for k in dict.fromkeys(kind(r["method"]) for r in at if r["method"] != "raw_kv"):
            pts = sorted([start[k.split("+")[0]]] * (k != "codes") + [(r["compute"], r["over_raw"]) for r in at
                                                                      if kind(r["method"]) == k])
            ax.plot(*zip(*pts), marker="o", label=k)
        ax.axhline(raw["over_raw"], color="grey", lw=0.5)
        ax.set(title=f"{pair}, {t} tokens", xlabel="consumer compute (share of its own prefill, counted)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out KL / raw KV's")
    axes[0][-1].legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(0 if main() else 1)
