"""One code for a whole family: fit a producer's Reuse codes against all its specialists at once, and compare
with per-pair codes at the same rank.

    python -m jobs.family --config ray_config.yaml                      # every specialist of the config
    python -m jobs.family --config configs/smollm2.yaml --members qa,code_few --prefixes 8

One pass over every member's own calibration prefixes (those of its pair calibration, --prefixes each)
accumulates the family's Gram matrices, [producer rows | every member's K, V side by side], over all of
them, and each member's Gram of [producer rows | its K, V] over its own: the family's encoders are fitted
on all the rows, each member's decoders and its pair fit on its own (scd.fitting.family). Both fits are
first Reuse-only (layer 0 exact, the config's reuse source, ranks and code precision), which isolates
what sharing the encoder costs. The family as served then adds Patch layers (--patch-layers; default each
member's own, those of its published pair artifact): one Patch encoder per layer for the family, each
member's own aligner, trained on its own x_norm over its own prefixes. The payload carries every code a
member needs, and each member rebuilds from those of its own plan. With calibration.finetune_samples, each
member's decoders and aligners are fine-tuned end to end on its own samples, as a pair's are; the encoders
stay frozen, so they stay the family's. Every stage is checkpointed under calibration.work_dir/family.
Reported:
  - each member's held-out KL (its own samples) under raw KV reuse, its Reuse-only pair code, the Reuse-only
    family code, the family as served, and its published pair artifact (what a fan-out sends it today);
  - a fan-out to every member: wire bytes and producer encode time, one family payload against one
    payload per pair (the published pair artifacts when every member has one; medians of interleaved
    rounds);
and written under --out/<producer>/<name>: the family artifact (scd.online.family_artifacts.FamilyArtifacts:
safetensors with the shared encoders once and each member's decoders, family.json), figures.json with the
figures, and family.png (KL per member, pair vs family). With --publish, the family goes to the artifact
store as PRODUCER:NAME (a manifest with every member's fingerprint) when each member's family KL passes the
config's quality gates (calibration.gate_vs_raw_kv x raw KV reuse's, and calibration.family_vs_pair x the
KL of the member's published pair artifact); a `families:` entry then serves it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from artifacts_store import ArtifactStore, CalibrationData, Fingerprints
from artifacts_store.errors import ArtifactStoreError, InvalidReference
from artifacts_store.refs import check_name
from cluster.config import load_config
from jobs.family_fit import artifacts, budget_ranks, fit_members, given_ranks, patch_plan
from jobs.family_report import plot, report
from scd.data import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting import family
from scd.fitting.checkpoints import key_dir
from scd.fitting.scoring import wire_factor
from scd.online import codec
from scd.online.artifacts import PairArtifacts
from scd.online.family_artifacts import FamilyArtifacts
from scd.online.models import ModelSpec, check_pair, data_digest, load, model_digest, tokenizer_fingerprint
from scd.online.rebuild import encode
from scd.online.trace import capture


def log(msg: str) -> None:
    print(f"[family] {msg}", flush=True)


@dataclass
class FamilyJob:
    """What every stage of a family's fit reads: the settings, the producer and every member's model, each
    member's samples, and what a fan-out sends each member today."""
    args: argparse.Namespace
    cfg: object                 # the loaded config (cluster.config)
    c: object                   # its calibration settings
    family_id: str              # PRODUCER:NAME
    names: list[str]            # the members, as the config names them
    pairs: list[str]            # PRODUCER:member, in the same order
    producer: object
    tok: object
    spec: ModelSpec
    consumers: list
    hidden: bool                # hidden-state codes (else per-head K, V)
    n_prefixes: int             # calibration prefixes and held-out samples per member
    n_held: int
    calib: list[list]           # each member's calibration prefixes
    val: dict                   # member -> validation, held-out and fine-tuning samples
    held: dict
    tune: dict
    every: list                 # every member's calibration prefixes, end to end
    store: ArtifactStore
    served: list[dict]          # served_pairs: each member's published pair artifact, if any


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    job = load_members(args, *check_members(args))
    if all(e["art"] is not None and e["art"].exact_only for e in job.served):
        return exact_family(job)
    plans, ranks = code_shape(job)
    grams, own_grams, work = family_grams(job)
    shared, own, ranks, wire = fit_reuse(job, grams, own_grams, ranks, plans)
    fam = fit_members(work, shared, job.names, job.producer, job.consumers, job.calib, plans, job.c,
                      job.tok.pad_token_id, job.val, job.tune, log)
    rows = score_members(job, own, shared, fam)
    result = figures(job, ranks, wire, plans, rows, fanout(job, fam, own))
    return finish(job, fam, result, f"{job.c.reuse_source} {ranks}, {job.c.code_dtype}",
                  f"{ranks} codes in {job.c.code_dtype}, Patch layers {result['patch_layers']}", rows_fitted(grams))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jobs.family", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--members", help="specialist names, comma-separated (default: every specialist)")
    p.add_argument("--prefixes", type=int, help=(
        "calibration prefixes per member (default: the config's calibration.prefixes, as a pair calibration)"))
    p.add_argument("--heldout", type=int, help="held-out samples per member (default: the config's)")
    p.add_argument("--repeats", type=int, default=10, help="rounds of the fan-out encode timing")
    p.add_argument("--name", default="family", help="the family's name: its artifact's id is PRODUCER:NAME")
    p.add_argument("--out", default="runs/family", help="where the family artifact and figures go")
    p.add_argument("--publish", action="store_true", help=(
        "publish the family to the config's artifact store (every member's fingerprint in its manifest) when "
        "each member's family KL passes calibration.gate_vs_raw_kv and calibration.family_vs_pair; serve it with "
        "a `families:` entry"))
    p.add_argument("--patch-layers", default="auto", help=(
        "the members' Patch layers: auto (default: each member's published pair artifact's, none without one), "
        "none (Reuse-only), or layer numbers like 2,5 for every member; each member trains its own aligners"))
    p.add_argument("--store", help="artifact store URI for --publish (default: the config's artifacts.uri)")
    return p.parse_args(argv)


