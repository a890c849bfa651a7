"""Exact plans of a consumer that shares layers with its producer, and the one chosen under a loss bound.

A consumer whose layers [0, s) are the producer's (scd.fitting.structure) has a family of plans, one per
entry layer e in [s, L]: the producer's K and V at layers [1, e) (exact below s, the producer's own, not the
consumer's, from s on), the producer's residual entering e, and the consumer's own layers e..L-1. Entering at s
is lossless; entering higher costs the consumer less compute (L - e layers of a prefill) and sends more shared
layers, at the error of the layers [s, e) it takes from the producer. `curve` measures every such plan on
validation samples; `choose` takes the one that meets the quality bound at the least modeled time to first
token, under a ceiling on consumer compute.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting import scoring
from scd.fitting.gram import JointGram
from scd.online import klt
from scd.online.artifacts import PairArtifacts, exact_plan
from scd.online.links import ready_ms
from scd.online.trace import capture


LOSSLESS_KL = 1e-4          # nats per token: a cache this close to the oracle's is lossless, whatever raw KV scores


def ratio_applies(raw_kl: float, max_kl: float | None) -> bool:
    """Whether a plan is held to a multiple of raw KV reuse's KL: always, unless raw KV is itself lossless (an
    aLoRA's prefix, where no compressed plan is within any multiple of it) and an absolute max_kl is set,
    which is then the bound (without one, only a lossless plan passes)."""
    return raw_kl > LOSSLESS_KL or max_kl is None


@dataclass(frozen=True)
class Bound:
    """What a chosen plan must meet: KL at most max_kl_ratio x raw KV reuse's (and max_kl, when set; and a
    retained gain of at least min_retained_gain, when set and the point has one), or lossless (LOSSLESS_KL:
    where raw KV is itself exact, an aLoRA's prefix, no ratio to it can be met: max_kl alone then, when set,
    `ratio_applies`), with the consumer running at most max_consumer_ratio of its layers over the prefix.

    noise_z: where the point and raw KV carry their per-sample KLs ("kls", on the same samples), the ratio is
    met only when the plan's KLs are below max_kl_ratio x raw KV's by at least noise_z standard errors of the
    paired differences. Of many plans measured on the same few samples, the cheapest one within the bound by
    its mean alone is often the one whose validation KL came out low by chance, and reads higher on other text
    (0: the means alone)."""
    max_kl_ratio: float
    max_consumer_ratio: float
    max_kl: float | None = None
    min_retained_gain: float | None = None    # of the specialist's gain over the base alone, where measured
    noise_z: float = 0.0

    def within_ratio(self, point: dict, raw_kl: float, raw_kls: list[float] | None = None) -> bool:
        """Whether the point's KL is within max_kl_ratio x raw KV's (by noise_z standard errors, where both
        carry per-sample KLs of the same samples)."""
        kls = point.get("kls")
        if not (self.noise_z and kls and raw_kls and len(kls) == len(raw_kls)):
            return point["kl"] <= self.max_kl_ratio * raw_kl
        return scoring.beats([self.max_kl_ratio * r for r in raw_kls], kls, self.noise_z)

    def meets(self, point: dict, raw_kl: float, raw_kls: list[float] | None = None) -> bool:
        gain = point.get("retained_gain")
        quality = point["kl"] <= LOSSLESS_KL or (
            (self.within_ratio(point, raw_kl, raw_kls) or not ratio_applies(raw_kl, self.max_kl))
            and (self.max_kl is None or point["kl"] <= self.max_kl)
            and (self.min_retained_gain is None or gain is None or gain >= self.min_retained_gain))
        return quality and point["consumer_ratio"] <= self.max_consumer_ratio + 1e-9


def entries(first_adapted: int, num_layers: int, points: int = 5, adapted_until: int | None = None) -> list[int]:
    """Entry layers to measure: first_adapted (lossless), num_layers (every layer the producer's: raw KV but
    layer 0) and evenly spaced ones between; below adapted_until when the adapted layers end there (entering
    above them gives the producer's own K and V back, raw KV's quality, at a cost)."""
    top = adapted_until if adapted_until is not None else num_layers
    span = top - first_adapted
    inner = {first_adapted + round(i * span / (points - 1)) for i in range(points - 1)}
    return sorted({e for e in inner if e < top} | {num_layers})


KLT_PREFIXES = 32           # calibration prefixes the transform codes are fitted on (a 192-wide covariance per
                            # layer and stream: 32 prefixes of 512 tokens give 16k rows)


@torch.no_grad()
def klt_codecs(producer, prefixes, num_layers: int, step: float) -> tuple[dict, dict]:
    """The transform codes (scd.online.klt) of the producer's keys and values at every layer, fitted on the
    first KLT_PREFIXES of `prefixes` (token id lists): ({layer: keys' codec}, {layer: values' codec})."""
    sk, sv = {}, {}                                   # layer -> the Gram of its rows, the sinks left out
    for ids in tqdm(prefixes[:KLT_PREFIXES], desc="klt axes", leave=False):
        ids = torch.as_tensor(ids)[None]
        tr = capture(producer, ids, want_xnorm=False)
        keep = klt.without_sinks(tr.mask)
        for l in range(num_layers):
            for grams, x in ((sk, tr.content[l]), (sv, tr.values[l])):
                r = klt.rows(x)[keep].cpu()
                grams.setdefault(l, JointGram(r.shape[1], 0)).update(r, r[:, :0])
    make = lambda g: klt.codec(g.s / g.n, g.cov(), step)  # noqa: E731
    return {l: make(g) for l, g in sk.items()}, {l: make(g) for l, g in sv.items()}


def artifact(pair: str, spec, entry: int, code_dtype: str, info: dict | None = None,
             whole_prefix: bool = False, klt_codes: tuple[dict, dict] | None = None) -> PairArtifacts:
    """The exact plan entering at `entry` (num_layers: no entry, every layer shared; whole_prefix: an aLoRA's,
    layer 0 sent too, since the consumer's own layer 0 is adapted); klt_codes: `klt_codecs`, for code_dtype
    "klt"."""
    if code_dtype == "klt" and klt_codes is None:
        raise ValueError("an exact plan sent as klt needs its transform codes (klt_codecs)")
    return PairArtifacts.exact(pair, spec, exact_plan(spec.num_layers, entry, whole_prefix), code_dtype, info,
                               klt_codes)


POINT_KEYS = ("kl", "kls", "payload_ratio", "payload_bytes", "consumer_ms", "producer_ms", "greedy", "entry_bytes",
              "block_ms", "tail_ms")


def measured_point(row: dict, keys: tuple[str, ...] = POINT_KEYS) -> dict:
    """A curve point's figures from its Evaluator row; with the row's costs at a serving length (Evaluator.run's
    cost_tokens), those too, under "serving" (what modeled_ttft_ms reads first)."""
    out = {k: row.get(k) for k in keys}
    if row.get("at_cost_tokens"):
        out["serving"] = {**row["at_cost_tokens"], "tokens": row["cost_tokens"]}
    return out


def curve(producer, consumer, tok, pair: str, spec, found, samples, code_dtype: str, points: int = 5,
          desc: str = "exact plans", klt_codes: tuple[dict, dict] | None = None,
          serving_tokens: int = 0) -> tuple[list[dict], dict]:
    """(one point per entry layer: {entry, consumer_ratio, kl, payload_ratio, payload_bytes, consumer_ms, ...},
    the raw-KV row measured beside them on `samples`). An aLoRA (found.invocation_tokens) has one plan: its whole
    prefix shared (entry num_layers). `serving_tokens`: each plan's costs timed on a prefix that long too."""
    whole = found.invocation_tokens is not None
    es = [spec.num_layers] if whole else entries(found.first_adapted, spec.num_layers, points, found.adapted_until)
    ms = [methods.RawKV()] + [methods.SCDMethod(artifact(pair, spec, e, code_dtype, whole_prefix=whole,
                                                         klt_codes=klt_codes), f"enter@{e}") for e in es]
    rows = {r["method"]: r for r in Evaluator(producer, consumer, tok).run(samples, ms, desc=desc,
                                                                          cost_tokens=serving_tokens)}
    out = [{"entry": e, "consumer_ratio": (spec.num_layers - e) / spec.num_layers, "dtype": code_dtype,
            **measured_point(rows[f"enter@{e}"])} for e in es]
    return out, rows["raw_kv"]


def modeled_ttft_ms(point: dict, gbps: float) -> float:
    """The consumer's time to its cache once the producer holds the prefix: the producer's encode, then the
    payload over the link and the consumer's compute, overlapped where the payload goes E-first (links.ready_ms;
    each measured; an older record without the encode or the parts counts none). At the serving length where
    the point was timed there too ("serving"), else at the samples' length."""
    p = point.get("serving") or point
    tail = p.get("tail_ms", None if point.get("tail") else 0.0)       # a tail timed with the rest before tail_ms
    return p.get("producer_ms", 0.0) + ready_ms(p["payload_bytes"], p["consumer_ms"], gbps, p.get("entry_bytes", 0),
                                                p.get("block_ms", 0.0), tail)


def choose(points: list[dict], raw_kl: float, bound: Bound, gbps: float,
           raw_kls: list[float] | None = None) -> dict | None:
    """The point that meets `bound` at the least modeled TTFT over a `gbps` link (ties: the lower KL); None
    when none does. raw_kls: raw KV's per-sample KLs, for the bound's noise margin."""
    ok = [p for p in points if bound.meets(p, raw_kl, raw_kls)]
    return min(ok, key=lambda p: (modeled_ttft_ms(p, gbps), p["kl"])) if ok else None


def describe(points: list[dict], raw_kl: float) -> str:
    """One line of a curve: each entry's KL, payload and consumer compute, and raw KV's KL."""
    return ", ".join(f"enter@{p['entry']}{' ' + p['dtype'] if 'dtype' in p else ''} KL {p['kl']:.4f} payload "
                     f"{p['payload_ratio']:.3f} consumer {p['consumer_ratio']:.2f}" for p in points) + \
        f"; raw KV {raw_kl:.4f}"


def at_length(point: dict) -> str:
    """", timed at N tokens" where the point's costs were timed at a serving length, else nothing."""
    return f", timed at {point['serving']['tokens']} tokens" if point.get("serving") else ""


def wire_forms(code_dtype: str) -> list[str]:
    """The wire forms an exact plan is measured in: "auto" chooses between the lossless bf16 and klt per link."""
    return ["bf16", "klt"] if code_dtype == "auto" else [code_dtype]


def select(producer, consumer, tok, pair: str, spec, found, samples, code_dtype: str, bound: Bound,
           gbps: float, log, measured: dict | None = None, klt_codes: tuple[dict, dict] | None = None,
           serving_tokens: int = 0) -> dict:
    """Measure the curve of a consumer whose structure is `found` (scd.fitting.structure) on `samples`, in each
    of `wire_forms(code_dtype)` (or take `measured`, a record of an earlier measurement) and choose under
    `bound` at the least modeled TTFT, with each plan's costs timed at `serving_tokens` (0: at the samples'
    length): {"points" (each with its "dtype"), "raw_kv", "chosen" (None when no plan meets the bound), "gbps",
    "bound"}."""
    if measured is None:
        points = []
        for d in wire_forms(code_dtype):
            more, raw = curve(producer, consumer, tok, pair, spec, found, samples, d, desc=f"exact plans {pair} {d}",
                              klt_codes=klt_codes if d == "klt" else None, serving_tokens=serving_tokens)
            points += more
        measured = {"points": points, "raw_kv": {k: raw[k] for k in ("kl", "kls", "payload_ratio", "consumer_ms")}}
    raw_kl = measured["raw_kv"]["kl"]
    log(f"exact plans (validation): {describe(measured['points'], raw_kl)}")
    chosen = choose(measured["points"], raw_kl, bound, gbps, measured["raw_kv"].get("kls"))
    if chosen is None:
        log(f"no exact plan meets KL <= {bound.max_kl_ratio:g} x raw KV with the consumer running at most "
            f"{bound.max_consumer_ratio:g} of its layers")
    else:
        log(f"exact plan: enter at layer {chosen['entry']}, {chosen['dtype']} (validation KL {chosen['kl']:.2e}, payload "
            f"{chosen['payload_ratio']:.3f}, consumer {chosen['consumer_ratio']:.2f} of a prefill; the least "
            f"modeled TTFT at {gbps:g} Gbps within the bound{at_length(chosen)})")
    return {**measured, "chosen": chosen, "gbps": gbps, "bound": vars(bound)}
