"""Recompute blocks over codes: plans for a consumer adapted on every layer, chosen under the quality bound.

A consumer that shares nothing exactly with its producer (an adapter on every layer) is served by codes
(Reuse + Patch). Where those miss the quality bound, the consumer may spend compute: it runs its own layers
e..L-1 over the prefix, entered from the producer's residual stream at e, and takes the codes' K and V below
e. The producer's residual is not the consumer's (every adapted layer below moved it), so it enters through
an aligner: a linear map fitted in closed form (ridge) from the producer's residual at e to the difference
between the two models' residuals there, on the calibration prefixes. Entering through the aligner, with the
codes below, reaches KL the producer's own residual does not (`tools.probe_entry`;
docs/results/recompute-blocks.md, "What a recompute block can reach").

A block may also end below the top (`stop`): the consumer runs layers e..s-1 only, and the codes serve the
layers above it again, where they alone rebuild well (qa's error lives in a few layers of the middle;
docs/results/recompute-blocks.md, "A block where the error lives").

`curve` scores the codes alone and each block on the validation samples beside the oracle, the base alone and
raw KV (retained gain needs the first two); `choose` (scd.fitting.exact's) keeps the point that meets the
bound at the least modeled time to first token.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting import exact
from scd.fitting.gram import JointGram
from scd.fitting.points import consumer_ratio, name_of, point_name
from scd.online import cache, codec
from scd.online.artifacts import PairArtifacts
from scd.online.rebuild import encode, rebuild
from scd.online.recompute import layers_kv
from scd.online.reuse import LinearCodec
from scd.online.trace import capture

ENTRY_RIDGE = 1e-2          # relative to the residual's mean variance: 1e-2 and 1e-3 score alike on smollm2:qa


def most_layers(num_layers: int, ceiling: float) -> int:
    """How many of its layers the consumer may run under `ceiling` (a share of its prefill's layers)."""
    return int(ceiling * num_layers + 1e-9)


def entries(num_layers: int, ceiling: float, points: int = 4) -> list[int]:
    """Entry layers whose blocks cost the consumer up to `ceiling` of its layers, evenly spaced from one layer
    to the ceiling."""
    most = most_layers(num_layers, ceiling)
    if most < 1:
        return []
    return sorted({num_layers - max(1, round(most * (i + 1) / points)) for i in range(points)} - {0})


def fit_aligners(producer, consumer, prefixes: list[torch.Tensor], layers: list[int],
                 ridge: float = ENTRY_RIDGE) -> dict[int, LinearCodec]:
    """Per entry layer, the full-rank linear map from the producer's residual entering it to (the consumer's
    residual - the producer's), fitted on `prefixes` (one at a time: no padding)."""
    h = producer.config.hidden_size
    grams = {l: JointGram(h, h) for l in layers}
    for ids in tqdm(prefixes, desc="entry aligners"):
        ids = torch.as_tensor(ids)[None]
        a = capture(producer, ids, want_xnorm=False, want_hidden=True)
        b = capture(consumer, ids, want_xnorm=False, want_hidden=True)
        for l, g in grams.items():
            g.update(a.hidden[l][0].float(), (b.hidden[l][0] - a.hidden[l][0]).float())
    return {l: g.fit_regression(h, ridge) for l, g in grams.items()}


def codes_kv(consumer, art: PairArtifacts, ids: torch.Tensor, trace) -> list:
    """The consumer's cache rebuilt from `art`'s codes of a producer trace, as the wire rounds them: what a
    block's entry sits on (every layer `art` codes; its own block, if it has one, runs too)."""
    return rebuild(consumer, art, codec.as_received(encode(art, trace, ids), art.code_dtype))[0]


def train_entry(producer, consumer, entry: int, align: LinearCodec, below: Callable, train, epochs: int,
                lr: float, stop: int | None = None) -> tuple[LinearCodec, list[float]]:
    """The entry map at `entry` trained end to end: as one affine correction h -> h + h W + c (from `align`,
    its closed form), on KL(oracle || the consumer on the rebuilt cache) of each training sample's
    teacher-forced continuation, back through the consumer's own layers entry..stop-1 over the prefix (to the
    top by default; the consumer itself stays fixed). `below(ids, trace)`: the cache the block sits in (e.g.
    `codes_kv`), read below the entry and from `stop` up. Returns the trained map (a LinearCodec, as
    PairArtifacts.entry_align holds) and the mean training KL before and after each epoch."""
    L = consumer.config.num_hidden_layers
    stop = stop or L
    w = (align.enc @ align.dec).detach().clone().requires_grad_(True)
    c = (align.mu_b - align.mu_a @ w).detach().clone().requires_grad_(True)
    fixed = []
    with torch.no_grad():
        for s in train:
            ids = s.prefix[None]
            mask = torch.ones_like(ids)
            tr = capture(producer, ids, mask, want_hidden=True)
            own = capture(consumer, ids, mask, want_xnorm=False)
            ref = cache.extend(consumer, cache.assemble(consumer, list(zip(own.keys, own.values))), mask,
                               s.cont[None, :-1])[0]
            around = list(below(ids, tr))
            fixed.append((tr.hidden[entry].float(), mask, tr.positions, around[:entry], around[stop:],
                          s.cont[None, :-1], F.log_softmax(ref.float(), -1)))
    consumer.requires_grad_(False)
    opt = torch.optim.Adam([w, c], lr=lr)

    def kl(item) -> torch.Tensor:
        h, mask, positions, kv_below, kv_above, cont, ref = item
        block = layers_kv(consumer, h + h @ w + c, mask, positions, entry, stop)
        logits, _ = cache.forward_on_cache(consumer, cache.assemble(consumer, kv_below + block + kv_above), mask,
                                           cont)
        return (ref.exp() * (ref - F.log_softmax(logits.float(), -1))).sum(-1).mean()

    with torch.no_grad():
        curve = [sum(kl(item).item() for item in fixed) / len(fixed)]
    for _ in tqdm(range(epochs), desc=f"entry {entry} trained end to end"):
        total = 0.0
        for i in torch.randperm(len(fixed)).tolist():
            loss = kl(fixed[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        curve.append(total / len(fixed))
    h = w.shape[0]
    return LinearCodec(torch.zeros(h), w.detach(), c.detach(), torch.eye(h)), curve


def block_artifact(art: PairArtifacts, entry: int, align: LinearCodec | None,
                   stop: int | None = None) -> PairArtifacts:
    """`art`'s codes below `entry`, the consumer's own layers from there up to `stop` (the top by default),
    entered through `align`, and `art`'s codes again from `stop` up."""
    stop = stop or art.spec.num_layers
    if not entry < stop <= art.spec.num_layers:
        raise ValueError(f"a block [{entry}, {stop}) of {art.spec.num_layers} layers")
    plan = art.plan[:entry] + ["entry"] + ["recompute"] * (stop - entry - 1) + art.plan[stop:]
    return art.with_plan(plan, {entry: align} if align is not None else {})


def codes_above(stop: int, num_layers: int) -> str:
    """", the codes from `stop` up" for a block that ends below the top (its description's last words)."""
    return "" if stop == num_layers else f", the codes from {stop} up"


def curve(producer, consumer, tok, art: PairArtifacts, aligners: dict[tuple[int, int], LinearCodec], samples,
          with_codes: bool = True, desc: str = "recompute blocks", serving_tokens: int = 0,
          tails: tuple[int, ...] = (0,), only: list[tuple[int, int, int]] | None = None,
          rule: str = "last") -> tuple[list[dict], dict]:
    """(one point per plan: the codes alone (entry num_layers; with_codes) and each block of `aligners` ((entry,
    stop) -> its entry map; stop num_layers: up to the top), each with each tail of `tails` (0: none; k: the
    consumer runs k of the prefix's tokens of the samples' length, the same share at another:
    PairArtifacts.tail_for; its last ones, or by `rule` "attention" the ones they attend to most), each {entry,
    [stop,] tail, consumer_ratio, kl, payload_ratio, payload_bytes, consumer_ms, greedy, f1, retained_gain}; the
    raw-KV row), measured on `samples` beside the oracle and the base alone; `only`: just these (entry, stop,
    tail) plans of them. A tail's point records the length its share is of ("tail_of") and its rule ("rule",
    when not "last"): served, it is that share of every prefix, timed at `serving_tokens` so."""
    n = art.spec.num_layers
    plans = {**({(n, n): art} if with_codes else {}),
             **{(e, s): block_artifact(art, e, a, s) for (e, s), a in sorted(aligners.items())}}
    t = samples[0].prefix.shape[-1]
    plans = {(e, s, k): a.with_tail(k, t, rule) for (e, s), a in plans.items() for k in tails
             if only is None or (e, s, k) in only}
    name = lambda e, s, k: point_name(e, k, n, rule, s)  # noqa: E731
    ms = [methods.Oracle(), methods.BaseAlone(producer), methods.RawKV()] + [
        methods.SCDMethod(a, name(e, s, k)) for (e, s, k), a in plans.items()]
    rows = {r["method"]: r for r in Evaluator(producer, consumer, tok).run(samples, ms, desc=desc,
                                                                          cost_tokens=serving_tokens)}
    keys = exact.POINT_KEYS + ("f1", "retained_gain")
    points = [{"entry": e, **({"stop": s} if s < n else {}), "tail": k, **({"tail_of": t} if k else {}),
               **({"rule": rule} if k and rule != "last" else {}),
               "consumer_ratio": consumer_ratio(e, k, n, t, rule, s),
               **exact.measured_point(rows[name(e, s, k)], keys)} for e, s, k in plans]
    return points, rows["raw_kv"]


def describe(points: list[dict], raw_kl: float, num_layers: int) -> str:
    """One line of a curve: each plan's KL, retained gain and consumer compute, and raw KV's KL."""
    def gain(p):
        return "" if p.get("retained_gain") is None else f" gain {p['retained_gain']:.2f}"
    return ", ".join(name_of(p, num_layers) +
                     f" KL {p['kl']:.4f}{gain(p)} consumer {p['consumer_ratio']:.2f}" for p in points) + \
        f"; raw KV {raw_kl:.4f}"
