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
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cluster.config import load_config
from jobs.family_report import plot, report
from scd.data import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting import family
from scd.fitting.aligners import patch_aligner
from scd.fitting.checkpoints import (ALIGNER_FIELDS, TUNE_FIELDS, key_dir, keyed, load_record, samples_digest,
                                     save_record)
from scd.fitting.finetune import Progress, finetune_scored
from scd.fitting.scoring import KEEP_RULE, wire_factor
from scd.online import codec
from artifacts_store import ArtifactStore, CalibrationData, Fingerprints
from artifacts_store.errors import ArtifactStoreError, InvalidReference
from artifacts_store.refs import check_name
from scd.online.artifacts import PairArtifacts, code_groups, layer_groups
from scd.online.family_artifacts import FamilyArtifacts
from scd.online.models import (ModelSpec, check_pair, data_digest, load, model_digest, tokenizer_fingerprint,
                               weights_digest)
from scd.online.rebuild import encode
from scd.online.reuse import LinearCodec
from scd.online.trace import capture


def log(msg: str) -> None:
    print(f"[family] {msg}", flush=True)


def artifacts(grams: family.Grams, own_grams: list[family.Grams], spec: ModelSpec, pairs: list[str], ranks: dict[str, int],
              ridge: float, dtype: str, family_id: str, x_group: int = 1, shrink: float = 1.0,
              bigram_shrink: float = 16.0) -> tuple[FamilyArtifacts, list[PairArtifacts]]:
    """(the family artifact, each member's own pair artifact), Reuse-only (layer 0 exact): the family's
    encoders from all the rows, each member's decoders and pair fit from its own (with token tables when
    the Grams hold per-token sums, "t", and bigram tables when a member's hold per-pair sums, "p")."""
    n, hidden = len(pairs), "x" in grams
    kind = "hidden" if hidden else "reuse"
    plan = ["exact"] + [kind] * (spec.num_layers - 1)

    def make(pair: str, codecs: dict[str, dict[int, object]]) -> PairArtifacts:
        return PairArtifacts(pair, spec, ranks.get("r_k", 1), ranks.get("r_v", 1), 1, 1, list(plan),
                             codecs.get("k", {}), codecs.get("v", {}), r_x=ranks.get("r_x", 0),
                             reuse_x=codecs.get("x", {}), code_dtype=dtype,
                             x_groups=layer_groups(spec.num_layers, x_group) if hidden else [])

    fam: list[dict] = [{} for _ in range(n)]
    own: list[dict] = [{} for _ in range(n)]
    tokens = lambda gs, l: gs["t"][l] if "t" in gs else None      # noqa: E731
    bigrams = lambda gs, l: gs["p"][l] if "p" in gs else None     # noqa: E731
    for stream, gs in grams.items():
        if stream in ("t", "p"):
            continue
        r = ranks["r_x" if hidden else f"r_{stream}"]
        for l, g in enumerate(gs):
            if g is None:
                continue
            mine, mine_t = [o[stream][l] for o in own_grams], [tokens(o, l) for o in own_grams]
            mine_p = [bigrams(o, l) for o in own_grams]
            fitted = family.fit_family(g, n, r, ridge, hidden, own=mine, tokens=tokens(grams, l),
                                       own_tokens=mine_t if "t" in grams else None, shrink=shrink,
                                       own_bigrams=mine_p,
                                       bigram_shrink=bigram_shrink)
            for j, c in enumerate(fitted):
                fam[j].setdefault(stream, {})[l] = c
                own[j].setdefault(stream, {})[l] = family.fit_codec(mine[j], r, ridge, hidden, mine_t[j], shrink,
                                                                    mine_p[j], bigram_shrink)
    return (FamilyArtifacts(family_id, {p: make(family_id, c) for p, c in zip(pairs, fam)}),
            [make(p, c) for p, c in zip(pairs, own)])


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


