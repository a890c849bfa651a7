"""Calibration report for one producer->consumer pair: a markdown summary plus PNG plots.

`build_report(...)` returns {file name: bytes}; the artifact registry stores each entry as `report/<name>`.
The figures mirror the SCD paper's Figures 4-7:

- `sensitivity.png` (Fig. 4): restore-one sensitivity. One bar per layer: the KL gain obtained by making that
  single layer exact on top of the Reuse-only plan. Layers in the candidate pool are drawn in a second colour.
- `greedy.png` (Fig. 5): greedy forward selection. KL after k patch layers (k = 0..len(order)); each point is
  labelled with the layer added at that step, a dashed line marks the chosen budget k*, and the efficiency
  (gain / cost per k, whose argmax gives k*) is drawn on a twin axis.
- `pareto.png` (Fig. 6, optional): Reuse-only KL vs payload ratio over a grid of ranks (r_K, r_V). Every point is
  annotated with its ranks, the Pareto frontier (points no other point beats on both payload and KL) is joined by
  a line, and the ranks actually chosen (`extra["r_k"]`, `extra["r_v"]`, or `extra["r_x"]`) are circled.
- `tradeoff.png` (optional, from the held-out rows): KL vs payload ratio of every evaluated method; SCD's code
  levels (`scd@...`, the nested codes one artifact serves, and `scd`, its full code) joined by a line, the
  full code circled, the baselines (raw KV, INT4 KV, DroidSpeak, Reuse-only) as labelled points.
- `compute.png` (exact plans, and codes with recompute blocks tried): validation KL against the consumer's
  compute over the prefix (the share of its layers it runs and of the positions it runs through every
  layer), one marker per plan kind (points.kind), the chosen plan circled, raw KV reuse and DroidSpeak at
  its best block as labelled points, the quality bound as a dashed line; summary.md reads the curve at
  points.BUDGETS of compute, each kind's least KL within each; with a block plan's
  held-out curve (rows `enter@<e>`, `codes+tail<k>`, `enter@<e>+tail<k>`, `droidspeak@<e>`): SCD's plans and
  DroidSpeak entering at each layer, held out, by the consumer's compute.
- `xnorm_error.png` (Fig. 7, optional): relative error of the consumer's pre-attention input x_norm per layer
  (list index = layer number), Reuse-only vs SCD; the patch layers are shaded, showing where SCD resets the error.

`summary.md` has the evaluation table, the layer plan, the `extra` items and links to the figures produced.
Only stdlib, numpy, matplotlib (Agg backend) and scd.fitting.points (torch-free) are used.
"""
from __future__ import annotations

import io
import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from scd.fitting import points  # noqa: E402  (torch-free)

DPI = 110
METHOD_ORDER = ["oracle", "base", "raw_kv", "int4_kv", "droidspeak", "reuse_only", "scd", "exact", "exact_int8",
                "exact_kivi4"]
EVAL_KEYS = ["method", "payload_bytes", "payload_ratio", "kl", "tv", "top1", "greedy", "ppl", "f1", "em",
             "consumer_ms", "prefill_ratio", "samples"]
POLICY_KEYS = ["base_kl", "sensitivity", "pool", "order", "curve", "k_star", "efficiency", "chosen"]


