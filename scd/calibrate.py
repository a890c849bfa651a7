"""Offline calibration of one producer->consumer pair: traces -> Reuse -> layer policy -> Patch.

Each stage is a function so a job can checkpoint between them:
  collect_traces   paired traces of calibration prefixes, streamed to disk in chunks
  fit_linear       Reuse codecs (K, V) for every layer, and Patch encoders (x_norm) for every layer >= 1
  PlanScorer       KL of a candidate plan on validation samples (for the policy and its curves)
  train_aligners   MLP aligners for the candidate patch layers
  calibrate        all of the above -> PairArtifacts
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from scd import cache, metrics, policy
from scd.artifacts import PairArtifacts
from scd.models import ModelSpec
from scd.patch import Aligner, train_aligner
from scd.rebuild import encode, rebuild
from scd.reuse import JointGram, LinearCodec
from scd.trace import TraceWriter, capture, read_chunks


@dataclass
class CalibConfig:
    r_k: int = 8
    r_v: int = 16
    r_h: int = 32
    ridge: float = 1e-4
    aligner_width: int = 256
    aligner_epochs: int = 60
    pool: int = 4
    patch_cost: float = 0.25          # one Patch layer's consumer work relative to the whole Reuse rebuild
    batch: int = 8
    seed: int = 0

    def __post_init__(self):
        for k in ("r_k", "r_v", "r_h", "pool", "batch", "aligner_width", "aligner_epochs"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")


def pad_left(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, t - len(s):], mask[i, t - len(s):] = s, 1
    return ids, mask


def collect_traces(producer, consumer, prefixes: list[torch.Tensor], out_dir: str | Path, batch: int,
                   pad_id: int = 0, progress: bool = True) -> int:
    """Run both models on identical token batches; write paired chunks. Returns the number of rows."""
    w, rows = TraceWriter(out_dir), 0
    for i in tqdm(range(0, len(prefixes), batch), desc="traces", disable=not progress):
        ids, mask = pad_left(prefixes[i:i + batch], pad_id)
        w.write(capture(producer, ids, mask), capture(consumer, ids, mask))
        rows += int(mask.sum())
    return rows


def fit_linear(trace_dir: str | Path, spec: ModelSpec, cfg: CalibConfig):
    """Reuse codecs for K (content) and V at every layer; Patch encoders on x_norm at layers >= 1."""
    L, d, hid = spec.num_layers, spec.head_dim, spec.hidden_size
    gk = [JointGram(d, d) for _ in range(L)]
    gv = [JointGram(d, d) for _ in range(L)]
    gx = [JointGram(hid, hid) for _ in range(L)]
    for chunk in read_chunks(trace_dir):
        for l in range(L):
            gk[l].update(chunk[f"ka.{l}"], chunk[f"kb.{l}"])
            gv[l].update(chunk[f"va.{l}"], chunk[f"vb.{l}"])
            if l:
                gx[l].update(chunk[f"xa.{l}"], chunk[f"xb.{l}"])
    reuse_k = {l: gk[l].fit(cfg.r_k, cfg.ridge) for l in range(L)}
    reuse_v = {l: gv[l].fit(cfg.r_v, cfg.ridge) for l in range(L)}
    patch_enc = {l: gx[l].fit(cfg.r_h, cfg.ridge) for l in range(1, L)}
    spectra = {"k": [gk[l].spectrum()[:d].tolist() for l in range(L)],
               "v": [gv[l].spectrum()[:d].tolist() for l in range(L)]}
    return reuse_k, reuse_v, patch_enc, spectra


def train_aligners(trace_dir: str | Path, layers: list[int], patch_enc: dict[int, LinearCodec],
                   cfg: CalibConfig, progress: bool = True) -> tuple[dict[int, Aligner], dict[int, dict]]:
    """One aligner per layer on (Z_H, x_norm_B) rows from the traces; returns aligners and their loss curves."""
    aligners, curves = {}, {}
    for l in tqdm(layers, desc="aligners", disable=not progress):
        xa, xb = zip(*((c[f"xa.{l}"], c[f"xb.{l}"]) for c in read_chunks(trace_dir)))
        enc = patch_enc[l]
        with torch.no_grad():
            z = enc.encode(torch.cat(xa))
        fit = train_aligner(z, torch.cat(xb), enc.dec, enc.mu_b, width=cfg.aligner_width,
                            epochs=cfg.aligner_epochs, seed=cfg.seed + l)
        aligners[l] = fit.aligner.eval()
        curves[l] = {"train": fit.train_loss, "val": fit.val_loss, "best_epoch": fit.best_epoch}
    return aligners, curves


class PlanScorer:
    """Mean KL(oracle || rebuilt) over validation samples for a plan, with oracle traces computed once."""

    def __init__(self, producer, consumer, samples, art_for: Callable[[list[str]], PairArtifacts]):
        self.consumer, self.art_for = consumer, art_for
        self.items = []
        for s in samples:
            ids = s.prefix[None]
            mask = torch.ones_like(ids)
            o = capture(consumer, ids, mask, want_xnorm=False)
            ref, _ = cache.extend(consumer, cache.assemble(consumer, list(zip(o.keys, o.values))), mask, s.cont[None])
            self.items.append((ids, mask, capture(producer, ids, mask), list(zip(o.keys, o.values)), s.cont[None], ref))

    @torch.no_grad()
    def kl(self, plan: list[str], restore: int | None = None) -> float:
        art = self.art_for(plan)
        total = 0.0
        for ids, mask, ptrace, oracle_kv, cont, ref in self.items:
            kv, _ = rebuild(self.consumer, art, encode(art, ptrace, ids))
            if restore is not None:
                kv[restore] = oracle_kv[restore]
            logits, _ = cache.extend(self.consumer, cache.assemble(self.consumer, kv), mask, cont)
            total += metrics.kl_tv_top1(ref, logits)[0]
        return total / len(self.items)


def calibrate(producer, consumer, spec: ModelSpec, pair: str, prefixes: list[torch.Tensor], val_samples,
              work_dir: str | Path, cfg: CalibConfig = CalibConfig(), pad_id: int = 0, progress: bool = True,
              exact_layer0: bool = True) -> PairArtifacts:
    """The whole offline pipeline in one process. Returns artifacts whose plan is the policy's choice."""
    torch.manual_seed(cfg.seed)
    trace_dir = Path(work_dir) / "traces"
    rows = collect_traces(producer, consumer, prefixes, trace_dir, cfg.batch, pad_id, progress)
    reuse_k, reuse_v, patch_enc, spectra = fit_linear(trace_dir, spec, cfg)
    aligners: dict[int, Aligner] = {}
    curves: dict[int, dict] = {}
    first = ["exact"] if exact_layer0 else ["reuse"]
    base_plan = first + ["reuse"] * (spec.num_layers - 1)

    def art_for(plan):
        return PairArtifacts(pair, spec, cfg.r_k, cfg.r_v, cfg.r_h, cfg.aligner_width, plan, reuse_k, reuse_v,
                             {l: patch_enc[l] for l in aligners}, aligners)

    def plan_with(layers):
        return [("patch" if l in layers else k) for l, k in enumerate(base_plan)]

    def train_pool(pool):
        a, c = train_aligners(trace_dir, pool, patch_enc, cfg, progress)
        aligners.update(a)
        curves.update(c)

    scorer = PlanScorer(producer, consumer, val_samples, art_for)
    base_kl = scorer.kl(base_plan)
    layers = list(range(1, spec.num_layers))
    res = policy.plan_layers(layers, lambda l: scorer.kl(base_plan, restore=l), lambda ls: scorer.kl(plan_with(ls)),
                             base_kl, min(cfg.pool, len(layers)), cfg.patch_cost, train_pool)
    final = art_for(plan_with(res.chosen))
    final.aligners = {l: aligners[l] for l in res.chosen}
    final.patch_enc = {l: patch_enc[l] for l in res.chosen}
    final.info = {"calibration": {"prefixes": len(prefixes), "rows": rows, "config": asdict(cfg)},
                  "policy": {"base_kl": res.base_kl, "sensitivity": res.sensitivity, "pool": res.pool,
                             "order": res.order, "curve": res.curve, "k_star": res.k_star,
                             "efficiency": res.efficiency},
                  "aligner_curves": curves, "spectra": spectra}
    return final
