"""`scd bench`: compute of SCD against the consumer's own prefill, measured side by side in one process.

Three views of one set of measurements (per prefix length in --tokens):
  default      consumer side: decode + rebuild + patch of the codes over the consumer's own prefill
  --fanout     one producer prefill + encode + N consumer rebuilds over N consumer prefills (the compute a
               fan-out to N specialists costs, against each specialist prefilling the prefix itself)
  --bandwidth  the paper's Table 4 / Figure 3: time to the first token of every method (oracle, raw_kv,
               int4_kv, droidspeak, reuse_only, scd) at each link bandwidth, modeled as the measured compute
               phases plus payload / bandwidth, with the producer's prefill and with the prefix already
               prefilled on the producer (a fan-out's later specialists, a cached prefix); tables, and a PNG
               of TTFT against bandwidth under --plot-dir
  --ttft-target (with --bandwidth) ranks chosen per link: at each bandwidth, the code level the producer
               sends (scd.online.links: the largest whose codes arrive within the target after the producer's
               prefill and encode), its modeled TTFT and its KL measured on --kl-samples held-out samples;
               --link-ms instead gives the link's share directly (the target less the producer's measured work)

Every round runs each phase once, in turn, so that a busy machine slows all of them alike; medians over
--repeats rounds (after one warm-up round) are reported. The codes come from the pair's calibrated artifact
(the one `scd eval` keeps under --work-dir; calibrated on the spot if missing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from scd.data import demo_data, samples
from cli.evaluate import add_pair_args, calibrated, exact_artifact, output_folder, parse, positives, resolve_pair
from scd.evaluation import methods
from scd.online import codec, links, selective
from scd.online.artifacts import level_tag
from scd.fitting import scoring, structure
from scd.online.model_files import is_adapter
from scd.online.models import load_pair
from scd.online.trace import capture


def _ms(fn) -> tuple[float, object]:
    methods.sync()
    t = time.perf_counter()
    out = fn()
    methods.sync()
    return (time.perf_counter() - t) * 1e3, out


@torch.no_grad()
def measure(producer, consumer, art, ids: torch.Tensor, repeats: int, dtype: str | None = None,
            every_method: bool = False) -> dict:
    """Median milliseconds of each phase at one prefix length, the phases interleaved round by round:
    the consumer's own prefill (the oracle), the producer's prefill with its trace, and per method the
    producer-side work after the prefill (SCD's encode), the payload bytes and the consumer-side work.
    Without every_method only SCD is measured (the default and --fanout views)."""
    scd = methods.SCDMethod(art, dtype=dtype)
    chosen = [scd]
    if every_method:
        # DroidSpeak's block position changes its quality, not its cost: any block of the same size will do
        chosen = [methods.RawKV(), methods.Int4KV(), methods.DroidSpeak(start=1), scd]
        if art.reuse_ranks:                      # fitted codes (an exact plan has neither Reuse nor levels)
            chosen[3:3] = [methods.reuse_only(art)]
            chosen += methods.at_levels(art)
    return {**measure_methods(producer, consumer, chosen, ids, repeats, every_method or art.needs_hidden),
            "plan": art.plan}


@torch.no_grad()
def measure_methods(producer, consumer, chosen: list, ids: torch.Tensor, repeats: int, want_hidden: bool) -> dict:
    """`measure` of the methods `chosen` (each by its name), side by side over one prefix: per round the
    oracle's prefill, the producer's (with its residual streams if `want_hidden`), then every method."""
    mask = torch.ones_like(ids)
    rounds = []
    for _ in range(repeats + 1):                                 # the first round warms every path up
        # the consumer's own prefill as its fallback path runs it, and the producer's as the producer actor does
        r = {"prefill_ms": _ms(lambda: capture(consumer, ids, mask, want_xnorm=False))[0]}
        r["producer_prefill_ms"], trace = _ms(lambda: capture(producer, ids, mask, want_hidden=want_hidden))
        for m in chosen:          # a plan by the suffix rule reads a request: 16 tokens, as its share counts one
            built = methods.built_for(m, consumer, ids, mask, trace, ids[:, -selective.WINDOW:])
            r[m.name] = {"producer_ms": built.phases.get("encode_ms", 0.0), "consumer_ms": built.consumer_ms,
                         "payload_bytes": built.payload_bytes, "entry_bytes": built.entry_bytes,
                         **{k: v for k, v in built.phases.items() if k != "encode_ms"}}
        del trace
        rounds.append(r)
    rounds = rounds[1:]
    med = lambda key, sub=None: statistics.median(r[key] if sub is None else r[key][sub] for r in rounds)  # noqa: E731
    out = {"tokens": ids.shape[1], "repeats": repeats, "prefill_ms": med("prefill_ms"),
           "producer_prefill_ms": med("producer_prefill_ms"),
           "methods": {"oracle": {"producer_ms": 0.0, "consumer_ms": med("prefill_ms"), "payload_bytes": 0}}}
    for m in chosen:
        out["methods"][m.name] = {k: med(m.name, k) for k in rounds[0][m.name]}
    return out


def consumer_side(m: dict) -> dict:
    """The default view: SCD's consumer side (codec decode + rebuild + patch) over the consumer's prefill."""
    s = m["methods"]["scd"]
    return {"tokens": m["tokens"], "repeats": m["repeats"], "prefill_ms": m["prefill_ms"],
            "consumer_ms": s["consumer_ms"], "ratio": s["consumer_ms"] / m["prefill_ms"],
            "payload_bytes": s["payload_bytes"], "plan": m["plan"], "decode_ms": s.get("decode_ms", 0.0),
            "rebuild_ms": s.get("rebuild_ms", 0.0), "patch_ms": s.get("patch_ms", 0.0),
            "recompute_ms": s.get("recompute_ms", 0.0), "tail_ms": s.get("tail_ms", 0.0)}


def fanout(m: dict, ns: list[int]) -> list[dict]:
    """Compute of a fan-out to n specialists: one producer prefill + encode + n rebuilds, over n prefills."""
    s = m["methods"]["scd"]
    once = m["producer_prefill_ms"] + s["producer_ms"]
    return [{"n": n, "scd_ms": once + n * s["consumer_ms"], "oracle_ms": n * m["prefill_ms"],
             "ratio": (once + n * s["consumer_ms"]) / (n * m["prefill_ms"])} for n in ns]


def ttft(m: dict, gbps: list[float], prefilled: bool = False) -> dict[str, list[float]]:
    """Modeled time to the first token per method at each bandwidth: the producer's prefill (not when
    `prefilled`: the producer holds the prefix already, as for every specialist of a fan-out but the first)
    and its encode, then the payload on the link and the consumer's work, overlapped for an E-first payload
    (links.ready_ms). The oracle prefills on the consumer."""
    out = {}
    for name, p in m["methods"].items():
        producer = 0.0 if name == "oracle" else p["producer_ms"] + (0.0 if prefilled else m["producer_prefill_ms"])
        out[name] = [producer + links.ready_ms(p["payload_bytes"], p["consumer_ms"], g, p.get("entry_bytes", 0),
                                               p.get("recompute_ms", 0.0), p.get("tail_ms", 0.0)) for g in gbps]
    return out


def per_link(m: dict, art, gbps: list[float], target_ms: float | None, kls: dict[str, float],
             link_ms: float | None = None) -> list[dict]:
    """At each bandwidth, the level the producer sends (links.choose with what is left of the TTFT target
    after the measured prefill and encode, or with `link_ms` for the link), the modeled TTFT of that level's
    codes and its measured KL."""
    raw = m["methods"]["raw_kv"]["payload_bytes"]
    rows = []
    for g in gbps:
        spent = m["producer_prefill_ms"] + m["methods"]["scd"]["producer_ms"]
        level = links.choose(art, m["tokens"], g, link_ms if link_ms is not None else target_ms - spent)
        name = methods.level_name(art, level)
        p = m["methods"][name]
        rows.append({"gbps": g, "level": level, "method": name, "payload_ratio": p["payload_bytes"] / raw,
                     "ttft_ms": m["producer_prefill_ms"] + p["producer_ms"] + links.ready_ms(
                         p["payload_bytes"], p["consumer_ms"], g, p.get("entry_bytes", 0), p.get("recompute_ms", 0.0),
                         p.get("tail_ms", 0.0)),
                     "kl": kls[name]})
    return rows


def plot_ttft(gbps: list[float], cold: dict[str, list[float]], warm: dict[str, list[float]], path: Path,
              title: str) -> None:
    """TTFT against bandwidth per method: solid with the producer's prefill, dashed with the prefix already
    prefilled on the producer (one colour per method)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, ys) in enumerate((n, ys) for n, ys in cold.items() if not n.startswith("scd@")):
        width = 2.4 if name == "scd" else 1.2
        ax.plot(gbps, ys, marker="o", label=name, linewidth=width, color=f"C{i}")
        if name != "oracle":
            ax.plot(gbps, warm[name], marker=".", linestyle="--", linewidth=width, color=f"C{i}")
    ax.plot([], [], linestyle="--", color="grey", label="prefix already prefilled")
    ax.set_xscale("log")
    ax.set_xticks(gbps, [f"{g:g}" for g in gbps])
    ax.set_xlabel("link bandwidth (Gbps)")
    ax.set_ylabel("time to first token (ms, modeled)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _print_default(pair: str, r: dict) -> None:
    print(f"{pair} at {r['tokens']} tokens, {r['threads']} torch thread(s), median of {r['repeats']} interleaved "
          f"runs, plan {r['plan']}:\n"
          f"  consumer prefill            {r['prefill_ms']:8.2f} ms\n"
          f"  SCD decode+rebuild+patch    {r['consumer_ms']:8.2f} ms  (codec {r['decode_ms']:.2f}, "
          f"rebuild {r['rebuild_ms']:.2f}, patch {r['patch_ms']:.2f}, own layers {r['recompute_ms']:.2f}, "
          f"own last tokens {r['tail_ms']:.2f})\n"
          f"  ratio                       {r['ratio']:8.3f}\n"
          f"  payload                     {r['payload_bytes'] / 1024:8.1f} KB", flush=True)


def _print_fanout(pair: str, m: dict, rows: list[dict]) -> None:
    s = m["methods"]["scd"]
    print(f"{pair} fan-out compute at {m['tokens']} tokens (medians of {m['repeats']} interleaved rounds): producer "
          f"prefill {m['producer_prefill_ms']:.2f} ms + encode {s['producer_ms']:.2f} ms once, then per specialist "
          f"{s['consumer_ms']:.2f} ms of rebuild against a {m['prefill_ms']:.2f} ms prefill")
    print(f"  {'N':>3}  {'SCD ms':>9}  {'N prefills ms':>13}  {'ratio':>6}")
    for r in rows:
        print(f"  {r['n']:>3}  {r['scd_ms']:9.2f}  {r['oracle_ms']:13.2f}  {r['ratio']:6.3f}")


def _print_bandwidth(pair: str, m: dict, gbps: list[float], cold: dict[str, list[float]],
                     warm: dict[str, list[float]], png: Path) -> None:
    raw = m["methods"]["raw_kv"]["payload_bytes"]
    head = "".join(f"{f'{g:g} Gbps':>11}" for g in gbps)
    for times, how in ((cold, f"the producer prefills ({m['producer_prefill_ms']:.2f} ms)"),
                       (warm, "the prefix already prefilled on the producer")):
        print(f"{pair} time to first token at {m['tokens']} tokens, {how} (ms; measured compute + payload / "
              f"bandwidth):")
        w = max(11, *(len(name) + 1 for name in m["methods"]))
        print(f"  {'method':<{w}}{'payload':>8}{'encode':>8}{'consumer':>10}{head}")
        for name, p in m["methods"].items():
            cells = "".join(f"{t:11.2f}" for t in times[name])
            print(f"  {name:<{w}}{p['payload_bytes'] / raw:8.3f}{p['producer_ms']:8.2f}{p['consumer_ms']:10.2f}{cells}")
    print(f"  plot: {png}", flush=True)


def _print_links(pair: str, m: dict, target_ms: float | None, link_ms: float | None, n_kl: int,
                 rows: list[dict], levels: list[dict]) -> None:
    spent = m["producer_prefill_ms"] + m["methods"]["scd"]["producer_ms"]
    within = (f"{target_ms:g} ms of the request" if link_ms is None else
              f"{link_ms:g} ms on the link (a TTFT target of {spent + link_ms:.2f} ms)")
    print(f"{pair} ranks chosen per link at {m['tokens']} tokens: the largest code level whose codes arrive within "
          f"{within}; the producer's prefill and encode take {spent:.2f} ms; KL on {n_kl} held-out samples:")
    print("  levels of the artifact (payload ratio: KL): " + "; ".join(
        level_tag(x["level"]) + f" ({x['payload_ratio']:.3f}: {x['kl']:.4f})"
        for x in levels))
    print(f"  {'Gbps':>6}  {'level':<16}{'payload':>8}{'TTFT ms':>10}{'KL':>9}")
    for r in rows:
        print(f"  {r['gbps']:6g}  {level_tag(r['level']):<16}{r['payload_ratio']:8.3f}{r['ttft_ms']:10.2f}{r['kl']:9.4f}")


def parser() -> argparse.ArgumentParser:
    """scd bench's arguments: the pair's (cli.evaluate.add_pair_args) and the measurement's."""
    p = argparse.ArgumentParser(prog="scd bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(p)
    p.add_argument("--tokens", default="1024", help="prefix length(s), e.g. 1024,2048,4096")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", choices=codec.DTYPES, help="code precision (default: the artifact's)")
    p.add_argument("--fanout", help="specialist counts, e.g. 1,2,4,8: fan-out compute against N consumer prefills")
    p.add_argument("--bandwidth", help="link bandwidths in Gbps, e.g. 10,25,100,200,400: TTFT of every method")
    p.add_argument("--plot-dir", default="runs/bench", help="where --bandwidth writes its PNG")
    p.add_argument("--ttft-target", type=float, help="with --bandwidth: a TTFT target (ms) for the codes' arrival; "
                                                     "prints the code level chosen at each bandwidth")
    p.add_argument("--link-ms", type=float, help="with --bandwidth: the time the codes may take on the link (a TTFT "
                                                 "target less the producer's measured work); prints the level chosen")
    p.add_argument("--kl-samples", type=int, default=8, help="held-out samples scoring each level's KL")
    p.add_argument("--work-dir", default="runs/eval")
    p.add_argument("--threads", type=int, help="torch threads for every phase (default: torch's, every core); a "
                                               "replica runs with as many as its num_cpus (1 by default)")
    p.add_argument("--json", action="store_true")
    return p


def checked(args: argparse.Namespace) -> tuple[list[int], list[int] | None, list[float] | None, bool]:
    """The measurement's settings, refused in one line where they make no sense: (prefix lengths, fan-out
    counts or None, bandwidths or None, whether to sweep the code levels against a time target)."""
    sizes = positives(args.tokens, "--tokens")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads must be positive, got {args.threads}")
    ns = positives(args.fanout, "--fanout") if args.fanout else None
    gbps = positives(args.bandwidth, "--bandwidth", float) if args.bandwidth else None
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be positive, got {args.repeats}")
    sweep = args.ttft_target is not None or args.link_ms is not None
    if args.ttft_target is not None and args.link_ms is not None:
        raise SystemExit("give --ttft-target or --link-ms, not both")
    if sweep and (not gbps or not (args.ttft_target or args.link_ms or 0) > 0 or args.kl_samples < 1):
        raise SystemExit("--ttft-target and --link-ms need --bandwidth, a positive time and --kl-samples >= 1")
    return sizes, ns, gbps, sweep


def row(args, pair: str, m: dict, art, ns, gbps, plot_dir: Path | None, kls: dict | None) -> dict:
    """One prefix length's result from its measurement `m`: the consumer's side, and the fan-out, the TTFT
    against bandwidth (with its plot) and the level chosen at each link where asked."""
    n = m["tokens"]
    r = {**consumer_side(m), "threads": torch.get_num_threads()}
    if ns:
        r["fanout"] = fanout(m, ns)
    if gbps:
        cold, warm = ttft(m, gbps), ttft(m, gbps, prefilled=True)
        png = plot_dir / f"ttft_vs_bandwidth_{pair.replace(':', '_')}_{n}.png"
        plot_ttft(gbps, cold, warm, png, f"{pair}, {n}-token prefix: TTFT against link bandwidth")
        r["bandwidth"] = {"gbps": gbps, "ttft_ms": cold, "ttft_prefilled_ms": warm, "plot": str(png),
                          "phases": m["methods"], "producer_prefill_ms": m["producer_prefill_ms"]}
        if kls is not None:
            r["links"] = per_link(m, art, gbps, args.ttft_target, kls, args.link_ms)
            raw = m["methods"]["raw_kv"]["payload_bytes"]
            r["levels"] = [{"level": lv, "payload_ratio": m["methods"][name]["payload_bytes"] / raw, "kl": kls[name]}
                           for lv, name in ((lv, methods.level_name(art, lv)) for lv in art.levels)]
    return r


def report(args, pair: str, m: dict, r: dict) -> None:
    """A row as tables: the consumer's side, then the fan-out, the bandwidths and the links where measured."""
    _print_default(pair, r)
    if "fanout" in r:
        _print_fanout(pair, m, r["fanout"])
    if "bandwidth" in r:
        bw = r["bandwidth"]
        _print_bandwidth(pair, m, bw["gbps"], bw["ttft_ms"], bw["ttft_prefilled_ms"], Path(bw["plot"]))
    if "links" in r:
        _print_links(pair, m, args.ttft_target, args.link_ms, args.kl_samples, r["links"], r["levels"])


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(parser(), argv)
    sizes, ns, gbps, sweep = checked(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        plot_dir = output_folder("--plot-dir", args.plot_dir) if gbps else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    pa, pb, na, nb = resolve_pair(args)
    producer, consumer, tok, spec = load_pair(pa, pb, consumer_base=getattr(args, "consumer_base", None))
    pair = f"{na}:{nb}"
    _, val, _ = samples.pair_data(nb, tok, 0, args.val, 0, args.prefix_tokens, text_file=args.text, seed=args.seed)
    found = structure.find(producer, consumer, pb if is_adapter(pb) else None)
    art = exact_artifact(args, producer, consumer, spec, tok, pair, found, val) or \
        calibrated(args, producer, consumer, spec, tok, pair)
    all_ids = tok("\n\n".join(demo_data.prose_texts("heldout")), add_special_tokens=False)["input_ids"]
    if len(all_ids) < max(sizes):
        raise SystemExit(f"only {len(all_ids)} tokens of text available, asked for {max(sizes)}")
    kls = None
    if sweep:
        _, _, held = samples.pair_data(nb, tok, 0, 1, args.kl_samples, args.prefix_tokens, text_file=args.text,
                                       seed=args.seed)
        kls = {methods.level_name(art, {k: t[k] for k in art.reuse_ranks}): t["kl"]
               for t in scoring.level_kls(producer, consumer, art, held)}
    out = []
    for n in sizes:
        m = measure(producer, consumer, art, torch.tensor(all_ids[:n])[None], args.repeats, args.dtype,
                    every_method=gbps is not None)
        r = row(args, pair, m, art, ns, gbps, plot_dir, kls)
        out.append(r)
        if args.json:
            print(json.dumps(r))
        else:
            report(args, pair, m, r)
    return out


if __name__ == "__main__":
    main()