def build_report(pair: str, policy: dict | None, eval_rows: list[dict], pareto: list[dict] | None = None,
                 xnorm: dict[str, list[float]] | None = None, extra: dict | None = None,
                 compute: dict | None = None) -> dict[str, bytes]:
    """Render the report. Raises ValueError on malformed inputs; optional figures are skipped when absent.
    policy: the layer policy's record (None for an exact plan, which has none); compute: an exact plan's
    curve and choice (jobs.plans.exact_plan)."""
    _check_rows(eval_rows)
    extra = dict(extra or {})
    files: dict[str, bytes] = {}
    if policy is not None:
        _check_policy(policy)
        files["sensitivity.png"] = _png(_fig_sensitivity(pair, policy))
        files["greedy.png"] = _png(_fig_greedy(pair, policy))
    if compute is not None:
        files["compute.png"] = _png(_fig_compute(pair, compute, eval_rows))
    if pareto:
        _check_pareto(pareto)
        files["pareto.png"] = _png(_fig_pareto(pair, pareto, extra))
    if any(r["method"].startswith("scd@") for r in eval_rows):
        files["tradeoff.png"] = _png(_fig_tradeoff(pair, eval_rows))
    if xnorm and policy is not None:
        _check_xnorm(xnorm)
        files["xnorm_error.png"] = _png(_fig_xnorm(pair, xnorm, policy["chosen"]))
    figures = [n for n in ("compute.png", "sensitivity.png", "greedy.png", "pareto.png", "tradeoff.png",
                           "xnorm_error.png") if n in files]
    return {"summary.md": _summary(pair, policy, eval_rows, extra, figures, compute).encode()} | files


# ----------------------------------------------------------------------------------------------- validation
def _check_policy(policy: dict) -> None:
    if not isinstance(policy, dict):
        raise ValueError(f"policy must be a dict, got {type(policy).__name__}")
    missing = [k for k in POLICY_KEYS if k not in policy]
    if missing:
        raise ValueError(f"policy is missing keys: {missing}")
    sens = policy["sensitivity"]
    if not isinstance(sens, dict) or not sens:
        raise ValueError("policy['sensitivity'] must be a non-empty dict {layer (str): gain}")
    try:
        [int(k) for k in sens]
    except (TypeError, ValueError):
        raise ValueError(f"policy['sensitivity'] keys must be layer numbers, got {list(sens)}") from None
    order, curve, eff, k_star = policy["order"], policy["curve"], policy["efficiency"], policy["k_star"]
    if len(curve) != len(order) + 1:
        raise ValueError(f"policy['curve'] length {len(curve)} must equal len(order)+1 = {len(order) + 1}")
    if len(eff) != len(curve):
        raise ValueError(f"policy['efficiency'] length {len(eff)} must equal len(curve) = {len(curve)}")
    if not isinstance(k_star, int) or not 0 <= k_star <= len(order):
        raise ValueError(f"policy['k_star'] = {k_star!r} must be an int in [0, {len(order)}]")
    if not math.isclose(curve[0], policy["base_kl"], rel_tol=1e-6, abs_tol=1e-12):
        raise ValueError(f"policy['curve'][0] = {curve[0]} must equal policy['base_kl'] = {policy['base_kl']}")


def _check_rows(rows: list[dict]) -> None:
    if not isinstance(rows, list):
        raise ValueError(f"eval_rows must be a list of dicts, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        missing = [k for k in EVAL_KEYS if k not in r] if isinstance(r, dict) else EVAL_KEYS
        if missing:
            raise ValueError(f"eval_rows[{i}] is missing keys: {missing}")


def _check_pareto(points: list[dict]) -> None:
    for i, p in enumerate(points):
        missing = [k for k in ("payload_ratio", "kl") if k not in p] + ([] if _ranks(p) else ["r_k/r_v or r_x"])
        if missing:
            raise ValueError(f"pareto[{i}] is missing keys: {missing}")


def _check_xnorm(xnorm: dict) -> None:
    for k in ("reuse_only", "scd"):
        if not xnorm.get(k):
            raise ValueError(f"xnorm[{k!r}] must be a non-empty list of per-layer errors")
    if len(xnorm["reuse_only"]) != len(xnorm["scd"]):
        raise ValueError("xnorm['reuse_only'] and xnorm['scd'] must have one value per layer (same length)")


# ------------------------------------------------------------------------------------------------- figures
def _png(fig) -> bytes:
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buf.getvalue()


def _fig_sensitivity(pair: str, policy: dict):
    layers = sorted(int(k) for k in policy["sensitivity"])
    gains = [float(policy["sensitivity"][str(l)]) for l in layers]
    pool = set(policy["pool"])
    colours = ["tab:orange" if l in pool else "tab:blue" for l in layers]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(layers) + 2), 3.6))
    ax.bar(layers, gains, color=colours)
    ax.axhline(0, color="black", lw=0.6)
    ax.set(xlabel="layer", ylabel="KL gain (restore one layer)", title=f"Restore-one sensitivity — {pair}")
    ax.set_xticks(layers if len(layers) <= 40 else layers[::2])
    ax.legend(handles=[Patch(color="tab:orange", label="candidate pool"), Patch(color="tab:blue", label="other")],
              frameon=False, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _fig_greedy(pair: str, policy: dict):
    curve, order, k_star = policy["curve"], policy["order"], policy["k_star"]
    ks = list(range(len(curve)))
    fig, ax = plt.subplots(figsize=(6.8, 3.8))
    ax.plot(ks, curve, "o-", color="tab:blue", label="KL after k patches")
    for k in ks[1:]:
        ax.annotate(f"+L{order[k - 1]}", (k, curve[k]), textcoords="offset points", xytext=(0, 7),
                    ha="center", fontsize=8, color="tab:blue")
    ax.axvline(k_star, color="tab:red", ls="--", lw=1, label=f"k* = {k_star}")
    ax.set(xlabel="number of patch layers k", ylabel="KL(oracle ‖ SCD)", title=f"Greedy layer selection — {pair}")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(ks, policy["efficiency"], "s:", color="tab:green", ms=4, label="efficiency (gain / cost)")
    ax2.set_ylabel("efficiency", color="tab:green")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, frameon=False, fontsize=8, loc="upper right")
    return fig


