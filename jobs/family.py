"""One code for a whole family: fit a producer's Reuse codes against all its specialists at once, and compare
with per-pair codes at the same rank.

    python -m jobs.family --config ray_config.yaml                      # every specialist of the config
    python -m jobs.family --config configs/smollm2.yaml --members qa,code_few --prefixes 24

One pass over common calibration prefixes (an equal share of each member's data) accumulates the family's
Gram matrices, [producer rows | every member's K, V side by side]; every per-pair Gram is a block of them
(scd.fitting.family). Both fits are Reuse-only (layer 0 exact, the config's reuse source, ranks and code
precision), so the comparison isolates what sharing the encoder costs. Reported:
  - each member's held-out KL (its own samples) under raw KV reuse, its pair code and the family code;
  - a fan-out to every member: wire bytes and producer encode time, one family payload against one
    payload per pair (medians of interleaved rounds);
and written under --out/<producer>/<name>: the family artifact (scd.online.artifacts.FamilyArtifacts:
safetensors with the shared encoders once and each member's decoders, family.json), figures.json with the
figures, and family.png (KL per member, pair vs family). With --publish, the family goes to the artifact
store as PRODUCER:NAME (a manifest with every member's fingerprint) when each member's family KL passes the
config's quality gates (calibration.gate_vs_raw_kv x raw KV reuse's, and calibration.family_vs_pair x the
KL of the member's published pair artifact); a `families:` entry then serves it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from cluster.config import load_config
from jobs import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting import family
from scd.fitting.calibrate import pad
from scd.fitting.checkpoints import key_dir
from scd.fitting.gram import JointGram
from scd.online import codec
from artifacts_store import ArtifactNotFound, ArtifactStore, CalibrationData, Fingerprints
from artifacts_store.errors import InvalidReference
from artifacts_store.refs import check_name
from scd.online.artifacts import FamilyArtifacts, PairArtifacts
from scd.online.models import ModelSpec, check_pair, data_digest, load, model_digest, tokenizer_fingerprint
from scd.online.rebuild import encode
from scd.online.trace import capture


def log(msg: str) -> None:
    print(f"[family] {msg}", flush=True)


def accumulate(producer, consumers: list, spec: ModelSpec, prefixes: list[torch.Tensor], hidden: bool,
               batch: int, pad_id: int | None) -> dict[str, list[JointGram]]:
    """Family Gram matrices from one pass over the prefixes: per layer, hidden-state codes [x_A | (K_j, V_j)_j]
    (layers >= 1), or per-head codes [K_A | K_j...] and [V_A | V_j...] (every layer)."""
    n, L = len(consumers), spec.num_layers
    m, d, hid = spec.num_kv_heads * spec.head_dim, spec.head_dim, spec.hidden_size
    grams = ({"x": [None] + [JointGram(hid, n * 2 * m) for _ in range(1, L)]} if hidden else
             {"k": [JointGram(d, n * d) for _ in range(L)], "v": [JointGram(d, n * d) for _ in range(L)]})
    for start in tqdm(range(0, len(prefixes), batch), desc="family traces"):
        ids, mask = pad(prefixes[start:start + batch], pad_id)
        keep = mask.bool()
        a = capture(producer, ids, mask, want_xnorm=hidden)
        bs = [capture(c, ids, mask, want_xnorm=False) for c in consumers]
        rows = lambda t: t.transpose(1, 2)[keep].float()        # noqa: E731  (B, n_kv, T, d) -> (N, n_kv, d)
        for l in range(L):
            if hidden:
                if l:
                    target = torch.cat([torch.cat([rows(b.content[l]).flatten(1), rows(b.values[l]).flatten(1)], 1)
                                        for b in bs], 1)
                    grams["x"][l].update(a.xnorm[l][keep].float(), target)
            else:
                grams["k"][l].update(rows(a.content[l]), torch.cat([rows(b.content[l]) for b in bs], -1))
                grams["v"][l].update(rows(a.values[l]), torch.cat([rows(b.values[l]) for b in bs], -1))
    return grams


def save_grams(grams: dict[str, list[JointGram]], path: Path) -> None:
    t = {k: v for name, gs in grams.items() for l, g in enumerate(gs) if g is not None
         for k, v in g.tensors(f"{name}.{l}").items()}
    tmp = path.with_suffix(".tmp")
    save_file(t, str(tmp))
    tmp.replace(path)


def load_grams(path: Path, spec: ModelSpec, hidden: bool) -> dict[str, list[JointGram]]:
    t = load_file(str(path))
    if hidden:
        return {"x": [None] + [JointGram.from_tensors(t, f"x.{l}", spec.hidden_size) for l in range(1, spec.num_layers)]}
    return {s: [JointGram.from_tensors(t, f"{s}.{l}", spec.head_dim) for l in range(spec.num_layers)] for s in "kv"}


def artifacts(grams: dict[str, list[JointGram]], spec: ModelSpec, pairs: list[str], ranks: dict[str, int],
              ridge: float, dtype: str, family_id: str) -> tuple[FamilyArtifacts, list[PairArtifacts]]:
    """(the family artifact, each member's own pair artifact), Reuse-only (layer 0 exact)."""
    n, hidden = len(pairs), "x" in grams
    kind = "hidden" if hidden else "reuse"
    plan = ["exact"] + [kind] * (spec.num_layers - 1)

    def make(pair: str, codecs: dict[str, dict[int, object]]) -> PairArtifacts:
        return PairArtifacts(pair, spec, ranks.get("r_k", 1), ranks.get("r_v", 1), 1, 1, list(plan),
                             codecs.get("k", {}), codecs.get("v", {}), r_x=ranks.get("r_x", 0),
                             reuse_x=codecs.get("x", {}), code_dtype=dtype)

    fam: list[dict] = [{} for _ in range(n)]
    own: list[dict] = [{} for _ in range(n)]
    for stream, gs in grams.items():
        r = ranks["r_x" if hidden else f"r_{stream}"]
        for l, g in enumerate(gs):
            if g is None:
                continue
            for j, c in enumerate(family.fit_family(g, n, r, ridge, hidden)):
                fam[j].setdefault(stream, {})[l] = c
                own[j].setdefault(stream, {})[l] = family.fit_pair(g, n, j, r, ridge, hidden)
    return (FamilyArtifacts(family_id, {p: make(family_id, c) for p, c in zip(pairs, fam)}),
            [make(p, c) for p, c in zip(pairs, own)])


def fanout_cost(producer, fam: FamilyArtifacts, own: list[PairArtifacts], ids: torch.Tensor,
                repeats: int) -> dict:
    """Wire bytes and producer encode ms (median of interleaved rounds, after a warm-up) of a fan-out to every
    member: one family payload against one payload per pair."""
    trace = capture(producer, ids, torch.ones_like(ids))

    def payloads(arts):
        return [codec.encode(encode(a, trace, ids), a.pair, "v", codec.artifact_dims(a), a.code_dtype) for a in arts]

    ways = {"family": [fam.encoder], "pairs": own}
    nbytes = {name: sum(len(b) for b in payloads(arts)) for name, arts in ways.items()}     # also the warm-up
    ms = {name: [] for name in ways}
    for _ in range(repeats):
        for name, arts in ways.items():
            t = time.perf_counter()
            payloads(arts)
            ms[name].append((time.perf_counter() - t) * 1e3)
    return {"tokens": ids.shape[1], "family_bytes": nbytes["family"], "pairs_bytes": nbytes["pairs"],
            "family_encode_ms": statistics.median(ms["family"]), "pairs_encode_ms": statistics.median(ms["pairs"])}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    x = range(len(rows))
    for i, (key, label) in enumerate((("raw_kv", "raw KV reuse"), ("pair", "pair code"), ("family", "family code"))):
        ax.bar([v + (i - 1) * 0.27 for v in x], [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(list(x), [r["member"] for r in rows])
    ax.set_ylabel("held-out KL(oracle ‖ method)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def budget_ranks(spec: ModelSpec, hidden: bool, budget: float, dtype: str, given: dict[str, int]) -> dict[str, int]:
    """The config's ranks, or with a payload budget the largest hidden-state rank within it (per-head codes
    keep r_k and r_v: their budget is a two-rank frontier that a pair calibration chooses by KL)."""
    if not hidden:
        return {"r_k": given["r_k"], "r_v": given["r_v"]}
    if not budget:
        return {"r_x": given["r_x"]}
    top = 2 * spec.num_kv_heads * spec.head_dim
    fits = [r for r in range(8, top + 1, 8)
            if (spec.num_layers - 1) * codec.code_bytes_per_row(r, dtype) <= budget * spec.kv_bytes_per_token]
    if not fits:
        raise SystemExit(f"payload_budget {budget} is below the smallest hidden-state code of this family")
    return {"r_x": fits[-1]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="jobs.family", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--members", help="specialist names, comma-separated (default: every specialist)")
    p.add_argument("--prefixes", type=int, help="common calibration prefixes (default: the config's)")
    p.add_argument("--heldout", type=int, help="held-out samples per member (default: the config's)")
    p.add_argument("--repeats", type=int, default=10, help="rounds of the fan-out encode timing")
    p.add_argument("--name", default="family", help="the family's name: its artifact's id is PRODUCER:NAME")
    p.add_argument("--out", default="runs/family", help="where the family artifact and figures go")
    p.add_argument("--publish", action="store_true", help=(
        "publish the family to the config's artifact store (every member's fingerprint in its manifest) when "
        "each member's family KL passes calibration.gate_vs_raw_kv and calibration.family_vs_pair; serve it with "
        "a `families:` entry"))
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
    ranks = budget_ranks(spec, hidden, c.payload_budget, c.code_dtype, {"r_k": c.r_k, "r_v": c.r_v, "r_x": c.r_x})
    # common calibration prefixes: an equal share of each member's data; held-out samples: each member's own
    share = -(-n_prefixes // len(names))
    calib, held = [], {}
    for n in names:
        cal_n, _, held[n] = samples.pair_data(n, tok, share, 1, n_held, c.prefix_tokens)
        calib += cal_n
    log(f"members {names}: {len(calib)} common calibration prefixes of {c.prefix_tokens} tokens, {n_held} held-out "
        f"each; {c.reuse_source} codes {ranks} in {c.code_dtype}")

    work = key_dir(Path(c.work_dir).expanduser() / "family", "", {
        "models": [model_digest(producer), *map(model_digest, consumers)], "data": data_digest(calib),
        "hidden": hidden, "batch": c.batch})
    path = work / "grams.safetensors"
    t0 = time.time()
    if path.is_file():
        grams = load_grams(path, spec, hidden)
        log(f"grams resumed from {path}")
    else:
        grams = accumulate(producer, consumers, spec, calib, hidden, c.batch, tok.pad_token_id)
        save_grams(grams, path)
        log(f"grams accumulated in {time.time() - t0:.0f} s ({path})")
    fam, own = artifacts(grams, spec, pairs, ranks, c.ridge, c.code_dtype, family_id)

    rows = []
    for name, consumer, f_art, o_art in zip(names, consumers, fam.members.values(), own):
        got = Evaluator(producer, consumer, tok).run(
            held[name], [methods.RawKV(), methods.SCDMethod(o_art, "pair"), methods.SCDMethod(f_art, "family")],
            desc=f"held-out {name}")
        by = {r["method"]: r for r in got}
        rows.append({"member": name, "raw_kv": by["raw_kv"]["kl"], "pair": by["pair"]["kl"], "family": by["family"]["kl"],
                     "payload_ratio": by["family"]["payload_ratio"], "greedy_pair": by["pair"]["greedy"],
                     "greedy_family": by["family"]["greedy"]})
    ids = torch.tensor([sum((s.prefix.tolist() for s in held[names[0]]), [])[:c.prefix_tokens]])
    cost = fanout_cost(producer, fam, own, ids, args.repeats)

    out = Path(args.out).expanduser() / cfg.producer.name / args.name
    result = {"family": family_id, "members": pairs, "ranks": ranks, "code_dtype": c.code_dtype,
              "prefixes": len(calib), "heldout": n_held, "kl": rows, "fanout": cost}
    fam.info = result
    fam.save(out)
    (out / "figures.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "family.png", f"{cfg.producer.name}: one code for {len(names)} specialists vs one per pair "
                                    f"({c.reuse_source} {ranks}, {c.code_dtype})")

    print(f"\nheld-out KL, Reuse-only codes {ranks} in {c.code_dtype} (payload {rows[0]['payload_ratio']:.3f} of raw KV):")
    print(f"  {'member':<10}{'raw_kv':>9}{'pair':>9}{'family':>9}{'family/pair':>13}{'greedy pair/family':>21}")
    for r in rows:
        print(f"  {r['member']:<10}{r['raw_kv']:9.4f}{r['pair']:9.4f}{r['family']:9.4f}{r['family'] / r['pair']:13.2f}"
              f"{r['greedy_pair']:11.3f} / {r['greedy_family']:.3f}")
    print(f"fan-out to {len(names)} at {cost['tokens']} tokens: wire {cost['family_bytes'] / 1024:.1f} KB (family) vs "
          f"{cost['pairs_bytes'] / 1024:.1f} KB (pairs), {cost['family_bytes'] / cost['pairs_bytes']:.2f}x; producer "
          f"encode {cost['family_encode_ms']:.2f} vs {cost['pairs_encode_ms']:.2f} ms, "
          f"{cost['family_encode_ms'] / cost['pairs_encode_ms']:.2f}x")
    print(f"written: {out}")
    if args.publish:
        result["published"] = publish(args.store or cfg.artifacts.uri, fam, producer, consumers, tok, rows, c,
                                      calib, grams, out)
    return result


def publish(store_uri: str, fam: FamilyArtifacts, producer, consumers: list, tok, rows: list[dict], c,
            calib: list, grams: dict, out: Path) -> str | None:
    """Publish `fam` when every member's held-out family KL is within calibration.gate_vs_raw_kv of raw KV
    reuse's (as a pair's calibration is gated) and within calibration.family_vs_pair of the KL its published
    pair artifact recorded, if it has one (serving then swaps that pair code for the family's in a fan-out);
    returns its ref, or None (refused, and why is printed)."""
    store = ArtifactStore(store_uri)
    failed = [f"{r['member']}: family KL {r['family']:.4f} > {c.gate_vs_raw_kv:g} x raw KV {r['raw_kv']:.4f}"
              for r in rows if c.gate_vs_raw_kv and r["family"] > c.gate_vs_raw_kv * r["raw_kv"]]
    for r, pair in zip(rows, fam.members):             # what a fan-out gets today from each member's pair code
        try:
            r["served_pair"] = store.show(f"{pair}@latest").metrics.get("kl")
        except ArtifactNotFound:
            r["served_pair"] = None
        if c.family_vs_pair and r["served_pair"] is not None and r["family"] > c.family_vs_pair * r["served_pair"]:
            failed.append(f"{r['member']}: family KL {r['family']:.4f} > {c.family_vs_pair:g} x its published pair "
                          f"artifact's {r['served_pair']:.4f}")
    if failed:
        store.refuse(fam.family, {"reasons": failed, "kl": rows})
        log(f"quality gate: NOT published ({'; '.join(failed)})")
        return None
    prints = {pair: Fingerprints.of(producer=producer, consumer=m, tokenizer=tok)
              for pair, m in zip(fam.members, consumers)}
    metrics = {f"{key}.{r['member']}": r[key] for r in rows for key in ("family", "pair", "raw_kv", "served_pair")
               if r[key] is not None}
    metrics.update(payload_ratio=rows[0]["payload_ratio"], **{k: float(v) for k, v in fam.info["fanout"].items()})
    rows_fitted = next(g for gs in grams.values() for g in gs if g is not None).n
    manifest = store.publish_family(
        fam, prints, CalibrationData(digest=data_digest(calib), n_prefixes=len(calib), rows=rows_fitted),
        metrics, {f"report/{name}": (out / name).read_bytes() for name in ("figures.json", "family.png")})
    ref = f"{fam.family}@{manifest.version}"
    log(f"published {ref} to {store_uri}; serve it with `families: [{{name: {fam.family.split(':')[1]}}}]`")
    return ref


if __name__ == "__main__":
    main()
    sys.exit(0)
