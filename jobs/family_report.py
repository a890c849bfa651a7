"""What `jobs.family` prints and draws: each member's held-out KL under every way of serving it, and the
fan-out's wire bytes and encode time (`report`), and the same KLs as grouped bars (`plot`, family.png)."""
from __future__ import annotations

from pathlib import Path


BARS = (("raw_kv", "raw KV reuse"), ("pair", "pair code, Reuse-only"), ("family_reuse", "family code, Reuse-only"),
        ("family", "family as served"), ("served_pair", "published pair artifact"))


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.2, 3.8))
    bars = [(k, label) for k, label in BARS if any(r.get(k) is not None for r in rows)]
    w = 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):
        ax.bar([v + (i - (len(bars) - 1) / 2) * w for v in range(len(rows))],
               [r.get(key) or 0.0 for r in rows], w, label=label)
    ax.set_xticks(list(range(len(rows))), [r["member"] for r in rows])
    ax.set_ylabel("held-out KL(oracle ‖ method)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def report(rows: list[dict], cost: dict, codes: str) -> None:
    print(f"\nheld-out KL, {codes} (family payload {rows[0]['payload_ratio']:.3f} of raw KV):")
    print(f"  {'member':<10}{'raw_kv':>9}{'pair':>9}{'fam-reuse':>10}{'family':>9}{'published':>11}"
          f"{'greedy pair/family':>21}")
    for r in rows:
        pub = f"{r['served_pair']:.4f}" + ("*" if r["served_pair_source"] == "recorded" else " ") \
            if r["served_pair"] is not None else "-"
        kl = lambda key, w: f"{r[key]:{w}.4f}" if r[key] is not None else f"{'-':>{w}}"   # noqa: E731
        print(f"  {r['member']:<10}{r['raw_kv']:9.4f}{kl('pair', 9)}{kl('family_reuse', 10)}{r['family']:9.4f}"
              f"{pub:>11}{r['greedy_pair']:11.3f} / {r['greedy_family']:.3f}")
    print("  (pair, fam-reuse: Reuse-only codes of one pair / of the family; family: as served; published: the "
          "member's published pair artifact, * its recorded KL)")
    print(f"fan-out to {len(rows)} at {cost['tokens']} tokens: wire {cost['family_bytes'] / 1024:.1f} KB (family) vs "
          f"{cost['pairs_bytes'] / 1024:.1f} KB ({cost['pairs_are']}), {cost['family_bytes'] / cost['pairs_bytes']:.2f}x; "
          f"producer encode {cost['family_encode_ms']:.2f} vs {cost['pairs_encode_ms']:.2f} ms, "
          f"{cost['family_encode_ms'] / cost['pairs_encode_ms']:.2f}x")
