"""The family job's fits (scd.fitting.family): the family's Reuse codes and each member's own pair codes from
the Gram matrices (`artifacts`), the ranks a payload budget allows (`budget_ranks`), and the family as served,
each member's Patch aligners and fine-tuning over the shared codes (`fit_members`), checkpointed under the
family's work folder."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from scd.fitting import family
from scd.fitting.aligners import patch_aligner
from scd.fitting.checkpoints import (ALIGNER_FIELDS, TUNE_FIELDS, key_dir, keyed, load_record, samples_digest,
                                     save_record)
from scd.fitting.finetune import Progress, finetune_scored
from scd.fitting.scoring import KEEP_RULE
from scd.online import codec
from scd.online.artifacts import PairArtifacts, code_groups, layer_groups
from scd.online.family_artifacts import FamilyArtifacts
from scd.online.models import ModelSpec, weights_digest
from scd.online.reuse import LinearCodec

Log = Callable[[str], None]


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


def given_ranks(c) -> dict[str, int]:
    """The ranks the calibration settings give (budget_ranks' `given`)."""
    return {"r_k": c.r_k, "r_v": c.r_v, "r_x": c.r_x, "x_group": c.x_group, "r_h": c.r_h}


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
                tune: dict, log: Log) -> FamilyArtifacts:
    """The family as served: each member Patches its layers of `plans` (one encoder per layer for the
    family, fitted on the x_norm of the members that Patch it; each member's own aligner, on its own
    prefixes) over the shared Reuse codes, then, with calibration.finetune_samples, each member's decoders
    and aligners are fine-tuned end to end on its own samples with the encoders frozen (so they stay the
    family's). Encoders, aligners and fine-tuned members are checkpointed under `work`."""
    spec = shared.encoder.spec
    c = c.for_hidden(spec.hidden_size)
    cfg = c.model_dump()
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
                            pad_id, log)
        members[pair] = art
    return FamilyArtifacts(shared.family, members)


def load_encoders(path: Path, plans: list[list[int]]) -> list[dict[int, LinearCodec]] | None:
    """The family's Patch encoders (one codec per member and layer it Patches) from their checkpoint, or None."""
    if not path.is_file():
        return None
    t = load_file(str(path))
    return [{l: LinearCodec.from_tensors(t, f"{j}.{l}") for l in p} for j, p in enumerate(plans)]


def finetuned(d: Path, art: PairArtifacts, name: str, producer, consumer, tune: list, val: list, c,
              pad_id: int | None, log: Log) -> PairArtifacts:
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