def check_members(args: argparse.Namespace) -> tuple[object, list[str], list]:
    """(the config, the members' names, their settings): two or more different specialists of the config,
    positive counts, and a family name that is a valid one and no model's."""
    cfg = load_config(args.config)
    names = args.members.split(",") if args.members else [s.name for s in cfg.specialists]
    try:
        members = [cfg.specialist(n) for n in names]
    except KeyError as e:
        raise SystemExit(str(e.args[0])) from None
    if len(set(names)) != len(names) or len(names) < 2:
        raise SystemExit(f"a family needs two or more different members, got {names}")
    for flag in ("prefixes", "heldout", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    try:
        check_name(args.name, "--name")
    except InvalidReference as e:
        raise SystemExit(str(e)) from None
    if args.name in {s.name for s in cfg.specialists} | {cfg.producer.name}:
        raise SystemExit(f"--name {args.name!r} is a model's name; give the family its own")
    return cfg, names, members


def load_members(args: argparse.Namespace, cfg, names: list[str], members: list) -> FamilyJob:
    """The producer and every member's model (refusing one incompatible with the producer), each member's own
    calibration prefixes (those of its pair calibration), validation, held-out and fine-tuning samples, and
    what a fan-out sends each member today."""
    c = cfg.calibration
    n_prefixes, n_held = args.prefixes or c.prefixes, args.heldout or c.heldout
    torch.manual_seed(c.seed)
    producer, tok, spec = load(cfg.producer.path)
    consumers = []
    for s in members:
        m, tok_b, spec_b = load(s.path, base=s.base)
        check_pair(spec, spec_b, tokenizer_fingerprint(tok), tokenizer_fingerprint(tok_b))
        consumers.append(m)
    pairs = [f"{cfg.producer.name}:{n}" for n in names]
    calib, val, held, tune = [], {}, {}, {}
    for n in names:
        cal_n, val[n], held[n] = samples.pair_data(n, tok, n_prefixes, c.val, n_held, c.prefix_tokens)
        tune[n] = samples.tune_samples(n, tok, c.finetune_samples, c.prefix_tokens, c.finetune_tokens)
        calib.append(cal_n)
    store = ArtifactStore(args.store or cfg.artifacts.uri)
    return FamilyJob(args, cfg, c, f"{cfg.producer.name}:{args.name}", names, pairs, producer, tok, spec, consumers,
                     c.reuse_source == "hidden", n_prefixes, n_held, calib, val, held, tune,
                     [p for mine in calib for p in mine], store, served_pairs(store, pairs, producer, consumers, tok))


def code_shape(job: FamilyJob) -> tuple[list[list[int]], dict[str, int]]:
    """Each member's Patch layers (--patch-layers) and the Reuse code's ranks: the config's, or with a payload
    budget the widest whose codes fit in it beside the Patch codes."""
    c = job.c
    plans = patch_plan(job.args.patch_layers, job.served, job.spec.num_layers, job.hidden)
    ranks = budget_ranks(job.spec, job.hidden, c.payload_budget, c.code_dtype, given_ranks(c),
                         patched=len({l for p in plans for l in p}))
    log(f"members {job.names}: {job.n_prefixes} calibration prefixes each of {c.prefix_tokens} tokens, {job.n_held} "
        f"held-out each; {c.reuse_source} codes {ranks} in {c.code_dtype}; Patch layers {dict(zip(job.names, plans))}")
    return plans, ranks


def family_grams(job: FamilyJob) -> tuple[family.Grams, list[family.Grams], Path]:
    """One pass over every member's calibration prefixes: the family's Gram matrices over all of them and each
    member's over its own (scd.fitting.family.accumulate), or their checkpoint; and the family's work folder,
    keyed by the models, the data and the settings they depend on."""
    c, hidden = job.c, job.hidden
    work = key_dir(Path(c.work_dir).expanduser() / "family", "", {
        "models": [model_digest(job.producer), *map(model_digest, job.consumers)], "data": data_digest(job.every),
        "members": [len(mine) for mine in job.calib], "hidden": hidden, "batch": c.batch,
        **({"x_group": c.x_group} if c.x_group != 1 else {}),
        **({"token_table": c.token_table} if hidden and c.token_table else {}),
        **({"bigram_table": c.bigram_table} if hidden and c.bigram_table else {})})
    path = work / "grams.safetensors"
    t0 = time.time()
    if path.is_file():
        grams, own_grams = family.load_grams(path, job.spec, hidden, len(job.names), c.x_group)
        log(f"grams resumed from {path}")
    else:
        grams, own_grams = family.accumulate(job.producer, job.consumers, job.spec, job.calib, hidden, c.batch,
                                             job.tok.pad_token_id, c.x_group, c.token_table if hidden else 0,
                                             c.bigram_table if hidden else 0)
        family.save_grams(grams, own_grams, path)
        log(f"grams accumulated in {time.time() - t0:.0f} s ({path})")
    return grams, own_grams, work


def fit_reuse(job: FamilyJob, grams: family.Grams, own_grams: list[family.Grams], ranks: dict[str, int],
              plans: list[list[int]]) -> tuple[FamilyArtifacts, list, dict[str, int], float]:
    """The Reuse-only codes (layer 0 exact): the family's, and each member's own pair code at the same ranks.
    With a payload budget and compressed codes, the budget counts the bytes as sent: the codes' compression,
    measured on the validation prefixes at the ranks that fit in code bytes, may buy a wider code (as a pair
    calibration's ranks stage), fitted again. Returns (family, own pair codes, ranks, the wire's share)."""
    c, spec, hidden = job.c, job.spec, job.hidden
    fit = lambda r: artifacts(grams, own_grams, spec, job.pairs, r, c.ridge, c.code_dtype, job.family_id,  # noqa: E731
                              c.x_group, c.token_shrink, c.bigram_shrink)
    shared, own = fit(ranks)
    wire = 1.0
    if hidden and c.payload_budget and codec.default_compress(c.code_dtype) != "none":
        wire = wire_factor(job.producer, shared.encoder, [s.prefix for n in job.names for s in job.val[n]])
        wider = budget_ranks(spec, hidden, c.payload_budget, c.code_dtype, given_ranks(c),
                             patched=len({l for p in plans for l in p}), wire=wire)
        log(f"the wire sends {wire:.3f} of the code bytes at {ranks}: {wider} within payload_budget "
            f"{c.payload_budget}")
        if wider != ranks:
            ranks = wider
            shared, own = fit(ranks)
    return shared, own, ranks, wire


def score_members(job: FamilyJob, own: list, shared: FamilyArtifacts, fam: FamilyArtifacts) -> list[dict]:
    """Each member's held-out KL on its own samples under raw KV reuse, its Reuse-only pair code, the Reuse-only
    family code, the family as served, and its published pair artifact (scored on these samples when it loads
    for these models, else the KL its calibration recorded)."""
    rows = []
    for j, (name, consumer) in enumerate(zip(job.names, job.consumers)):
        ways = [methods.RawKV(), methods.SCDMethod(own[j], "pair"),
                methods.SCDMethod(shared.members[job.pairs[j]], "family_reuse"),
                methods.SCDMethod(fam.members[job.pairs[j]], "family", encoder=fam.encoder)]
        served = job.served[j]
        if served["art"] is not None:
            ways.append(methods.SCDMethod(served["art"], "served_pair"))
        by = {r["method"]: r for r in Evaluator(job.producer, consumer, job.tok).run(job.held[name], ways,
                                                                                   desc=f"held-out {name}")}
        measured = "served_pair" in by
        rows.append({"member": name, **{k: by[k]["kl"] for k in ("raw_kv", "pair", "family_reuse", "family")},
                     "served_pair": by["served_pair"]["kl"] if measured else served["kl"],
                     "served_pair_source": "measured" if measured else "recorded" if served["kl"] is not None else None,
                     "payload_ratio": by["family"]["payload_ratio"],
                     "served_payload_ratio": by["served_pair"]["payload_ratio"] if measured else None,
                     "greedy_pair": by["pair"]["greedy"], "greedy_family": by["family"]["greedy"]})
    return rows


def fanout(job: FamilyJob, fam: FamilyArtifacts, own: list | None) -> dict:
    """A fan-out to every member (fanout_cost): one family payload against one payload per pair, the published
    pair artifacts when every member has one, else the members' own Reuse-only pair codes (`own`)."""
    published = all(e["art"] is not None for e in job.served)
    cost = fanout_cost(job.producer, fam, [e["art"] for e in job.served] if published else own,
                       fanout_prefix(job.held[job.names[0]], job.c.prefix_tokens), job.args.repeats)
    cost["pairs_are"] = "published pair artifacts" if published else "Reuse-only pair fits"
    return cost


def figures(job: FamilyJob, ranks: dict[str, int], wire: float, plans: list[list[int]], rows: list[dict],
            cost: dict) -> dict:
    """The family's figures (figures.json, and the family artifact's info)."""
    return {"family": job.family_id, "members": job.pairs, "ranks": ranks, "code_dtype": job.c.code_dtype,
            "wire_factor": wire, "patch_layers": dict(zip(job.names, plans)), "prefixes": len(job.every),
            "heldout": job.n_held, "kl": rows, "fanout": cost}


def rows_fitted(grams: family.Grams) -> int:
    """The rows the family's Gram matrices were accumulated over."""
    return next(g for gs in grams.values() for g in gs if g is not None).n


def served_pairs(store: ArtifactStore, pairs: list[str], producer, consumers: list, tok) -> list[dict]:
    """What a fan-out sends each member today: per member {"art": its latest published pair artifact, loaded
    for these very models (None when there is none, or it was fitted for other weights), "kl": the held-out KL
    its calibration recorded (None when none is published), "why": what stopped the load}."""
    out = []
    for pair, consumer in zip(pairs, consumers):
        entry = {"art": None, "kl": None, "why": None, "patch_layers": []}
        try:
            entry["kl"] = store.show(f"{pair}@latest").metrics.get("kl")
            art, m = store.load(f"{pair}@latest", Fingerprints.of(producer=producer, consumer=consumer, tokenizer=tok))
            entry.update(art=art, patch_layers=list(m.patch_layers))
        except ArtifactStoreError as e:
            entry["why"] = str(e)
        out.append(entry)
    return out


def fanout_cost(producer, fam: FamilyArtifacts, pairs: list[PairArtifacts], ids: torch.Tensor,
                repeats: int) -> dict:
    """Wire bytes and producer encode ms (median of interleaved rounds, after a warm-up) of a fan-out to every
    member: one family payload against one payload per pair (of `pairs`' artifacts)."""
    trace = capture(producer, ids, torch.ones_like(ids), want_hidden=fam.encoder.needs_hidden)

    def payloads(arts):
        return [codec.encode(encode(a, trace, ids), a.pair, "v", codec.artifact_dims(a), a.code_dtype) for a in arts]

    ways = {"family": [fam.encoder], "pairs": pairs}
    nbytes = {name: sum(len(b) for b in payloads(arts)) for name, arts in ways.items()}     # also the warm-up
    ms = {name: [] for name in ways}
    for _ in range(repeats):
        for name, arts in ways.items():
            t = time.perf_counter()
            payloads(arts)
            ms[name].append((time.perf_counter() - t) * 1e3)
    return {"tokens": ids.shape[1], "family_bytes": nbytes["family"], "pairs_bytes": nbytes["pairs"],
            "family_encode_ms": statistics.median(ms["family"]), "pairs_encode_ms": statistics.median(ms["pairs"])}


def fanout_prefix(held: list, tokens: int) -> torch.Tensor:
    """(1, tokens): a fan-out's prefix for the cost measurement, from one member's held-out prefixes end to end."""
    return torch.tensor([sum((s.prefix.tolist() for s in held), [])[:tokens]])


def finish(job: FamilyJob, fam: FamilyArtifacts, result: dict, what: str, codes: str, rows_fitted: int) -> dict:
    """Write the family artifact, its figures and plot under --out, print the report, and publish with --publish."""
    args, cfg = job.args, job.cfg
    out = Path(args.out).expanduser() / cfg.producer.name / args.name
    rows = result["kl"]
    fam.info = result
    fam.save(out)
    (out / "figures.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "family.png", f"{cfg.producer.name}: one payload for {len(rows)} specialists vs one per pair "
                                    f"({what})")
    report(rows, result["fanout"], codes)
    print(f"written: {out}")
    if args.publish:
        result["published"] = publish(job.store, fam, job.producer, job.consumers, job.tok, rows, cfg.calibration,
                                      job.every, rows_fitted, out)
    return result


def exact_family(job: FamilyJob) -> dict:
    """A family whose members are all served by exact plans (scd.fitting.exact): nothing is fitted. The family
    payload carries the producer's K and V once for every layer a member shares, and a residual at each
    member's entry (FamilyArtifacts); each member's held-out KL from it is scored beside its own payload's."""
    family_id, names, served, pairs = job.family_id, job.names, job.served, job.pairs
    producer, consumers, tok, held = job.producer, job.consumers, job.tok, job.held
    fam = FamilyArtifacts(family_id, {p: dataclasses.replace(e["art"], pair=family_id, info={}, derived={})
                                      for p, e in zip(pairs, served)})
    log(f"members {names} are served by exact plans: one payload of {fam.encoder.plan}")
    rows = []
    for j, (name, consumer) in enumerate(zip(names, consumers)):
        ways = [methods.RawKV(), methods.SCDMethod(served[j]["art"], "served_pair"),
                methods.SCDMethod(fam.members[pairs[j]], "family", encoder=fam.encoder)]
        by = {r["method"]: r for r in Evaluator(producer, consumer, tok).run(held[name], ways, desc=f"held-out {name}")}
        rows.append({"member": name, "raw_kv": by["raw_kv"]["kl"], "pair": None, "family_reuse": None,
                     "family": by["family"]["kl"], "served_pair": by["served_pair"]["kl"],
                     "served_pair_source": "measured", "payload_ratio": by["family"]["payload_ratio"],
                     "served_payload_ratio": by["served_pair"]["payload_ratio"],
                     "greedy_pair": by["served_pair"]["greedy"], "greedy_family": by["family"]["greedy"]})
    cost = fanout(job, fam, None)               # every member has a published pair artifact
    result = {"family": family_id, "members": pairs, "plan": fam.encoder.plan, "code_dtype": fam.encoder.code_dtype,
              "heldout": len(held[names[0]]), "kl": rows, "fanout": cost}
    return finish(job, fam, result, f"exact plans, {fam.encoder.code_dtype}",
                  f"exact plans in {fam.encoder.code_dtype}", 0)


def publish(store: ArtifactStore, fam: FamilyArtifacts, producer, consumers: list, tok, rows: list[dict], c,
            calib: list, rows_fitted: int, out: Path) -> str | None:
    """Publish `fam` when every member's held-out family KL is within calibration.gate_vs_raw_kv of raw KV
    reuse's (as a pair's calibration is gated) and within calibration.family_vs_pair of its published pair
    artifact's (scored on the same samples, else as recorded), if it has one: serving swaps that pair code for
    the family's in a fan-out. Returns its ref, or None (refused, and why is printed)."""
    failed = [f"{r['member']}: family KL {r['family']:.4f} > {c.gate_vs_raw_kv:g} x raw KV {r['raw_kv']:.4f}"
              for r in rows if c.gate_vs_raw_kv and r["family"] > c.gate_vs_raw_kv * r["raw_kv"]]
    failed += [f"{r['member']}: family KL {r['family']:.4f} > {c.family_vs_pair:g} x its published pair artifact's "
               f"{r['served_pair']:.4f} ({r['served_pair_source']})" for r in rows
               if c.family_vs_pair and r["served_pair"] is not None and r["family"] > c.family_vs_pair * r["served_pair"]]
    if failed:
        store.refuse(fam.family, {"reasons": failed, "kl": rows})
        log(f"quality gate: NOT published ({'; '.join(failed)})")
        return None
    prints = {pair: Fingerprints.of(producer=producer, consumer=m, tokenizer=tok)
              for pair, m in zip(fam.members, consumers)}
    metrics = {f"{key}.{r['member']}": r[key] for r in rows
               for key in ("family", "family_reuse", "pair", "raw_kv", "served_pair") if r[key] is not None}
    metrics.update(payload_ratio=rows[0]["payload_ratio"],
                   **{k: float(v) for k, v in fam.info["fanout"].items() if k != "pairs_are"})
    manifest = store.publish_family(
        fam, prints, CalibrationData(digest=data_digest(calib), n_prefixes=len(calib), rows=rows_fitted),
        metrics, {f"report/{name}": (out / name).read_bytes() for name in ("figures.json", "family.png")})
    ref = f"{fam.family}@{manifest.version}"
    log(f"published {ref} to {store}; serve it with `families: [{{name: {fam.family.split(':')[1]}}}]`")
    return ref


if __name__ == "__main__":
    main()
    sys.exit(0)
