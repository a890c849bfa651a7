"""The producers' hash ring: owners stay put as producers come and go, and bounded loads cap a hot prefix."""
import math
import random

from serve_app.ring import HashRing, prefix_hash

KEYS = [prefix_hash([i, i * 7 + 1, 42]) for i in range(20000)]


def owners(ring: HashRing) -> list[str]:
    return [ring.walk(k)[0] for k in KEYS]


def test_adding_or_removing_a_producer_moves_only_its_own_prefixes():
    ring = HashRing(["p0", "p1", "p2"])
    before = owners(ring)
    ring.set(["p0", "p1", "p2", "p3"])
    after = owners(ring)
    moved = [(a, b) for a, b in zip(before, after) if a != b]
    assert moved and all(b == "p3" for _, b in moved), "a prefix moved between producers that stayed"
    assert abs(len(moved) / len(KEYS) - 0.25) < 0.08, f"p3 took {len(moved) / len(KEYS):.3f} of the prefixes"
    ring.set(["p0", "p2", "p3"])
    again = owners(ring)
    assert all(a == b for a, b in zip(after, again) if a != "p1"), "removing p1 moved prefixes p1 did not own"


def test_each_producer_owns_about_its_share_and_walk_lists_every_producer_once():
    for n in (2, 3, 5, 8):
        ring = HashRing([f"p{i}" for i in range(n)])
        shares = ring.shares()
        assert abs(sum(shares.values()) - 1) < 1e-9
        assert all(abs(s * n - 1) < 0.45 for s in shares.values()), f"{n} producers: shares {shares}"
        counted = {m: 0 for m in ring.members}
        for m in owners(ring):
            counted[m] += 1
        for m in ring.members:                             # the shares describe where prefixes really go
            assert abs(counted[m] / len(KEYS) - shares[m]) < 0.02, (m, counted[m] / len(KEYS), shares[m])
        assert all(sorted(ring.walk(k)) == sorted(ring.members) for k in KEYS[:200])
    assert HashRing([]).walk(KEYS[0]) == [] and HashRing([]).choose(KEYS[0], {}, 1.25) == []


def test_choose_passes_over_a_down_producer_to_the_next_on_the_ring():
    ring = HashRing(["p0", "p1", "p2"])
    for k in KEYS[:500]:
        order = ring.walk(k)
        assert ring.choose(k, {}, 1.25) == order
        assert ring.choose(k, {}, 1.25, skip={order[0]}) == order[1:]
        assert ring.choose(k, {}, 1.25, skip=set(order)) == []


def simulate(factor: float, n: int = 3, steps: int = 6000, seed: int = 0, slack: int = 0) -> tuple[int, list]:
    """Requests with a skewed prefix mix (Zipf-like: the hottest prefix is half of the traffic) arriving while
    earlier ones are in flight; returns (the most any producer held, the bound at each of those moments)."""
    rng = random.Random(seed)
    ring = HashRing([f"p{i}" for i in range(n)])
    prefixes = [prefix_hash([i, 3, 9]) for i in range(200)]
    weights = [1.0 / (i + 1) ** 1.6 for i in range(len(prefixes))]
    load = dict.fromkeys(ring.members, 0)
    inflight: list[tuple[int, str]] = []
    worst, over = 0, []
    for t in range(steps):
        for done in [x for x in inflight if x[0] <= t]:
            inflight.remove(done)
            load[done[1]] -= 1
        key = rng.choices(prefixes, weights)[0]
        m = ring.choose(key, load, factor, slack=slack)[0]
        bound = math.ceil(factor * (sum(load.values()) + 1) / n) + slack
        load[m] += 1
        worst = max(worst, load[m])
        if load[m] > bound:
            over.append((t, m, load[m], bound))
        inflight.append((t + rng.randint(5, 40), m))
    return worst, over


def test_bounded_loads_keep_every_producer_under_the_bound_with_a_hot_prefix():
    unbounded, _ = simulate(1e9)                   # plain consistent hashing: the hot prefix's owner piles up
    for slack in (0, 2):
        worst, over = simulate(1.25, slack=slack)
        assert not over, f"a producer went over ceil(1.25 x average) + {slack}: {over[:5]}"
        assert unbounded > 1.5 * worst, f"without the bound the busiest held {unbounded}, with it {worst}"