def patch_plan(arg: str, served: list[dict], num_layers: int, hidden: bool = True) -> list[list[int]]:
    """Each member's Patch layers from --patch-layers: "auto" (the Patch layers of the member's published pair
    artifact, none without one; with per-head codes, whose payload has no room for two codes at a layer,
    their union for every member), "none", or layer numbers for every member ("2,5")."""
    if arg == "none":
        return [[] for _ in served]
    if arg == "auto":
        own = [sorted(e["patch_layers"]) for e in served]
        return own if hidden else [sorted({l for p in own for l in p}) for _ in served]
    try:
        layers = sorted({int(x) for x in arg.split(",")})
    except ValueError:
        raise SystemExit(f"--patch-layers must be auto, none or layer numbers like 2,5; got {arg!r}") from None
    if any(not 1 <= l < num_layers for l in layers):
        raise SystemExit(f"--patch-layers must be within 1..{num_layers - 1} (layer 0 is exact), got {layers}")
    return [list(layers) for _ in served]


def fit_members(work: Path, shared: FamilyArtifacts, names: list[str], producer, consumers: list,
                calib: list[list[torch.Tensor]], plans: list[list[int]], c, pad_id: int | None, val: dict,
                tune: dict) -> FamilyArtifacts:
    """The family as served: each member Patches its layers of `plans` (one encoder per layer for the
    family, fitted on the x_norm of the members that Patch it; each member's own aligner, on its own
    prefixes) over the shared Reuse codes, then, with calibration.finetune_samples, each member's decoders
    and aligners are fine-tuned end to end on its own samples with the encoders frozen (so they stay the
    family's). Encoders, aligners and fine-tuned members are checkpointed under `work`."""
    cfg = c.model_dump()
    spec = shared.encoder.spec
    layers = sorted({l for p in plans for l in p})
    pdir = key_dir(work, "patch-", {"plans": plans, **keyed(cfg, ALIGNER_FIELDS)})
    rows: dict[str, torch.Tensor] = {}

    def patch_rows() -> dict[str, torch.Tensor]:        # one pass over the prefixes, only if something is not on disk
        if not rows:
            rows.update(family.patch_rows(producer, consumers, calib, layers, c.batch, pad_id))
        return rows

    encs = load_encoders(pdir / "encoders.safetensors", plans)
    if encs is None and layers:
        encs = family.patch_encoders(patch_rows(), plans, c.r_h, c.ridge)
        tmp = pdir / "encoders.tmp"
        save_file({k: v.clone() for j, e in enumerate(encs) for l, c_l in e.items()      # members share the encoder
                   for k, v in c_l.tensors(f"{j}.{l}").items()}, str(tmp))
        tmp.replace(pdir / "encoders.safetensors")
    tdir = key_dir(pdir, "tune-", {"ranks": shared.encoder.reuse_ranks, "code_dtype": c.code_dtype, "plans": plans,
                                   "source": c.reuse_source, **{k: cfg[k] for k in TUNE_FIELDS if k != "finetune_encoders"}})
    members = {}
    for j, (pair, base) in enumerate(shared.members.items()):
        plan = [("patch" if l in plans[j] else kind) for l, kind in enumerate(base.plan)]
        aligners = {}
        for l in plans[j]:
            def rows_of(n, l=l, j=j):       # in memory already: patch_aligner keeps the first n
                return family.own_rows(patch_rows(), j, l)
            aligners[l], curve, trained = patch_aligner(pdir / names[j] / f"layer_{l}.safetensors", c, spec.hidden_size,
                                                        encs[j][l], consumers[j], l, rows_of)
            log(f"{names[j]}: aligner for layer {l} " + (f"trained (best val {min(curve['val']):.4f})" if trained
                                                          else "resumed from checkpoint"))
        art = PairArtifacts(shared.family, spec, base.r_k, base.r_v, c.r_h, c.aligner_width, plan, base.reuse_k,
                            base.reuse_v, {l: encs[j][l] for l in plans[j]}, aligners, aligner_context=c.aligner_context,
                            aligner_tokens=c.aligner_tokens, aligner_window=c.aligner_window, r_x=base.r_x,
                            reuse_x=base.reuse_x, code_dtype=base.code_dtype, x_groups=base.x_groups)
        if c.finetune_samples and tune[names[j]] and (plans[j] or "hidden" in plan):
            art = finetuned(tdir / names[j], art, names[j], producer, consumers[j], tune[names[j]], val[names[j]], c,
                            pad_id)
        members[pair] = art
    return FamilyArtifacts(shared.family, members)