def _frontier(points: list[dict]) -> list[dict]:
    """Points not dominated in (payload_ratio, kl): sweep by payload, keep each strict KL improvement."""
    front, best = [], math.inf
    for p in sorted(points, key=lambda p: (p["payload_ratio"], p["kl"])):
        if p["kl"] < best:
            front.append(p)
            best = p["kl"]
    return front


def _ranks(p: dict) -> dict:
    """A point's ranks: r_k and r_v (per-head Reuse) or r_x (hidden-state Reuse)."""
    return {k: v for k, v in sorted(p.items()) if k in ("r_k", "r_v", "r_x")}


def _fig_pareto(pair: str, points: list[dict], extra: dict):
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    xs, ys = [p["payload_ratio"] for p in points], [p["kl"] for p in points]
    names = list(_ranks(points[0]))
    ax.scatter(xs, ys, color="tab:gray", s=18, label=f"({', '.join(n.upper() for n in names)}) grid")
    for p in points:
        ax.annotate("(" + ",".join(str(v) for v in _ranks(p).values()) + ")", (p["payload_ratio"], p["kl"]),
                    textcoords="offset points", xytext=(4, 3), fontsize=7, color="dimgray")
    front = _frontier(points)
    ax.plot([p["payload_ratio"] for p in front], [p["kl"] for p in front], "o-", color="tab:blue", ms=5,
            label="Pareto frontier")
    chosen = [p for p in points if all(extra.get(k) == v for k, v in _ranks(p).items())]
    if chosen:
        ax.scatter([chosen[0]["payload_ratio"]], [chosen[0]["kl"]], s=160, facecolors="none",
                   edgecolors="tab:red", linewidths=2, label="chosen ranks", zorder=5)
    _kl_vs_payload(ax, ys, "KL(oracle ‖ Reuse-only)", f"Rank sweep: KL vs payload — {pair}")
    return fig


