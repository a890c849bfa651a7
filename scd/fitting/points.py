"""A plan curve's points by name and cost: what the block stage, the held-out curve and the report share
(no torch here: the report reads these too).

A point is a plan the consumer pays for in compute: entering a recompute block at layer `entry` (num_layers:
no block, the codes alone) that runs its layers up to the top or, with `stop`, layers entry..stop-1 with the codes
above them again (a block where the error lives), and running `tail` of the prefix's tokens itself through every layer (0: none):
its last ones (rule "last"), or the ones its last attend to most (rule "attention": selective recompute), or
the ones its selector fitted at calibration scores highest (rule "learned"), or the ones the request's own
tokens read most (rule "suffix")."""
from __future__ import annotations

from scd.settings import SELECT_WINDOW, select_window_pass

MARKS = {"last": "+tail", "attention": "+sel", "learned": "+lsel", "suffix": "+rsel"}


def point_name(entry: int, tail: int, num_layers: int, rule: str = "last", stop: int | None = None) -> str:
    """A curve point's method name: codes, enter@<e> (layers e up to the top), enter@<e>:<s> (layers e..s-1,
    as a slice reads), each with +tail<k> when the consumer runs the prefix's last k tokens too, +sel<k> when it
    runs the k its last attend to most, +lsel<k> the k its selector picks, +rsel<k> the k the request's tokens
    read most."""
    head = "codes" if entry == num_layers else f"enter@{entry}" + (f":{stop}" if stop and stop < num_layers else "")
    return head + (f"{MARKS[rule]}{tail}" if tail else "")


def name_of(point: dict, num_layers: int) -> str:
    """point_name of a curve point (a dict with entry, and tail, rule and stop where it has them)."""
    return point_name(point["entry"], point.get("tail", 0), num_layers, point.get("rule", "last"), point.get("stop"))


def parse_point(name: str, num_layers: int) -> tuple[int, int, str, int] | None:
    """(entry, tail, rule, stop) of a curve point's method name (point_name's, or droidspeak@<e>; stop
    num_layers for a block up to the top); None for another."""
    rule, (head, _, tail) = "last", name.partition("+tail")
    for r in ("learned", "suffix", "attention"):        # "+lsel" before "+sel", which it contains
        if not tail and MARKS[r] in name:
            rule, (head, _, tail) = r, name.partition(MARKS[r])
    stop = num_layers
    if head == "codes":
        entry = num_layers
    elif head.startswith(("enter@", "droidspeak@")):
        at, _, until = head.partition("@")[2].partition(":")
        if not at.isdigit() or (until and not (until.isdigit() and int(at) < int(until) < num_layers)):
            return None
        entry, stop = int(at), int(until) if until else num_layers
    else:
        return None
    if not tail:
        return entry, 0, "last", stop
    return (entry, int(tail), rule, stop) if tail.isdigit() else None


def consumer_ratio(entry: int, tail: int, num_layers: int, tokens: int, rule: str = "last",
                   stop: int | None = None) -> float:
    """A plan's compute over the consumer's own prefill of `tokens`, by count: its block's layers (entry up to
    `stop`, the top by default), plus the tail's tokens through every layer (and the attention rule's window,
    which runs twice, or once as the whole selection when the tail is no larger; the suffix rule's first pass
    of the request's tokens, counted as that many: a question's length)."""
    run = tail
    if tail and rule == "suffix":
        run = tail + SELECT_WINDOW
    elif tail and rule == "attention":
        selected = max(tail, SELECT_WINDOW)
        run = selected + select_window_pass(selected)
    return ((stop or num_layers) - entry) / num_layers + min(run, tokens) / tokens


def chosen_name(chosen: dict | None, num_layers: int) -> str | None:
    """The method name a chosen curve point is evaluated under elsewhere (its `scd` row), or None when no plan
    was chosen or the choice is the codes alone (which spend no compute)."""
    if chosen is None or (chosen["entry"] == num_layers and not chosen.get("tail")):
        return None
    return name_of(chosen, num_layers)


KIND_RULES = {"last": "its last tokens", "attention": "selective, attention", "learned": "selective, learned",
              "suffix": "selective, the request's reads"}
BUDGETS = (0.1, 0.2, 0.35, 0.5)         # the consumer compute a curve is read at (share of its own prefill)


def tail_phrase(k: int, rule: str) -> str:
    """The k positions a tail by `rule` runs through every layer, in words (calibration logs and reports)."""
    return {"last": f"the prefix's last {k} tokens",
            "attention": f"the {k} positions its last tokens attend to most",
            "learned": f"the {k} positions its selector picks",
            "suffix": f"the {k} positions the request's own tokens read most"}[rule]


def kind(point: dict, num_layers: int) -> str:
    """A curve point's plan kind: the codes alone, a recompute block (an exact plan's entry) or a block that ends
    below the top, with the positions the consumer runs itself through every layer named by their rule."""
    base = "codes" if point["entry"] == num_layers else "block" if point.get("stop", num_layers) == num_layers \
        else "block below the top"
    return base + (f" + {KIND_RULES[point.get('rule', 'last')]}" if point.get("tail") else "")


def best_by_kind(points: list[dict], num_layers: int, budgets: tuple[float, ...] = BUDGETS,
                 loss=lambda p: p["kl"]) -> dict[str, list[dict | None]]:
    """Per plan kind (`kind`), for each budget, its point of least `loss` (KL by default) among those costing at
    most the budget (None where it has none), kinds in the order they first appear by compute."""
    by: dict[str, list[dict]] = {}
    for p in sorted(points, key=lambda p: p["consumer_ratio"]):
        by.setdefault(kind(p, num_layers), []).append(p)
    return {k: [min((p for p in pts if p["consumer_ratio"] <= b + 1e-9), key=loss, default=None)
                for b in budgets] for k, pts in by.items()}


def pareto(points: list, cost=lambda p: p["consumer_ratio"], kl=lambda p: p["kl"]) -> list:
    """The points no other beats: none at most as costly with a lower KL (curve points by default; pass
    `cost` and `kl` for other records)."""
    return [p for p in points if not any(cost(q) <= cost(p) and kl(q) < kl(p) for q in points)]


def droidspeak_at(cost: float, curve: list[tuple[float, float]]) -> float | None:
    """DroidSpeak's KL at a consumer cost, linear between the (cost, KL) points it was measured at (raw KV's
    at cost 0 among them); None beyond them."""
    curve = sorted(curve)
    for (c0, k0), (c1, k1) in zip(curve, curve[1:]):
        if c0 - 1e-9 <= cost <= c1 + 1e-9:
            return k0 if c1 == c0 else k0 + (k1 - k0) * (cost - c0) / (c1 - c0)
    return curve[0][1] if len(curve) == 1 and abs(cost - curve[0][0]) < 1e-9 else None