def load_encoders(path: Path, plans: list[list[int]]) -> list[dict[int, LinearCodec]] | None:
    """The family's Patch encoders (one codec per member and layer it Patches) from their checkpoint, or None."""
    if not path.is_file():
        return None
    t = load_file(str(path))
    return [{l: LinearCodec.from_tensors(t, f"{j}.{l}") for l in p} for j, p in enumerate(plans)]


def finetuned(d: Path, art: PairArtifacts, name: str, producer, consumer, tune: list, val: list, c,
              pad_id: int | None) -> PairArtifacts:
    """A member fine-tuned end to end (scd.fitting.finetune) with its encoders frozen, or its checkpoint in `d`
    when it was fine-tuned from these very codecs and aligners (a refitted Reuse code or a retrained aligner
    starts it afresh)."""
    inputs = {"tune": samples_digest(tune), "val": samples_digest(val), "start": weights_digest(art.tensors()),
              "keep": KEEP_RULE}
    if load_record(d / "record.json", inputs, log) is not None:
        log(f"{name}: fine-tuned member resumed from checkpoint")
        got = PairArtifacts.load(d)
        got.pair = art.pair                 # the same numbers may serve under another family name
        return got
    if c.finetune_encoders:
        log(f"{name}: finetune_encoders is ignored for a family (its encoders are shared by every member)")
    d.mkdir(parents=True, exist_ok=True)
    resume = Progress(d / "progress.safetensors", inputs)          # the epochs done so far
    fit = finetune_scored(producer, consumer, art, tune, val, c, pad_id, True, lambda line: log(f"{name}: {line}"),
                          resume=resume)
    art.save(d)
    save_record(d / "record.json", {"samples": len(tune), **fit.record()}, inputs)
    resume.clear()
    log(f"{name}: fine-tuned, validation KL {fit.val[0]:.4f} -> {fit.val[fit.best_epoch]:.4f}")
    return art


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


def budget_ranks(spec: ModelSpec, hidden: bool, budget: float, dtype: str, given: dict[str, int],
                 patched: int = 0, wire: float = 1.0) -> dict[str, int]:
    """The config's ranks, or with a payload budget the largest hidden-state rank whose codes fit in it beside
    `patched` Patch codes of rank given["r_h"], the wire sending `wire` of their bytes (per-head codes keep
    r_k and r_v: their budget is a two-rank frontier that a pair calibration chooses by KL)."""
    if not hidden:
        return {"r_k": given["r_k"], "r_v": given["r_v"]}
    if not budget:
        return {"r_x": given["r_x"]}
    groups = code_groups(spec.num_layers, given.get("x_group", 1))
    top = 2 * spec.num_kv_heads * spec.head_dim * max(map(len, groups))
    patch = patched * codec.code_bytes_per_row(given.get("r_h", 1), dtype)
    fits = [r for r in range(8, top + 1, 8)
            if wire * (len(groups) * codec.code_bytes_per_row(r, dtype) + patch) <= budget * spec.kv_bytes_per_token]
    if not fits:
        raise SystemExit(f"payload_budget {budget} is below the smallest hidden-state code of this family")
    return {"r_x": fits[-1]}