def _kl_vs_payload(ax, kls: list[float], ylabel: str, title: str) -> None:
    """Axes of a KL-against-payload figure: a log KL scale when it spans more than 10x."""
    if kls and min(kls) > 0 and max(kls) / min(kls) > 10:
        ax.set_yscale("log")
    ax.set(xlabel="payload ratio (vs raw KV)", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(frameon=False, fontsize=8)


def _fig_tradeoff(pair: str, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    levels = sorted((r for r in rows if r["method"] == "scd" or r["method"].startswith("scd@")),
                    key=lambda r: r["payload_ratio"])
    ax.plot([r["payload_ratio"] for r in levels], [r["kl"] for r in levels], "o-", color="tab:blue", ms=5,
            label="SCD code levels (one artifact)")
    for r in levels:
        ax.annotate(r["method"].removeprefix("scd@") if r["method"] != "scd" else "full", (r["payload_ratio"], r["kl"]),
                    textcoords="offset points", xytext=(4, 3), fontsize=7, color="tab:blue")
    full = [r for r in levels if r["method"] == "scd"]
    if full:
        ax.scatter([full[0]["payload_ratio"]], [full[0]["kl"]], s=160, facecolors="none", edgecolors="tab:red",
                   linewidths=2, label="published code", zorder=5)
    marks = {"raw_kv": ("s", "tab:gray"), "int4_kv": ("D", "tab:green"), "droidspeak": ("^", "tab:purple"),
             "reuse_only": ("v", "tab:orange")}
    for r in rows:
        if r["method"] in marks and r["payload_ratio"] is not None:
            m, c = marks[r["method"]]
            ax.scatter([r["payload_ratio"]], [r["kl"]], marker=m, color=c, s=40, label=r["method"], zorder=4)
    _kl_vs_payload(ax, [r["kl"] for r in rows if r["method"] != "oracle" and r["kl"]],
                   "held-out KL(oracle ‖ method)", f"KL vs payload, held-out — {pair}")
    return fig


def _fig_compute(pair: str, compute: dict, rows: list[dict]):
    """KL against the consumer's compute: every plan of the curve by its kind (validation; e=<entry>, +k: k
    positions run through every layer), the chosen plan, raw KV and DroidSpeak (held-out rows, at their measured
    share of a prefill). With answers (a QA pair: F1 on the validation points or on held-out rows), a second panel:
    each plan's F1 by its compute (_f1_panel)."""
    n = compute.get("num_layers")
    chosen = points.chosen_name(compute["chosen"], n) if n else None
    held = held_out_curve(rows, chosen, n, compute.get("prefix_tokens", 1)) if n else {}
    f1 = {r["method"]: r["f1"] for r in rows if r.get("f1") is not None}
    if chosen and "scd" in f1:                  # the chosen plan's row is named scd
        f1[chosen] = f1["scd"]
    pts = sorted(compute["points"], key=lambda p: p["consumer_ratio"])
    by_kind: dict[str, list[dict]] = {}                  # the plans of each kind, kinds in order of compute
    for p in pts:
        by_kind.setdefault(points.kind(p, n), []).append(p)
    answers = any(name in f1 for curve in held.values() for _, _, name in curve) or \
        any(p.get("f1") is not None for p in pts)
    if answers:
        fig, (ax, fx) = plt.subplots(2, 1, figsize=(6.8, 7.4), sharex=True)
    else:
        fig, ax = plt.subplots(figsize=(6.8, 4.2))
    floor = 1e-7                                # a lossless plan's KL is 0 up to rounding: drawn at the floor
    front = points.pareto(pts)                  # the curve: no plan costs less at a lower KL
    ax.plot([p["consumer_ratio"] for p in front], [max(p["kl"], floor) for p in front], "-", color="tab:blue", lw=1,
            label="the plans no other beats at no more compute (validation)")
    for i, (k, mine) in enumerate(by_kind.items()):
        ax.scatter([p["consumer_ratio"] for p in mine], [max(p["kl"], floor) for p in mine], s=28, zorder=3,
                   **_kind_style(i, k), label=k)
    for p in pts:
        ax.annotate(("codes" if p["entry"] == n else f"e={p['entry']}") + (f":{p['stop']}" if p.get("stop") else "")
                    + (f"+{p['tail']}" if p.get("tail") else ""),
                    (p["consumer_ratio"], max(p["kl"], floor)), textcoords="offset points", xytext=(4, 3),
                    fontsize=6, color="dimgray")
    c = compute["chosen"]
    if c is not None:
        ax.scatter([c["consumer_ratio"]], [max(c["kl"], floor)], s=160, facecolors="none", edgecolors="tab:red",
                   linewidths=2, label="chosen plan", zorder=5)
    raw = compute["raw_kv"]["kl"]
    ax.axhline(compute["bound"]["max_kl_ratio"] * raw, ls="--", color="tab:gray", lw=1,
               label=f"bound: {compute['bound']['max_kl_ratio']:g} x raw KV")
    ax.axvline(compute["bound"]["max_consumer_ratio"], ls=":", color="tab:gray", lw=1, label="compute ceiling")
    ax.scatter([0.0], [raw], marker="s", color="tab:gray", s=40, label="raw KV (validation)", zorder=4)
    for r in rows:
        if r["method"] == "droidspeak":
            ax.scatter([r["prefill_ratio"]], [max(r["kl"], floor)], marker="^", color="tab:purple", s=40,
                       label="DroidSpeak, best block (held-out)", zorder=4)
    labels = {"SCD": "SCD's plans (held-out, Pareto front)", "DroidSpeak": "DroidSpeak entering at each e (held-out)"}
    for name, (color, marker) in {"SCD": ("tab:blue", "s"), "DroidSpeak": ("tab:purple", "^")}.items():
        if held.get(name):
            drawn = held[name] if name == "DroidSpeak" else points.pareto(held[name], lambda h: h[0], lambda h: h[1])
            xs, ys, _ = zip(*drawn)
            ax.plot(xs, [max(y, floor) for y in ys], marker=marker, ls="--", color=color, ms=5, label=labels[name])
    ax.set_yscale("log")
    xlabel = "consumer compute over the prefix (share of its own prefill)"
    ax.set(xlabel="" if answers else xlabel, ylabel="KL(oracle ‖ plan)",
           title=f"Quality against consumer compute — {pair}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if answers:
        _f1_panel(fx, held, f1, chosen, by_kind, compute["chosen"])
        fx.set_xlabel(xlabel)
    return fig


def _kind_style(i: int, kind: str) -> dict:
    """The marker and color of the i-th plan kind in both panels: circles the codes, squares a block."""
    return {"marker": "o" if kind.startswith("codes") else "s", "color": plt.get_cmap("tab10")(i % 10)}


def _f1_panel(ax, held: dict[str, list[tuple]], f1: dict[str, float], chosen: str | None,
              by_kind: dict[str, list[dict]] | None = None, chosen_point: dict | None = None) -> None:
    """F1 by consumer compute: the validation curve's plans by kind (`by_kind`, as the KL panel marks them, the
    chosen one circled), and each plan on a held-out curve (held_out_curve's): SCD's plans, the chosen one
    circled, DroidSpeak entering at each layer (raw KV at 0); the held-out oracle's F1 and 0.95 of it as lines."""
    for i, (k, plans) in enumerate((by_kind or {}).items()):
        mine = [p for p in plans if p.get("f1") is not None]
        if mine:
            ax.scatter([p["consumer_ratio"] for p in mine], [p["f1"] for p in mine], s=16, alpha=0.6, zorder=2,
                       **_kind_style(i, k), label=f"{k} (validation)")
    if chosen_point is not None and chosen_point.get("f1") is not None:
        ax.scatter([chosen_point["consumer_ratio"]], [chosen_point["f1"]], s=120, facecolors="none",
                   edgecolors="tab:red", linewidths=1.5, label="chosen plan (validation)", zorder=5)
    for name, (color, marker) in {"SCD": ("tab:blue", "s"), "DroidSpeak": ("tab:purple", "^")}.items():
        mine = [(x, f1[m]) for x, _, m in held.get(name, []) if m in f1]
        if mine:
            ax.scatter(*zip(*mine), marker=marker, color=color, s=28, zorder=3,
                       label=f"{name}'s plans (held-out)" if name == "SCD" else "DroidSpeak entering at each e")
    if chosen in f1:
        at = next((x for x, _, m in held.get("SCD", []) if m == chosen), None)
        if at is not None:
            ax.scatter([at], [f1[chosen]], s=160, facecolors="none", edgecolors="tab:red", linewidths=2,
                       label="chosen plan", zorder=5)
    if "oracle" in f1:
        ax.axhline(f1["oracle"], color="tab:green", lw=1, label="oracle (own prefill)")
        ax.axhline(0.95 * f1["oracle"], ls="--", color="tab:green", lw=1, label="0.95 x the oracle's F1")
    ax.set(ylabel="F1", ylim=(0, 1.05))
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def held_out_curve(rows: list[dict], chosen: str | None, n: int, tokens: int) -> dict[str, list[tuple]]:
    """A block plan's held-out curve (jobs.measures.entry_curve's rows: SCD's `enter@<e>`, `enter@<e>:<s>`, `codes+tail<k>`,
    `enter@<e>+tail<k>`, the same with `+sel<k>` and `+lsel<k>`, the chosen plan being the `scd` row, named
    `chosen`; DroidSpeak's `droidspeak@<e>`, with raw KV's at cost 0) as {"SCD": [...], "DroidSpeak": [...]},
    each (consumer compute over its own prefill of `tokens`, KL, name), by compute."""
    by = {r["method"]: r["kl"] for r in rows}
    if chosen and "scd" in by:
        by[chosen] = by["scd"]
    out = {"SCD": [], "DroidSpeak": []}
    for name, kl in by.items():
        if (point := points.parse_point(name, n)) is not None and point[:2] != (n, 0):
            entry, tail, rule, stop = point
            out["DroidSpeak" if name.startswith("droidspeak@") else "SCD"].append(
                (points.consumer_ratio(entry, tail, n, tokens, rule, stop), kl, name))
    if out["DroidSpeak"] and "raw_kv" in by:
        out["DroidSpeak"].append((0.0, by["raw_kv"], "raw_kv"))
    return {k: sorted(v) for k, v in out.items()}


def against_droidspeak(rows: list[dict], chosen: str | None, n: int, tokens: int) -> dict[str, float]:
    """Per SCD point of a held-out curve: its KL over DroidSpeak's at the same consumer compute (linear between
    the entries DroidSpeak was measured at; entering at the same layer, that entry's), by compute; points
    beyond DroidSpeak's measured range are left out."""
    curve = held_out_curve(rows, chosen, n, tokens)
    ds = [(c, kl) for c, kl, _ in curve["DroidSpeak"]]
    out = {}
    for c, kl, name in curve["SCD"]:
        if (ref := points.droidspeak_at(c, ds)) is not None:
            out[name] = kl / max(ref, 1e-12)
    return out


def _fig_xnorm(pair: str, xnorm: dict, chosen: list[int]):
    fig, ax = plt.subplots(figsize=(6.8, 3.8))
    layers = list(range(len(xnorm["reuse_only"])))
    for i, l in enumerate(sorted(chosen)):
        ax.axvspan(l - 0.5, l + 0.5, color="tab:orange", alpha=0.2, lw=0, label="patch layer" if i == 0 else None)
    ax.plot(layers, xnorm["reuse_only"], "o-", ms=3, color="tab:gray", label="Reuse-only")
    ax.plot(layers, xnorm["scd"], "o-", ms=3, color="tab:blue", label="SCD (Reuse + Patch)")
    ax.set(xlabel="layer", ylabel="relative x_norm error", title=f"Per-layer x_norm error — {pair}")
    ax.set_xlim(-0.5, len(layers) - 0.5)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    return fig


# ------------------------------------------------------------------------------------------------- summary
def _fmt(v, spec: str = ".4g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def _by_kind(compute: dict) -> list[str]:
    """The curve read at the budgets of points.BUDGETS: per plan kind, its least KL (over raw KV's) within each
    budget of consumer compute, and the chosen plan."""
    n, raw = compute["num_layers"], compute["raw_kv"]["kl"]
    head = " | ".join(f"<= {b:g}" for b in points.BUDGETS)
    out = ["", "## Plans by consumer compute (validation)", "",
           "KL over raw KV's, the least of each plan kind within each budget of consumer compute (share of its "
           "own prefill), at its compute; -: none that cheap.", "",
           f"| plan kind | {head} |", "|---|" + "---:|" * len(points.BUDGETS)]
    for k, best in points.best_by_kind(compute["points"], n).items():
        cells = ["-" if p is None else f"{p['kl'] / raw:.3f} ({p['consumer_ratio']:.2f})" for p in best]
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    if all(p.get("f1") is not None for p in compute["points"]):          # a QA pair's: its answers too
        out += ["", "F1 and the retained share of the specialist's gain over the base, the highest of each plan "
                "kind within each budget, at its compute:", "",
                f"| plan kind | {head} |", "|---|" + "---:|" * len(points.BUDGETS)]
        for k, best in points.best_by_kind(compute["points"], n, loss=lambda p: (-p["f1"], p["kl"])).items():
            cells = ["-" if p is None else f"{p['f1']:.3f}, {_fmt(p.get('retained_gain'), '.2f')} ({p['consumer_ratio']:.2f})"
                     for p in best]
            out.append(f"| {k} | " + " | ".join(cells) + " |")
    c = compute.get("chosen")
    name = None if c is None else points.name_of(c, n)
    out += ["", "Chosen: " + ("none within the bound" if c is None else f"{points.kind(c, n)}, {name}: "
                              f"{c['kl'] / raw:.3f} x raw KV at {c['consumer_ratio']:.2f} of a prefill")]
    return out


def _summary(pair: str, policy: dict, rows: list[dict], extra: dict, figures: list[str],
             compute: dict | None = None) -> str:
    rank = {m: i for i, m in enumerate(METHOD_ORDER)}
    rows = sorted(rows, key=lambda r: rank.get(r["method"], len(rank)))
    out = [f"# SCD calibration report — `{pair}`", "", "## Evaluation", ""]
    if rows:
        n = sorted({r["samples"] for r in rows})
        out += [f"Held-out samples: {', '.join(map(str, n))}. KL/TV against the oracle (consumer prefill).", ""]
        out += ["| method | payload KB | ratio | KL | TV | top-1 | greedy | PPL | F1 | EM | retained gain | "
                "consumer ms | /prefill |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            kb = None if r["payload_bytes"] is None else r["payload_bytes"] / 1024
            cells = [r["method"], _fmt(kb, ".1f"), _fmt(r["payload_ratio"], ".3f"), _fmt(r["kl"]), _fmt(r["tv"]),
                     _fmt(r["top1"], ".3f"), _fmt(r["greedy"], ".3f"), _fmt(r["ppl"], ".3f"), _fmt(r["f1"], ".3f"),
                     _fmt(r["em"], ".3f"), _fmt(r.get("retained_gain"), ".3f"), _fmt(r["consumer_ms"], ".1f"),
                     _fmt(r["prefill_ratio"], ".2f")]
            out.append("| " + " | ".join(cells) + " |")
    else:
        out.append("_No evaluation rows._")
    if policy is not None:
        chosen = sorted(policy["chosen"])
        k_star = policy["k_star"]
        out += ["", "## Layer plan", "",
                f"- Patch layers: {', '.join(map(str, chosen)) if chosen else 'none'} (k* = {k_star})",
                f"- Candidate pool: {', '.join(map(str, policy['pool'])) or 'none'}; "
                f"greedy order: {', '.join(map(str, policy['order'])) or 'none'}",
                f"- KL reuse-only {_fmt(policy['base_kl'])} -> with patches {_fmt(policy['curve'][k_star])}"]
    if compute is not None and compute.get("num_layers") and compute.get("points"):
        out += _by_kind(compute)
    if extra:
        out += ["", "## Calibration", ""]
        for key, val in extra.items():
            if not isinstance(val, str):        # a structure is cut short; a sentence is read whole
                val = json.dumps(val, default=str)
                val = val if len(val) <= 120 else val[:117] + "..."
            out.append(f"- {key}: {val}")
    out += ["", "## Figures"]
    for name in figures:
        out += ["", f"![]({name})"]
    return "\n".join(out) + "\n"
