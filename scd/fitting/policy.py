"""Layer policy: which layers get a Patch aligner. Decided offline; the online path does no search.

1. restore-one sensitivity: gain_l = KL(reuse-only) - KL(reuse-only with layer l exact)
2. candidate pool: the `pool` layers of largest gain
3. greedy forward selection over the pool with the real (trained) patches: add the layer that lowers KL most
4. budget: k* = argmax_k gain(k) / (base_cost + cost * k), i.e. KL removed per unit of consumer work,
   where gain(k) = KL(reuse-only) - KL(best k patches); base_cost = 1 is the Reuse rebuild, `cost` one Patch;
   only among the k whose plan's payload fits (`fits`, e.g. the payload budget).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tqdm import tqdm


@dataclass
class PolicyResult:
    base_kl: float
    sensitivity: dict[int, float]           # restore-one gain per layer
    pool: list[int]
    order: list[int]                        # greedy selection order
    curve: list[float]                      # KL after k patches, k = 0..len(order)
    k_star: int
    efficiency: list[float] = field(default_factory=list)

    @property
    def chosen(self) -> list[int]:
        return sorted(self.order[:self.k_star])


def restore_one(layers: list[int], kl_restored: Callable[[int], float], base_kl: float,
                progress: bool = False) -> dict[int, float]:
    return {l: base_kl - kl_restored(l) for l in tqdm(layers, desc="policy: restore one", disable=not progress)}


def greedy(pool: list[int], kl_patched: Callable[[list[int]], float], base_kl: float,
           progress: bool = False) -> tuple[list[int], list[float]]:
    order, curve, left = [], [base_kl], list(pool)
    bar = tqdm(total=len(pool) * (len(pool) + 1) // 2, desc="policy: greedy", disable=not progress)
    while left:
        scores = {}
        for l in left:
            scores[l] = kl_patched(sorted(order + [l]))
            bar.update()
        best = min(scores, key=scores.get)
        order.append(best)
        curve.append(scores[best])
        left.remove(best)
    bar.close()
    return order, curve


def choose_k(curve: list[float], cost: float, base_cost: float = 1.0,
             allowed: list[int] | None = None) -> tuple[int, list[float]]:
    """k* maximising gain per cost among the `allowed` k (default all); k = 0 (no patch) when no patch helps."""
    eff = [(curve[0] - curve[k]) / (base_cost + cost * k) for k in range(len(curve))]
    k_star = max(allowed if allowed else range(len(curve)), key=lambda k: eff[k])
    return (k_star if eff[k_star] > 0 else 0), eff


def plan_layers(layers: list[int], kl_restored: Callable[[int], float], kl_patched: Callable[[list[int]], float],
                base_kl: float, pool_size: int, cost: float, train_pool: Callable[[list[int]], None] | None = None,
                fits: Callable[[list[int]], bool] | None = None, progress: bool = False) -> PolicyResult:
    """Run the whole policy. `train_pool` is called once with the pool before greedy (to train aligners);
    `fits(layers)`: whether Patching those layers keeps the payload within its budget; `progress`: a bar
    for each search."""
    sens = restore_one(layers, kl_restored, base_kl, progress)
    pool = sorted(sorted(sens, key=sens.get, reverse=True)[:pool_size])
    if train_pool is not None:
        train_pool(pool)
    order, curve = greedy(pool, kl_patched, base_kl, progress)
    allowed = [k for k in range(len(curve)) if fits is None or fits(sorted(order[:k]))]
    k_star, eff = choose_k(curve, cost, allowed=allowed)
    return PolicyResult(base_kl, sens, pool, order, curve, k_star, eff)
