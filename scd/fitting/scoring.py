"""Scoring a layer plan on validation samples: the consumer's next-token KL(oracle || rebuilt) on top of the
cache a plan's artifacts rebuild, the number every calibration stage (ranks, policy, fine-tuning) decides by,
and the rule that tells a gain from the validation samples' noise (`beats`)."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from tqdm import tqdm

from scd.evaluation import metrics
from scd.online import cache, codec
from scd.online.artifacts import PairArtifacts
from scd.online.rebuild import encode, rebuild
from scd.online.trace import capture


KEEP_Z = 2.0
KEEP_RULE = f"paired gain > {KEEP_Z:g} standard errors"    # in the inputs of checkpoints it decided: another rule refits


def beats(before: list[float], after: list[float], z: float | None = None) -> bool:
    """Whether `after` (per-sample validation KLs) is lower than `before` (the same samples) by more than z
    (default KEEP_Z) standard errors of their paired differences. A single sample has no spread: any gain
    counts."""
    z = KEEP_Z if z is None else z
    d = [a - b for a, b in zip(after, before, strict=True)]
    mean = sum(d) / len(d)
    if len(d) < 2:
        return mean < 0
    se = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
    return mean + z * se < 0


def cheapest_within_noise(tried: list[dict]) -> dict:
    """Of scored candidates ({"kls": per-sample validation KLs on the same samples, "payload_ratio": ...}),
    the cheapest one that the lowest-KL candidate does not beat: a gain that the samples cannot tell from
    noise does not pay for more bytes."""
    best = min(tried, key=lambda t: sum(t["kls"]))
    return min((t for t in tried if not beats(t["kls"], best["kls"])), key=lambda t: t["payload_ratio"])


class PlanScorer:
    """Mean KL(oracle || rebuilt) over validation samples for a plan, with oracle traces computed once."""

    def __init__(self, producer, consumer, samples, art_for: Callable[[list[str]], PairArtifacts],
                 hidden: bool = False):
        """hidden: keep the producer's residual streams too (plans with a recompute block enter from one)."""
        self.consumer, self.art_for = consumer, art_for
        self.items = []
        for s in samples:
            ids = s.prefix[None]
            mask = torch.ones_like(ids)
            o = capture(consumer, ids, mask, want_xnorm=False)
            oracle_kv = list(zip(o.keys, o.values))
            ref, _ = cache.extend(consumer, cache.assemble(consumer, oracle_kv), mask, s.cont[None])
            self.items.append((ids, mask, capture(producer, ids, mask, want_hidden=hidden), oracle_kv, s.cont[None],
                               ref))

    def kl(self, plan: list[str], restore: "int | Iterable[int] | None" = None, streams: str = "kv") -> float:
        """Mean KL of the plan's rebuilt caches; `restore`: layer(s) whose keys and/or values (`streams`: "k",
        "v" or "kv") are replaced by the consumer's own, to see what the error there costs."""
        kls = self.kls(plan, restore, streams)
        return sum(kls) / len(kls)

    @torch.no_grad()
    def kls(self, plan: list[str], restore: "int | Iterable[int] | None" = None, streams: str = "kv") -> list[float]:
        """The KL of each validation sample (see kl)."""
        art = self.art_for(plan)
        restored = [restore] if isinstance(restore, int) else list(restore or ())
        out = []
        for ids, mask, ptrace, oracle_kv, cont, ref in self.items:
            kv, _ = rebuild(self.consumer, art, codec.as_received(encode(art, ptrace, ids), art.code_dtype))
            for l in restored:
                kv[l] = (oracle_kv[l][0] if "k" in streams else kv[l][0], oracle_kv[l][1] if "v" in streams else kv[l][1])
            logits, _ = cache.extend(self.consumer, cache.assemble(self.consumer, kv), mask, cont)
            out.append(metrics.kl_tv_top1(ref, logits)[0])
        return out


@torch.no_grad()
def wire_factor(producer, art: PairArtifacts, prefixes: Iterable[torch.Tensor]) -> float:
    """Bytes the wire sends per byte of code (the codec's lossless stage; 1 for codes it sends as they are),
    measured on `art`'s codes of `prefixes` (1-D token ids), all together. Codes only, as a payload ratio
    counts them: the token ids go zeroed, so they compress to nothing."""
    if codec.default_compress(art.code_dtype) == "none":
        return 1.0
    dims, sent, plain = codec.artifact_dims(art), 0, 0
    for prefix in prefixes:
        ids = prefix[None]
        codes = encode(art, capture(producer, ids, torch.ones_like(ids)), ids)
        codes.token_ids = torch.zeros_like(ids)
        sent += codec.body_bytes(codec.encode(codes, art.pair, "wire", dims, art.code_dtype))
        plain += codec.code_bytes(art, ids.shape[1]) - 5 * ids.shape[1]    # uncompressed, without ids and mask
    return min(1.0, sent / plain)


def level_kls(producer, consumer, art: PairArtifacts, samples, progress: bool = False) -> list[dict]:
    """`art` at each of its nested levels (PairArtifacts.at_level, what a link sent that level rebuilds), scored
    on `samples` with one oracle run each: [{**level, "kl": mean, "kls": per sample}], smallest level first."""
    scorer = PlanScorer(producer, consumer, samples, lambda plan: art, hidden=art.needs_hidden)
    out = []
    for level in tqdm(art.levels, desc="levels", disable=not progress):
        scorer.art_for = lambda plan, cut=art.at_level(level): cut
        kls = scorer.kls(art.plan)
        out.append({**level, "kl": sum(kls) / len(kls), "kls": kls})
    return out
