"""The calibration job's measurements beside its held-out evaluation: what the published code is weighed
against (the baselines and its own lower levels, `tradeoff`; a block plan's curve beside DroidSpeak at the
same consumer compute, `entry_curve`), and the diagnostics of calibration.diagnostics (the rank trade-off,
`pareto`; where the error lives, `error_split`; the x_norm error per layer, `xnorm_profile`). Each returns
rows or figures; jobs.calibrate checkpoints them."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from jobs.plans import entry_map
from scd.evaluation import methods
from scd.evaluation.diagnostics import xnorm_errors
from scd.evaluation.evaluate import Evaluator, profile_droidspeak
from scd.fitting import blocks, points
from scd.fitting.calibrate import Calibration
from scd.fitting.checkpoints import load_record, plan_digest, samples_digest, save_record
from scd.fitting.scoring import PlanScorer
from scd.online.rebuild import encode, rebuild
from scd.online.trace import capture

PARETO_GRID = [(4, 8), (8, 8), (8, 16), (16, 16), (8, 24), (16, 24), (24, 32)]


def pareto(cal: Calibration, val) -> list[dict]:
    """Reuse-only KL and payload ratio over a grid of ranks ((r_K, r_V), or r_X for hidden-state Reuse): the
    rank trade-off behind the chosen point."""
    if cal.cfg.reuse_source == "hidden":
        top = 2 * cal.spec.num_kv_heads * cal.spec.head_dim
        grid = [{"r_x": r} for r in (16, 32, 64, 96, 128, 192, 256) if r < top] + [{"r_x": top}]   # full rank: the floor
    else:
        grid = [{"r_k": k, "r_v": v} for k, v in PARETO_GRID if max(k, v) <= 2 * cal.spec.head_dim]
    scorer = PlanScorer(cal.producer, cal.consumer, val, cal.artifacts_for)
    out = []
    for ranks in grid:
        scorer.art_for = lambda plan, r=ranks: cal.artifacts_for(plan, **r)
        out.append({**ranks, "kl": scorer.kl(cal.base_plan), "payload_ratio": cal.payload_ratio(ranks)})
    return out


def tradeoff(cal: Calibration, art, tok, val, held) -> list[dict]:
    """Held-out rows of what the published code is weighed against: the INT4 and DroidSpeak baselines
    (DroidSpeak's recompute block chosen on the validation samples) and SCD at each lower level of its
    nested codes."""
    ds = methods.DroidSpeak()
    ds.start = profile_droidspeak(ds, cal.producer, cal.consumer, val)
    return Evaluator(cal.producer, cal.consumer, tok).run(held, [methods.Int4KV(), ds, *methods.at_levels(art)],
                                                          desc=f"held-out baselines and levels {cal.pair}")


def entry_curve(cal: Calibration, codes, entries: dict, tried: list[dict], tok, held, chosen: str | None,
                path: Path, log: Callable[[str], None]) -> list[dict]:
    """Held-out rows of the block stage's curve: SCD at each plan of `tried` (the validation points the stage
    measured beyond the codes alone, named by scd.fitting.points.point_name: the published codes below an entry,
    the consumer's layers from there through its trained entry, from `entries` (the tensors of
    entry-aligners.safetensors), and the prefix's tokens where the point has a tail, by its rule), beside DroidSpeak
    entered at each entry tried (`droidspeak@<e>`: the producer's residual and K, V below), to compare at the
    same consumer compute. The chosen plan (named `chosen`) is the `scd` row already and is not run again.
    Checkpointed plan by plan in `path`: a plan whose artifact is unchanged (plan_digest) resumes, the others are
    measured again (a refitted selector measures only the learned rule's plans)."""
    n = cal.spec.num_layers
    of = codes.info.get("blocks", {}).get("prefix_tokens") or held[0].prefix.shape[-1]   # where tails were counted
    plans = {}
    for p in tried:
        e, s, k, rule = p["entry"], p.get("stop", n), p.get("tail", 0), p.get("rule", "last")
        art = codes if e == n else blocks.block_artifact(codes, e, entry_map(entries, e, s, n), s)
        name = points.name_of(p, n)
        if name != chosen:
            art = art.with_tail(k, of, rule)
            plans[name] = (methods.SCDMethod(art, name), plan_digest(art))
    for e in sorted({p["entry"] for p in tried if p["entry"] < n}):     # DroidSpeak's blocks go to the top
        ds = methods.DroidSpeak.entering(e, n)
        plans[ds.name] = (ds, "droidspeak")
    inputs = {"samples": samples_digest(held)}
    kept = (load_record(path, inputs, log) or {}).get("plans", {})
    kept = {name: r for name, r in kept.items() if name in plans and r["digest"] == plans[name][1]}
    todo = [m for name, (m, _) in plans.items() if name not in kept]
    log(f"held-out plans of the curve: {len(kept)} resumed, {len(todo)} to measure")
    if todo:
        rows = Evaluator(cal.producer, cal.consumer, tok).run(held, todo, desc=f"held-out curve {cal.pair}")
        kept |= {r["method"]: {"digest": plans[r["method"]][1], "row": r} for r in rows}
        save_record(path, {"plans": kept}, inputs)
    return [kept[name]["row"] for name in plans]


def curve_tried(blocks_info: dict, n: int) -> list[dict]:
    """The validation points a held-out curve measures again: every entry without a tail, and the tails on the
    validation curve's Pareto front (a tail no cheaper plan beats)."""
    pts = blocks_info.get("points", [])
    front = points.pareto(pts)
    return [p for p in pts if (p["entry"] < n and not p.get("tail")) or (p.get("tail") and p in front)]


def error_split(cal: Calibration, art, val) -> dict[str, float]:
    """Where the published plan's error lives: its validation KL as built, and with the consumer's own keys
    (or values) put back at every layer, or its own K and V in one half of the layers."""
    n, mid = cal.spec.num_layers, cal.spec.num_layers // 2
    scorer = PlanScorer(cal.producer, cal.consumer, val, lambda plan: art.with_plan(plan), hidden=art.needs_hidden)
    cases = {"as built": ((), "kv"), "own K at every layer": (range(n), "k"), "own V at every layer": (range(n), "v"),
             f"own K, V at layers 0-{mid - 1}": (range(mid), "kv"), f"own K, V at layers {mid}-{n - 1}": (range(mid, n), "kv")}
    return {name: scorer.kl(art.plan, layers, streams) for name, (layers, streams) in cases.items()}


def xnorm_profile(cal: Calibration, art, samples_) -> dict[str, list[float]]:
    """Mean relative x_norm error per layer on held-out continuations: Reuse-only vs SCD."""
    plans = {"reuse_only": art.with_plan(cal.base_plan), "scd": art}
    sums = {k: None for k in plans}
    for s in samples_:
        ids = s.prefix[None]
        mask = torch.ones_like(ids)
        ptrace = capture(cal.producer, ids, mask, want_hidden=art.needs_hidden)
        o = capture(cal.consumer, ids, mask, want_xnorm=False)
        oracle = list(zip(o.keys, o.values))
        for name, a in plans.items():
            kv, _ = rebuild(cal.consumer, a, encode(a, ptrace, ids))
            errs = torch.tensor(xnorm_errors(cal.consumer, kv, oracle, mask, s.cont[None]))
            sums[name] = errs if sums[name] is None else sums[name] + errs
    return {k: (v / len(samples_)).tolist() for k, v in sums.items()}