def main(argv: list[str] | None = None) -> dict:
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
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    c = cfg.calibration
    names = args.members.split(",") if args.members else [s.name for s in cfg.specialists]
    try:
        settings = [cfg.specialist(n) for n in names]
    except KeyError as e:
        raise SystemExit(str(e.args[0])) from None
    if len(set(names)) != len(names) or len(names) < 2:
        raise SystemExit(f"a family needs two or more different members, got {names}")
    for flag in ("prefixes", "heldout", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    n_prefixes, n_held = args.prefixes or c.prefixes, args.heldout or c.heldout
    try:
        check_name(args.name, "--name")
    except InvalidReference as e:
        raise SystemExit(str(e)) from None
    if args.name in {s.name for s in cfg.specialists} | {cfg.producer.name}:
        raise SystemExit(f"--name {args.name!r} is a model's name; give the family its own")
    family_id = f"{cfg.producer.name}:{args.name}"

    torch.manual_seed(c.seed)
    producer, tok, spec = load(cfg.producer.path)
    consumers = []
    for s in settings:
        m, tok_b, spec_b = load(s.path, base=s.base)
        check_pair(spec, spec_b, tokenizer_fingerprint(tok), tokenizer_fingerprint(tok_b))
        consumers.append(m)
    pairs = [f"{cfg.producer.name}:{n}" for n in names]
    hidden = c.reuse_source == "hidden"
    # each member's own calibration prefixes (those of its pair calibration), validation and held-out samples
    calib, val, held, tune = [], {}, {}, {}
    for n in names:
        cal_n, val[n], held[n] = samples.pair_data(n, tok, n_prefixes, c.val, n_held, c.prefix_tokens)
        tune[n] = samples.tune_samples(n, tok, c.finetune_samples, c.prefix_tokens, c.finetune_tokens)
        calib.append(cal_n)
    every = [p for mine in calib for p in mine]
    store = ArtifactStore(args.store or cfg.artifacts.uri)
    served = served_pairs(store, pairs, producer, consumers, tok)
    if all(e["art"] is not None and e["art"].exact_only for e in served):
        return exact_family(args, cfg, family_id, names, served, producer, consumers, tok, held, store, every)
    plans = patch_plan(args.patch_layers, served, spec.num_layers, hidden)
    given = {"r_k": c.r_k, "r_v": c.r_v, "r_x": c.r_x, "x_group": c.x_group, "r_h": c.r_h}
    n_patched = len({l for p in plans for l in p})
    ranks = budget_ranks(spec, hidden, c.payload_budget, c.code_dtype, given, patched=n_patched)
    log(f"members {names}: {n_prefixes} calibration prefixes each of {c.prefix_tokens} tokens, {n_held} held-out "
        f"each; {c.reuse_source} codes {ranks} in {c.code_dtype}; Patch layers {dict(zip(names, plans))}")

    work = key_dir(Path(c.work_dir).expanduser() / "family", "", {
        "models": [model_digest(producer), *map(model_digest, consumers)], "data": data_digest(every),
        "members": [len(mine) for mine in calib], "hidden": hidden, "batch": c.batch,
        **({"x_group": c.x_group} if c.x_group != 1 else {}),
        **({"token_table": c.token_table} if hidden and c.token_table else {}),
        **({"bigram_table": c.bigram_table} if hidden and c.bigram_table else {})})
    path = work / "grams.safetensors"
    t0 = time.time()
    if path.is_file():
        grams, own_grams = family.load_grams(path, spec, hidden, len(names), c.x_group)
        log(f"grams resumed from {path}")
    else:
        grams, own_grams = family.accumulate(producer, consumers, spec, calib, hidden, c.batch, tok.pad_token_id,
                                             c.x_group, c.token_table if hidden else 0,
                                             c.bigram_table if hidden else 0)
        family.save_grams(grams, own_grams, path)
        log(f"grams accumulated in {time.time() - t0:.0f} s ({path})")
    fit = lambda r: artifacts(grams, own_grams, spec, pairs, r, c.ridge, c.code_dtype, family_id,  # noqa: E731
                              c.x_group, c.token_shrink, c.bigram_shrink)
    shared, own = fit(ranks)
    wire = 1.0
    if hidden and c.payload_budget and codec.default_compress(c.code_dtype) != "none":
        # the budget counts the bytes as sent: the codes' compression, measured on the validation prefixes
        # at the rank that fits in code bytes, may buy a wider code (as a pair calibration's ranks stage)
        wire = wire_factor(producer, shared.encoder, [s.prefix for n in names for s in val[n]])
        wider = budget_ranks(spec, hidden, c.payload_budget, c.code_dtype, given, patched=n_patched, wire=wire)
        log(f"the wire sends {wire:.3f} of the code bytes at {ranks}: {wider} within payload_budget "
            f"{c.payload_budget}")
        if wider != ranks:
            ranks = wider
            shared, own = fit(ranks)
    fam = fit_members(work, shared, names, producer, consumers, calib, plans, c, tok.pad_token_id, val, tune)

    rows = []
    for j, (name, consumer) in enumerate(zip(names, consumers)):
        ways = [methods.RawKV(), methods.SCDMethod(own[j], "pair"),
                methods.SCDMethod(shared.members[pairs[j]], "family_reuse"),
                methods.SCDMethod(fam.members[pairs[j]], "family", encoder=fam.encoder)]
        if served[j]["art"] is not None:
            ways.append(methods.SCDMethod(served[j]["art"], "served_pair"))
        by = {r["method"]: r for r in Evaluator(producer, consumer, tok).run(held[name], ways, desc=f"held-out {name}")}
        # a published pair artifact is scored on these samples when it loads for these models, else its recorded KL
        measured = "served_pair" in by
        rows.append({"member": name, **{k: by[k]["kl"] for k in ("raw_kv", "pair", "family_reuse", "family")},
                     "served_pair": by["served_pair"]["kl"] if measured else served[j]["kl"],
                     "served_pair_source": "measured" if measured else "recorded" if served[j]["kl"] is not None else None,
                     "payload_ratio": by["family"]["payload_ratio"],
                     "served_payload_ratio": by["served_pair"]["payload_ratio"] if measured else None,
                     "greedy_pair": by["pair"]["greedy"], "greedy_family": by["family"]["greedy"]})
    published_pairs = all(e["art"] is not None for e in served)
    cost = fanout_cost(producer, fam, [e["art"] for e in served] if published_pairs else own,
                       fanout_prefix(held[names[0]], c.prefix_tokens), args.repeats)
    cost["pairs_are"] = "published pair artifacts" if published_pairs else "Reuse-only pair fits"
    result = {"family": family_id, "members": pairs, "ranks": ranks, "code_dtype": c.code_dtype, "wire_factor": wire,
              "patch_layers": dict(zip(names, plans)),
              "prefixes": len(every), "heldout": n_held, "kl": rows, "fanout": cost}
    rows_fitted = next(g for gs in grams.values() for g in gs if g is not None).n
    return finish(args, cfg, fam, result, f"{c.reuse_source} {ranks}, {c.code_dtype}",
                  f"{ranks} codes in {c.code_dtype}, Patch layers {dict(zip(names, plans))}", producer, consumers,
                  tok, store, every, rows_fitted)


def fanout_prefix(held: list, tokens: int) -> torch.Tensor:
    """(1, tokens): a fan-out's prefix for the cost measurement, from one member's held-out prefixes end to end."""
    return torch.tensor([sum((s.prefix.tolist() for s in held), [])[:tokens]])


def finish(args, cfg, fam: FamilyArtifacts, result: dict, what: str, codes: str, producer, consumers: list, tok,
           store: ArtifactStore, every: list, rows_fitted: int) -> dict:
    """Write the family artifact, its figures and plot under --out, print the report, and publish with --publish."""
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
        result["published"] = publish(store, fam, producer, consumers, tok, rows, cfg.calibration, every,
                                      rows_fitted, out)
    return result


def exact_family(args, cfg, family_id: str, names: list[str], served: list[dict], producer, consumers: list, tok,
                 held: dict, store: ArtifactStore, every: list) -> dict:
    """A family whose members are all served by exact plans (scd.fitting.exact): nothing is fitted. The family
    payload carries the producer's K and V once for every layer a member shares, and a residual at each
    member's entry (FamilyArtifacts); each member's held-out KL from it is scored beside its own payload's."""
    c = cfg.calibration
    pairs = [f"{cfg.producer.name}:{n}" for n in names]
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
    cost = fanout_cost(producer, fam, [e["art"] for e in served], fanout_prefix(held[names[0]], c.prefix_tokens),
                       args.repeats)
    cost["pairs_are"] = "published pair artifacts"
    result = {"family": family_id, "members": pairs, "plan": fam.encoder.plan, "code_dtype": fam.encoder.code_dtype,
              "heldout": len(held[names[0]]), "kl": rows, "fanout": cost}
    return finish(args, cfg, fam, result, f"exact plans, {fam.encoder.code_dtype}",
                  f"exact plans in {fam.encoder.code_dtype}", producer, consumers, tok, store, every, 0)


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
