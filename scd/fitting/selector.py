"""A learned selector of the positions selective recompute runs (scd.online.selective, rule "learned"), fitted
at calibration: a linear score of each position's features in the cache the consumer is given
(selective.selector_features), regressed on the log share of the attention the consumer's own continuation
pays that position over its own cache (selective.reads_of, selective.selector_target). It needs no consumer
compute to choose at serving time: a matrix-vector product over the rebuilt cache."""
from __future__ import annotations

from typing import Callable

import torch
from tqdm import tqdm

from scd.online import selective
from scd.online.trace import capture


def fit_over(consumer, samples: list, given: Callable, layers: list[int], desc: str = "selector",
             target_cache: str = "own", error_weighted: bool = False) -> tuple[torch.Tensor, dict]:
    """A selector fitted on `samples` (each with a prefix and a continuation): `given(ids, mask)` is the cache
    the consumer would be given for a prefix (rebuilt from codes, or raw KV), whose V at `layers` are the
    features; the reads of the continuation's first READ_TOKENS over the consumer's own cache (`target_cache`
    "own") or over the given one ("given") the target, weighted by the given cache's error against the
    consumer's own at each position with `error_weighted` (selective.selector_target). Returns fit_selector's
    (weights, report)."""
    if target_cache not in ("own", "given"):
        raise ValueError(f"target_cache {target_cache!r}: 'own' or 'given'")
    features, targets = [], []
    for s in tqdm(samples, desc=desc):
        ids = s.prefix[None]
        mask = torch.ones_like(ids)
        kv = given(ids, mask)
        own = None
        if target_cache == "own" or error_weighted:
            trace = capture(consumer, ids, mask, want_xnorm=False)
            own = list(zip(trace.keys, trace.values))
        read = selective.reads_of(consumer, own if target_cache == "own" else kv, mask,
                                  s.cont[None, :selective.READ_TOKENS])
        error = selective.rebuild_error(kv, own) if error_weighted else None
        features.append(selective.selector_features(kv, mask, layers)[0])
        targets.append(selective.selector_target(read, mask, error)[0])
    return fit_selector(features, targets)


def fit_selector(features: list[torch.Tensor], targets: list[torch.Tensor], share: float = 0.2,
                 penalties: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0)) -> tuple[torch.Tensor, dict]:
    """A selector's weights (F,) by ridge regression of `targets` (each (T,), selective.selector_target's) on
    `features` (each (T, F), one prefix's real positions): the penalty is chosen on the last fifth of the
    prefixes by how much of the targets' top `share` of positions the score's own top `share` holds, then the
    weights are fitted on all of them. Returns (weights, {"penalty", "overlap": per penalty tried})."""
    if len(features) < 2:
        raise ValueError(f"a learned selector needs at least 2 prefixes to choose its penalty, got {len(features)}")
    cut = max(1, len(features) * 4 // 5)

    def solve(xs, ys, lam):
        x, y = torch.cat(xs).double(), torch.cat(ys).double()
        return torch.linalg.solve(x.T @ x + lam * torch.eye(x.shape[1], dtype=x.dtype), x.T @ y).float()

    def overlap(w):
        got = []
        for x, y in zip(features[cut:], targets[cut:]):
            k = max(1, round(share * len(y)))
            got.append(len(set((x @ w).topk(k).indices.tolist()) & set(y.topk(k).indices.tolist())) / k)
        return sum(got) / len(got)
    tried = {lam: overlap(solve(features[:cut], targets[:cut], lam)) for lam in penalties}
    best = max(tried, key=tried.get)
    return solve(features, targets, best), {"penalty": best, "overlap": tried}


