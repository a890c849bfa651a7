"""The calibration job's plan stages: a pair's plan chosen under its quality bound (scd.fitting.exact.Bound)
at the least modeled TTFT on its link. An exact plan where the consumer shares layers with the producer
(scd.fitting.exact), else a recompute block over the fitted codes where they alone miss the bound
(scd.fitting.blocks). Each curve is measured on the validation samples and checkpointed."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from scd.data import samples
from scd.fitting import blocks, exact, points, selector
from scd.fitting.calibrate import Calibration
from scd.fitting.checkpoints import artifact_digest, load_record, plan_digest, samples_digest, save_record
from scd.online import selective
from scd.online.models import weights_digest
from scd.online.reuse import LinearCodec
from scd.online.trace import capture

DEFAULT_GBPS = 25.0             # the link a plan is chosen for when the config names none
Log = Callable[[str], None]


def wire_tag(c) -> str:
    """An exact plan's wire form as a checkpoint name: its dtype, and klt's step."""
    return c.exact_dtype + (f"{c.exact_step:g}" if "klt" in exact.wire_forms(c.exact_dtype) else "")


def serving_tokens(cal: Calibration, c) -> int:
    """The prefix length plans are timed at (c.serving_tokens, at most the consumer's context; 0: none)."""
    context = getattr(cal.consumer.config, "max_position_embeddings", None) or c.serving_tokens
    return min(c.serving_tokens, context)


def exact_plan(cal: Calibration, tok, found, val, c, gbps: float | None, log: Log,
               klt_codes=None) -> dict | None:
    """The exact plan chosen under the quality bound (scd.fitting.exact), from its curve measured on the
    validation samples (checkpointed), or None when none meets the bound: then codes are fitted."""
    tokens = serving_tokens(cal, c)
    path = cal.trace_dir / f"exact-curve-{wire_tag(c)}.json"
    inputs = {"samples": samples_digest(val), "per_sample_kls": True, **({"serving_tokens": tokens} if tokens else {})}
    rec = exact.select(cal.producer, cal.consumer, tok, cal.pair, cal.spec, found, val, c.exact_dtype,
                       exact_bound(c), gbps or DEFAULT_GBPS,
                       log, load_record(path, inputs, log), klt_codes=klt_codes, serving_tokens=tokens)
    save_record(path, {k: rec[k] for k in ("points", "raw_kv")}, inputs)
    return rec if rec["chosen"] is not None else None


def quality_bound(c) -> exact.Bound:
    """A pair's quality bound from its calibration settings (or `scd eval`'s flags, which have their names)."""
    return exact.Bound(c.max_kl_ratio, c.max_consumer_prefill_ratio, c.max_kl, c.min_retained_gain, c.bound_noise_z)


def exact_bound(c) -> exact.Bound:
    """The bound exact plans are chosen under: quality_bound without the retained gain."""
    return dataclasses.replace(quality_bound(c), min_retained_gain=None)


def block_entries(cal: Calibration, c) -> list[int]:
    """The entry layers the block stage tries: the configured ones (calibration.entries), else four evenly
    spaced up to the ceiling on the consumer's compute. A configured entry needs one of its blocks (up to the
    top, or to one of calibration.stops) within the ceiling."""
    n, ceiling = cal.spec.num_layers, c.max_consumer_prefill_ratio
    if c.entries is None:
        return blocks.entries(n, ceiling)
    over = [e for e in c.entries if not any(within(e, s, n, ceiling) for s in [n, *c.stops])]
    if over:
        ends = f"{n} layers" + (f" or stops {sorted(c.stops)}" if c.stops else "")
        raise SystemExit(f"calibration.entries of {cal.pair}: {over} not below {ends} within "
                         f"max_consumer_prefill_ratio {ceiling:g} (a block from e to s costs (s - e) / {n} of a "
                         f"prefill)")
    return sorted(set(c.entries))


def within(entry: int, stop: int, num_layers: int, ceiling: float) -> bool:
    """Whether the block of layers entry..stop-1 is one the consumer may run under `ceiling`."""
    return 1 <= entry < stop <= num_layers and stop - entry <= blocks.most_layers(num_layers, ceiling)


def block_spans(cal: Calibration, c, es: list[int]) -> list[tuple[int, int]]:
    """The blocks the block stage tries, as (entry, stop): each entry up to the top, and with calibration.stops
    each entry up to each stop above it (layers entry..stop-1, the codes above), within the consumer's ceiling."""
    n, ceiling = cal.spec.num_layers, c.max_consumer_prefill_ratio
    return [(e, s) for s in [n, *sorted(set(c.stops) - {n})] for e in es if within(e, s, n, ceiling)]


def span_id(entry: int, stop: int, num_layers: int) -> "int | str":
    """How a block's entry map is named in entry_tensors and entries-trained.json: its entry layer for a block
    up to the top, "<entry>:<stop>" for one that ends below it."""
    return entry if stop == num_layers else f"{entry}:{stop}"


def entry_map(tensors: dict, entry: int, stop: int, num_layers: int) -> LinearCodec:
    """A block's entry map from entry_tensors."""
    return LinearCodec.from_tensors(tensors, f"entry.{span_id(entry, stop, num_layers)}")


def key(point: dict, num_layers: int) -> tuple[int, int, int, str]:
    """A curve point's plan: (entry, stop, tail, the tail's rule)."""
    return point["entry"], point.get("stop", num_layers), point.get("tail", 0), point.get("rule", "last")


def sorted_points(points: list[dict], num_layers: int) -> list[dict]:
    """A curve's points in its record's order: the codes alone first, then by entry and stop, each alone and then
    by its tail's rule and length."""
    return sorted(points, key=lambda p: (p["entry"] < num_layers, p["entry"], p.get("stop", num_layers),
                                         bool(p.get("tail")), p.get("rule", "last"), p.get("tail", 0)))


def selector_windows(name: str, tok, c, tune: list, long_tokens: int, text_file: str | None = None) -> list:
    """What a selector is fitted on (calibration.selector_samples windows with continuations, at most twice
    the fine-tuning samples): half of them the fine-tuning samples (prefix_tokens long), half windows of
    `long_tokens` (the length plans are served and timed at) where the consumer's data (`text_file`, else its
    domain's) holds them, interleaved; else the fine-tuning samples alone. A selector fitted at one length
    carries poorly to another (docs/results/token-recompute.md, "A selector learned at calibration")."""
    n = c.selector_samples
    if long_tokens <= c.prefix_tokens:
        return tune[:n]
    try:
        long = samples.tune_samples(name, tok, min(n // 2, len(tune)), long_tokens, selective.READ_TOKENS,
                                    text_file=text_file)
    except ValueError:                                  # too few documents that long (qa's notes)
        return tune[:n]
    if any(x.prefix.shape[-1] < long_tokens for x in long):   # documents shorter than that, whole
        return tune[:n]
    short = tune[:n - len(long)]
    return [s for pair in zip(short, long) for s in pair] + short[len(long):]


def selector_stage(cal: Calibration, art, tok, c, tune: list, log: Log, text_file: str | None = None):
    """The calibration's selector stage: the codes `art` with a selector fitted on selector_windows of the
    fine-tuning samples `tune` (with_selector); `art` as it is with calibration.selector_samples 0 or no
    fine-tuning samples."""
    if not (c.selector_samples and tune):
        return art
    windows = selector_windows(cal.pair.split(":")[1], tok, c, tune, serving_tokens(cal, c), text_file)
    return with_selector(cal, art, windows, log)


def with_selector(cal: Calibration, art, tune: list, log: Log):
    """The codes `art` with a selector of the positions selective recompute runs (scd.fitting.selector),
    fitted on `tune` (samples with continuations: selector_windows) over the cache the codes rebuild; checkpointed in
    selector.json. Its penalty and ranking overlap go to art.info["selector"]."""
    if len(tune) < 2:
        log(f"selector: not fitted ({len(tune)} fine-tuning sample; it needs 2 or more)")
        return art
    layers = selective.selector_layers(cal.spec.num_layers)
    path = cal.dir / "selector.json"
    inputs = {"samples": samples_digest(tune), "artifact": artifact_digest(art)}
    rec = load_record(path, inputs, log)
    if rec is None:
        w, fitted = selector.fit_over(cal.consumer, tune, lambda ids, mask: blocks.codes_kv(
            cal.consumer, art, ids, capture(cal.producer, ids, mask)), layers, desc=f"selector {cal.pair}")
        rec = save_record(path, {"weights": w.tolist(), "layers": layers, "penalty": fitted["penalty"],
                                 "overlap": {f"{k:g}": round(v, 4) for k, v in fitted["overlap"].items()}}, inputs)
    overlap = rec["overlap"][f"{rec['penalty']:g}"]
    lengths = sorted({x.prefix.shape[-1] for x in tune})
    log(f"selector: fitted on {len(tune)} samples of {lengths[0]}-{lengths[-1]} tokens, V of layers "
        f"{rec['layers']}; its top 20 % hold {overlap:.2f} of the 20 % its target ranks highest (the most read) "
        f"on the fifth of them it was not fitted on")
    art.info["selector"] = {k: rec[k] for k in ("layers", "penalty", "overlap")} | {"samples": len(tune)}
    return dataclasses.replace(art, selector=torch.tensor(rec["weights"]), selector_layers=list(rec["layers"]))


def block_plan(cal: Calibration, art, tok, calib, val, c, gbps: float | None, log: Log,
               tune: list | None = None):
    """The fitted codes where they meet the quality bound on the validation samples; else the recompute block
    over them (scd.fitting.blocks) that meets it at the least modeled TTFT, when one does (else the codes, and
    the quality gate decides). The curve is checkpointed point by point and recorded in art.info["blocks"]: a
    new entry (a raised ceiling, calibration.entries) measures only itself; its consumer time is then timed
    in another run than the others'. With calibration.tails each plan (the codes alone, each entry) is measured
    with the consumer running the prefix's last k tokens too, for each k, and with calibration.selective the
    share f of its positions that its last attend to most, for each f, and that its selector picks where the
    codes carry one (calibration.selector_samples); each may be chosen so."""
    bound = quality_bound(c)
    n, es = cal.spec.num_layers, block_entries(cal, c)
    spans = block_spans(cal, c, es)
    tokens = serving_tokens(cal, c)
    path = cal.dir / "blocks.json"
    trained = {k: getattr(c, k) for k in ("entry_train_samples", "entry_train_epochs", "entry_train_lr")}
    inputs = {"samples": samples_digest(val), "per_sample_kls": True, **({"serving_tokens": tokens} if tokens else {}),
              **(trained if c.entry_train_samples else {})}
    rec = load_record(path, inputs, log)
    if rec is not None:
        rec["points"] = resumable(rec["points"], selector_digest(art))
    if rec is None:
        codes_pts, raw = blocks.curve(cal.producer, cal.consumer, tok, art, {}, val, desc=f"codes {cal.pair}",
                                      serving_tokens=tokens)
        rec = save_record(path, {"points": codes_pts, "raw_kv": {k: raw[k] for k in ("kl", "kls", "payload_ratio")}}, inputs)

    def add(more: list[dict]) -> None:
        nonlocal rec
        rec = save_record(path, {**rec, "points": sorted_points(rec["points"] + more, n)}, inputs)

    t_val = val[0].prefix.shape[-1]
    want = share_plans(cal, c, spans, t_val, learned=art.selector is not None, questions=val[0].question is not None)
    if not bound.meets(rec["points"][0], rec["raw_kv"]["kl"], rec["raw_kv"].get("kls")):
        have = {key(p, n) for p in rec["points"]}
        entry_points(cal, art, tok, calib, val, c, [(e, s) for e, s in spans if (e, s, 0, "last") not in have],
                     tune, log, add)
        share_points(cal, art, tok, val, c, [w for w in want if w not in have], add)
    rec = {**rec, "points": [p for p in rec["points"] if (p["entry"] == n or (p["entry"], p.get("stop", n)) in spans)
                             and (not p.get("tail") or key(p, n) in want)]}
    return chosen_plan(cal, art, rec, bound, gbps, t_val, log)


def entry_tensors(cal: Calibration):
    """Where the entries' aligners are kept."""
    return cal.dir / "entry-aligners.safetensors"


def entry_points(cal: Calibration, art, tok, calib, val, c, todo: list[tuple[int, int]], tune: list | None, log: Log,
                 add: Callable[[list[dict]], None]) -> None:
    """The blocks `todo` ((entry, stop)) fitted (each entry map trained end to end through its block, with the
    codes below and above it, over calibration.entry_train_samples), kept in entry_tensors, and their points
    measured (`add`ed to the curve). Each trained map is kept as soon as it is trained (recorded in
    entries-trained.json with what it was trained on): a job stopped among them trains only the rest when run
    again."""
    if not todo:
        return
    n = cal.spec.num_layers
    tensors = entry_tensors(cal)
    kept = load_file(str(tensors)) if tensors.is_file() else {}
    trained_path = cal.dir / "entries-trained.json"
    trained_inputs = {"samples": samples_digest(tune[:c.entry_train_samples]) if tune else None,
                      "codes": plan_digest(art), "epochs": c.entry_train_epochs, "lr": c.entry_train_lr}
    done = (load_record(trained_path, trained_inputs, log) or {}).get("entries", []) if c.entry_train_samples else []
    by_id = {span_id(e, s, n): (e, s) for e, s in todo}
    done = [i for i in done if i in by_id and f"entry.{i}.enc" in kept]
    aligners = {by_id[i]: LinearCodec.from_tensors(kept, f"entry.{i}") for i in done}
    if done:
        log(f"entries {done}: trained end to end before, resumed")
    fresh = [b for b in todo if b not in aligners]
    if fresh:
        closed = blocks.fit_aligners(cal.producer, cal.consumer, calib[:48], sorted({e for e, _ in fresh}))
        aligners |= {(e, s): closed[e] for e, s in fresh}
    if c.entry_train_samples and not tune:
        log("entry_train_samples is set but there are no fine-tuning samples (finetune_samples 0): the "
            "entries keep their closed form")
    elif c.entry_train_samples:                     # each entry trained end to end over these codes
        around = lambda ids, tr: blocks.codes_kv(cal.consumer, art, ids, tr)   # noqa: E731
        for e, s in fresh:
            aligners[e, s], curve = blocks.train_entry(cal.producer, cal.consumer, e, aligners[e, s], around,
                                                       tune[:c.entry_train_samples],
                                                       c.entry_train_epochs, c.entry_train_lr, stop=s)
            log(f"entry {span_id(e, s, n)} trained end to end: training KL {' -> '.join(f'{v:.4f}' for v in curve)}")
            kept |= aligners[e, s].tensors(f"entry.{span_id(e, s, n)}")
            save_file(kept, str(tensors))
            done.append(span_id(e, s, n))
            save_record(trained_path, {"entries": done}, trained_inputs)
    for (e, s), a in aligners.items():
        kept |= a.tensors(f"entry.{span_id(e, s, n)}")
    save_file(kept, str(tensors))
    more, _ = blocks.curve(cal.producer, cal.consumer, tok, art, aligners, val, with_codes=False,
                           desc=f"recompute blocks {cal.pair}", serving_tokens=serving_tokens(cal, c))
    add(more)


def resumable(points: list[dict], selector: str | None) -> list[dict]:
    """The checkpointed curve points that stand under the codes' selector (selector_digest): not a tail timed as
    a fixed count of tokens at the serving length (before tail_of), nor the learned rule's by another selector.
    The others are measured again."""
    return [p for p in points if (not p.get("tail") or p.get("tail_of"))
            and (p.get("rule") != "learned" or p.get("selector") == selector)]


def selector_digest(art) -> str | None:
    """What identifies the selector `art` carries (None without one): the learned rule's curve points record
    it, and are measured again under another."""
    return None if art.selector is None else weights_digest({"weights": art.selector,
                                                             "layers": torch.tensor(art.selector_layers)})


def share_plans(cal: Calibration, c, spans: list[tuple[int, int]], t_val: int, learned: bool,
                questions: bool = False) -> list[tuple[int, int, int, str]]:
    """The plans with a share of the prefix's positions run by the consumer too, within its ceiling: (entry,
    stop, count, rule) for the codes alone and each block of `spans`, with each tail of calibration.tails (rule
    "last") and each share of calibration.selective by the attention rule and, with `learned` (the codes carry
    a selector), the learned one, and with `questions` (the samples are QA: a question follows the prefix, as a
    request's suffix does), the suffix rule's."""
    n = cal.spec.num_layers
    shares = sorted({round(f * t_val) for f in c.selective} - {0})
    runs = {"last": sorted(set(c.tails) - {0}), "attention": shares,
            **({"learned": shares} if learned else {}), **({"suffix": shares} if questions else {})}
    return [(e, s, k, rule) for e, s in [(n, n)] + spans for rule, ks in runs.items() for k in ks
            if points.consumer_ratio(e, k, n, t_val, rule, s) <= c.max_consumer_prefill_ratio + 1e-9]


def share_points(cal: Calibration, art, tok, val, c, missing: list[tuple[int, int, int, str]],
                 add: Callable[[list[dict]], None]) -> None:
    """The plans `missing` (share_plans') measured, one run per rule (`add`ed to the curve)."""
    n = cal.spec.num_layers
    for rule in dict.fromkeys(r for *_, r in missing):
        mine = [(e, s, k) for e, s, k, r in missing if r == rule]
        spans = sorted({(e, s) for e, s, _ in mine})
        t = load_file(str(entry_tensors(cal))) if any(e < n for e, _ in spans) else {}
        more, _ = blocks.curve(cal.producer, cal.consumer, tok, art,
                               {(e, s): entry_map(t, e, s, n) for e, s in spans if e < n}, val,
                               with_codes=(n, n) in spans,
                               desc=f"{'tails' if rule == 'last' else rule + ' selective'} {cal.pair}",
                               serving_tokens=serving_tokens(cal, c), tails=tuple(sorted({k for *_, k in mine})),
                               only=mine, rule=rule)
        add([p | {"selector": selector_digest(art)} if rule == "learned" else p for p in more])


def chosen_plan(cal: Calibration, art, rec: dict, bound: exact.Bound, gbps: float | None, t_val: int, log: Log):
    """The plan of the curve `rec` within `bound` at the least modeled TTFT on the link (recorded in
    art.info["blocks"]), as the artifact to publish: the codes, with a block and a share of positions run by the
    consumer where chosen (`t_val`: the validation prefixes' length)."""
    n = cal.spec.num_layers
    raw_kl = rec["raw_kv"]["kl"]
    log(f"plans (validation): {blocks.describe(rec['points'], raw_kl, n)}")
    chosen = exact.choose(rec["points"], raw_kl, bound, gbps or DEFAULT_GBPS, rec["raw_kv"].get("kls"))
    art.info["blocks"] = {**rec, "chosen": chosen, "bound": vars(bound), "gbps": gbps or DEFAULT_GBPS,
                          "num_layers": n, "prefix_tokens": t_val}
    tail, rule = (chosen.get("tail", 0), chosen.get("rule", "last")) if chosen else (0, "last")
    tail_note = f", and {points.tail_phrase(tail, rule)} through every layer" if tail else ""
    if chosen is None or chosen["entry"] == n:
        log(("codes alone" + tail_note + " (within the quality bound)") if chosen
            else "codes alone: no plan meets the quality bound")
        return art.with_tail(tail, t_val, rule) if tail else art      # (a copy shares art.info)
    e, s = chosen["entry"], chosen.get("stop", n)
    out = blocks.block_artifact(art, e, entry_map(load_file(str(entry_tensors(cal))), e, s, n), s)
    out = out.with_tail(tail, t_val, rule)
    log(f"recompute block: the consumer runs layers {e}-{s - 1} from the aligned residual"
        f"{blocks.codes_above(s, n)}{tail_note} "
        f"(validation KL {chosen['kl']:.4f}, consumer {chosen['consumer_ratio']:.2f} of a prefill; the least "
        f"modeled TTFT within the bound{exact.at_length(chosen)})")
    return out
