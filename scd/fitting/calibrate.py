"""Offline calibration of one producer->consumer pair, as resumable stages in a work directory.

  traces    paired traces of the calibration prefixes, one safetensors chunk per batch (atomic writes)
  grams     joint Gram matrices of every layer's K, V, x_norm; Reuse codecs and Patch encoders at any
            rank follow in closed form (linear), so rank sweeps need no second pass over the traces
  policy    restore-one sensitivity -> pool -> aligners trained for the pool -> greedy -> k*
  artifacts the PairArtifacts under the chosen plan, fine-tuned end to end
  level     the lowest-KL of its nested code levels on validation: the artifact is served at that level
            (plan-<plan key>/level.json, keyed on its tensors)
Every stage checkpoints its result (safetensors + JSON, never pickle) and, when called again, loads the
checkpoint instead of recomputing: a killed calibration resumes where it stopped. Each stage's folder is keyed
by exactly what it depends on, so a changed setting redoes only the stages after it:

  <work>/<pair>/<traces key>/                 traces, Gram matrices: the models' weights, the calibration
                                              prefixes, the architecture, the batch
               aligners/<aligner key>/        Patch aligners: + r_h, ridge, the aligner_* settings, seed
               plan-<plan key>/               ranks, policy: + every setting but the finetune_* ones
                        tune-<tune key>/      fine-tuning and what the calibration job writes (Calibration.dir)
Records that depend on samples (validation, fine-tuning) carry those samples' digest and are recomputed when
it differs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from scd.fitting import policy, scoring
from scd.fitting.aligners import patch_aligner
from scd.fitting.checkpoints import (ALIGNER_FIELDS, CHECKPOINT_FORMAT, TRACE_FIELDS, TUNE_FIELDS, key_dir, keyed,
                                     load_record, samples_digest, save_record)
from scd.fitting.gram import JointGram, TokenStats
from scd.fitting.scoring import KEEP_RULE, PlanScorer, cheapest_within_noise
from scd.fitting.finetune import Progress, finetune_scored
from scd.fitting.traces import chunk_path, pad, read_chunks, trace_rows, valid_rows, write_chunk
from scd.online import codec
from scd.online.artifacts import PairArtifacts, code_groups, layer_groups, level_tag
from scd.online.models import ModelSpec, data_digest, model_digest, weights_digest
from scd.online.patch import Aligner
from scd.online.reuse import LinearCodec, bigram_keys
from scd.online.trace import capture
from scd.settings import CalibConfig

# capture_pair(ids, mask) -> (producer rows, consumer rows) as named by scd.online.trace.trace_rows
CapturePair = Callable[[torch.Tensor, torch.Tensor], tuple[dict, dict]]

LEVEL_RULE = "lowest validation KL"        # the level stage's rule (in its checkpoints' and publications' keys)


class Calibration:
    def __init__(self, producer, consumer, spec: ModelSpec, pair: str, prefixes: list[torch.Tensor],
                 work_root: str | Path, cfg: CalibConfig = CalibConfig(), pad_id: int | None = 0, progress: bool = True,
                 log: Callable[[str], None] = print, exact_layer0: bool = True):
        cfg = cfg.for_hidden(spec.hidden_size)
        self.producer, self.consumer, self.spec, self.pair, self.cfg = producer, consumer, spec, pair, cfg
        self.prefixes, self.pad_id, self.progress, self.log = prefixes, pad_id, progress, log
        config = cfg.model_dump()
        models = [model_digest(producer), model_digest(consumer)]
        self.trace_dir = key_dir(Path(work_root) / pair.replace(":", "__"), "", {
            "format": CHECKPOINT_FORMAT, "pair": pair, "models": models, "data": data_digest(prefixes),
            "spec": spec.fingerprint(), **{k: config[k] for k in TRACE_FIELDS}})
        self.aligner_dir = key_dir(self.trace_dir / "aligners", "", keyed(config, ALIGNER_FIELDS))
        self.plan_dir = key_dir(self.trace_dir, "plan-", {
            "exact_layer0": exact_layer0, **keyed(config, [k for k in config if k not in TRACE_FIELDS + TUNE_FIELDS])})
        self.dir = key_dir(self.plan_dir, "tune-", {k: config[k] for k in TUNE_FIELDS})
        kind = "hidden" if cfg.reuse_source == "hidden" else "reuse"
        self.base_plan = ["exact" if exact_layer0 else kind] + [kind] * (spec.num_layers - 1)
        self._grams = None
        self._hidden_grams: list[JointGram | None] | None = None
        self._token_stats: list[TokenStats | None] = []
        self._bigram_stats: list[TokenStats | None] = []
        self._ranks: dict[str, int] = {}                    # chosen by ranks(), else the config's
        self._wire = 1.0                    # bytes sent per code byte, measured by ranks() (codec's lossless stage)
        self._linear: dict[tuple, object] = {}       # (r_k, r_v) -> per-head codecs; ("hidden", r_x) -> hidden
        self._patch_enc: dict[int, LinearCodec] = {}
        self._aligners_logged: set[int] = set()

    # -- stage 1 -------------------------------------------------------------------------------------
    def traces(self, capture_pair: CapturePair | None = None) -> int:
        """Write one chunk per batch of prefixes; batches already on disk are skipped. Returns total rows."""
        done_file = self.trace_dir / "traces.json"
        if done_file.is_file():
            rows = json.loads(done_file.read_text())["rows"]
            self.log(f"stage traces: resumed from checkpoint ({rows} rows)")
            return rows
        capture_pair = capture_pair or self._capture_local
        tdir = self.trace_dir / "traces"
        batches = range(0, len(self.prefixes), self.cfg.batch)
        have = sum(chunk_path(tdir, i).is_file() for i in range(len(batches)))
        if have:
            self.log(f"stage traces: {have}/{len(batches)} chunks already on disk, resuming")
        for i, start in enumerate(tqdm(batches, desc="traces", disable=not self.progress)):
            if chunk_path(tdir, i).is_file():
                continue
            ids, mask = pad(self.prefixes[start:start + self.cfg.batch], self.pad_id)
            a, b = capture_pair(ids, mask)
            write_chunk(tdir, i, {**a, **b})
        rows = sum(len(p) for p in self.prefixes)
        done_file.write_text(json.dumps({"rows": rows, "chunks": len(batches)}))
        self.log(f"stage traces: done ({rows} rows in {len(batches)} chunks)")
        return rows

    def _capture_local(self, ids, mask):
        return trace_rows(capture(self.producer, ids, mask), "a"), trace_rows(capture(self.consumer, ids, mask), "b")

    # -- stage 2 -------------------------------------------------------------------------------------
    def grams(self) -> tuple[list[JointGram], list[JointGram], list[JointGram | None]]:
        """Joint Gram matrices of every layer's paired K, V and x_norm rows (one pass over the chunks)."""
        if self._grams is not None:
            return self._grams
        path = self.trace_dir / "grams.safetensors"
        L, d, hid = self.spec.num_layers, self.spec.head_dim, self.spec.hidden_size
        if path.is_file():
            t = load_file(str(path))
            gk = [JointGram.from_tensors(t, f"k.{l}", d) for l in range(L)]
            gv = [JointGram.from_tensors(t, f"v.{l}", d) for l in range(L)]
            gx = [None] + [JointGram.from_tensors(t, f"x.{l}", hid) for l in range(1, L)]
            self.log("stage linear: resumed from checkpoint")
        else:
            gk, gv = [JointGram(d, d) for _ in range(L)], [JointGram(d, d) for _ in range(L)]
            gx = [None] + [JointGram(hid, hid) for _ in range(1, L)]
            for chunk in tqdm(read_chunks(self.trace_dir / "traces"), desc="gram", disable=not self.progress):
                for l in range(L):
                    gk[l].update(chunk[f"ka.{l}"], chunk[f"kb.{l}"])
                    gv[l].update(chunk[f"va.{l}"], chunk[f"vb.{l}"])
                    if l:
                        gx[l].update(chunk[f"xa.{l}"], chunk[f"xb.{l}"])
            t = {}
            for l in range(L):
                t.update(gk[l].tensors(f"k.{l}"))
                t.update(gv[l].tensors(f"v.{l}"))
                if l:
                    t.update(gx[l].tensors(f"x.{l}"))
            save_file(t, str(path))
            self.log(f"stage linear: accumulated joint Gram matrices of {L} layers")
        self._grams = (gk, gv, gx)
        return self._grams

    @property
    def x_groups(self) -> list[list[int]]:
        """The layers sharing each hidden-state code (cfg.x_group adjacent layers of 1..L-1); [] for a code per
        layer."""
        return layer_groups(self.spec.num_layers, self.cfg.x_group)

    def hidden_grams(self) -> list[JointGram | None]:
        """Per hidden-state code (at each layer >= 1, or at the first layer of each of x_groups), the joint Gram
        of the producer's x_norm of its layers side by side with the consumer's K and V of every head of them,
        [x_A | K_B V_B] (one pass over the chunks, checkpointed): hidden-state Reuse fits from it. With
        `token_table`, the same pass sums the rows per token (token_stats), and with `bigram_table` per
        (previous token, token) key."""
        if self._hidden_grams is not None:
            return self._hidden_grams
        groups = code_groups(self.spec.num_layers, self.cfg.x_group)
        name = "grams_hidden" if not self.x_groups else f"grams_hidden_groups_{'_'.join(str(len(g)) for g in groups)}"
        bigrams = self.cfg.bigram_table                # CalibConfig holds it to a token table
        path = self.trace_dir / (name + (f"_tokens{self.cfg.token_table}" if self.cfg.token_table else "")
                                 + (f"_bigrams{bigrams}" if bigrams else "") + ".safetensors")
        hid, m = self.spec.hidden_size, self.spec.num_kv_heads * self.spec.head_dim
        grams: list[JointGram | None] = [None] * self.spec.num_layers
        stats: list[TokenStats | None] = [None] * self.spec.num_layers
        pairs: list[TokenStats | None] = [None] * self.spec.num_layers
        if path.is_file():
            t = load_file(str(path))
            for g in groups:
                grams[g[0]] = JointGram.from_tensors(t, f"x.{g[0]}", len(g) * hid)
                if self.cfg.token_table:
                    stats[g[0]] = TokenStats.from_tensors(t, f"tokens.{g[0]}")
                if bigrams:
                    pairs[g[0]] = TokenStats.from_tensors(t, f"bigrams.{g[0]}")
            self.log("stage hidden: resumed from checkpoint")
        else:
            for g in groups:
                grams[g[0]] = JointGram(len(g) * hid, len(g) * 2 * m)
                if self.cfg.token_table:
                    stats[g[0]] = TokenStats.most_frequent(self.prefixes, self.cfg.token_table, len(g) * hid,
                                                           len(g) * 2 * m)
                if bigrams:
                    pairs[g[0]] = TokenStats.most_frequent([bigram_keys(torch.as_tensor(p)) for p in self.prefixes],
                                                           bigrams, len(g) * hid, len(g) * 2 * m)
            batches = range(0, len(self.prefixes), self.cfg.batch)      # chunk i holds batch i's valid rows
            for start, chunk in tqdm(zip(batches, read_chunks(self.trace_dir / "traces")), total=len(batches),
                                     desc="gram hidden", disable=not self.progress):
                ids, mask = pad(self.prefixes[start:start + self.cfg.batch], self.pad_id)
                tokens = valid_rows(ids, mask)
                keys = valid_rows(bigram_keys(ids, mask), mask) if bigrams else None
                for g in groups:
                    a = torch.cat([chunk[f"xa.{l}"] for l in g], 1)
                    b = torch.cat([torch.cat([chunk[f"kb.{l}"].flatten(1), chunk[f"vb.{l}"].flatten(1)], 1) for l in g], 1)
                    if len(tokens) != len(a):
                        raise RuntimeError(f"trace chunk of {len(a)} rows for a batch of {len(tokens)} tokens: "
                                           f"the traces under {self.trace_dir} are not of these prefixes")
                    grams[g[0]].update(a, b)
                    if stats[g[0]] is not None:
                        stats[g[0]].update(tokens, a, b)
                    if pairs[g[0]] is not None:
                        pairs[g[0]].update(keys, a, b)
            t = {}
            for g in groups:
                t.update(grams[g[0]].tensors(f"x.{g[0]}"))
                if stats[g[0]] is not None:
                    t.update(stats[g[0]].tensors(f"tokens.{g[0]}"))
                if pairs[g[0]] is not None:
                    t.update(pairs[g[0]].tensors(f"bigrams.{g[0]}"))
            save_file(t, str(path))
            self.log(f"stage hidden: accumulated x_norm -> K,V Gram matrices of {len(groups)} codes"
                     + (f", with per-token sums for a table of {self.cfg.token_table} tokens" if self.cfg.token_table else "")
                     + (f" and per-pair sums for {bigrams} token pairs" if bigrams else ""))
        self._hidden_grams, self._token_stats, self._bigram_stats = grams, stats, pairs
        return grams

    def hidden(self, r_x: int | None = None) -> dict[int, LinearCodec]:
        """Hidden-state Reuse codecs (reduced-rank regression x_norm_A -> [K_B; V_B]) at layers >= 1, or one
        per group of x_groups, kept under its first layer."""
        r_x = r_x or self.r_x
        if ("hidden", r_x) not in self._linear:    # a group narrower than r_x: its full rank, zero-padded
            grams = self.hidden_grams()
            self._linear[("hidden", r_x)] = {
                l: g.fit_regression(min(r_x, g.d_b), self.cfg.ridge, self._token_stats[l], self.cfg.token_shrink,
                                    self._bigram_stats[l], self.cfg.bigram_shrink).padded(r_x)
                for l, g in enumerate(grams) if g is not None}
        return self._linear[("hidden", r_x)]

    def linear(self, r_k: int | None = None, r_v: int | None = None):
        """Reuse codecs for K (content) and V at every layer (ranks default to the config's) and Patch
        encoders on x_norm at layers >= 1. Closed form from the Gram matrices: cheap, not checkpointed."""
        r_k, r_v = r_k or self.r_k, r_v or self.r_v
        if (r_k, r_v) not in self._linear:
            gk, gv, gx = self.grams()
            self._linear[(r_k, r_v)] = ({l: g.fit(r_k, self.cfg.ridge) for l, g in enumerate(gk)},
                                        {l: g.fit(r_v, self.cfg.ridge) for l, g in enumerate(gv)},
                                        self._patch_enc or {l: g.fit(self.cfg.r_h, self.cfg.ridge)
                                                            for l, g in enumerate(gx) if g is not None})
            self._patch_enc = self._linear[(r_k, r_v)][2]
        return self._linear[(r_k, r_v)]

    @property
    def r_k(self) -> int:
        return self._ranks.get("r_k", self.cfg.r_k)

    @property
    def r_v(self) -> int:
        return self._ranks.get("r_v", self.cfg.r_v)

    @property
    def r_x(self) -> int:
        return self._ranks.get("r_x", self.cfg.r_x)

    def chosen_ranks(self) -> dict[str, dict[str, int]]:
        """{"ranks": the ranks stage's choice} for the inputs of the stages after it (its choice may change
        while their folder stays: e.g. when the wire's compression lets the budget buy more rank); {} without
        a payload budget, where the ranks are the config's and key the folder."""
        return {"ranks": dict(self._ranks)} if self._ranks else {}

    def payload_ratio(self, ranks: dict[str, int]) -> float:
        """Codes of the Reuse-only plan (at cfg.code_dtype, as sent: times the wire's measured compression once
        ranks() has run) over the raw KV (bf16), per token. `ranks`: r_k and r_v, or r_x."""
        row = lambda r: codec.code_bytes_per_row(r, self.cfg.code_dtype) if r else 0  # noqa: E731
        per_layer = {"reuse": self.spec.num_kv_heads * (row(ranks.get("r_k", 0)) + row(ranks.get("r_v", 0))),
                     "hidden": 0 if self.x_groups else row(ranks.get("r_x", 0))}
        grouped = len(self.x_groups) * row(ranks.get("r_x", 0))          # one code per group
        return self._wire * (sum(per_layer.get(k, 0) for k in self.base_plan) + grouped) / self.spec.kv_bytes_per_token

    def plan_payload(self, plan: list[str]) -> float:
        """A plan's codes per token (at the chosen ranks, without token ids and mask, as sent) over the raw KV."""
        return self._wire * (codec.code_bytes(self.artifacts_for(plan), 1) - 5) / self.spec.kv_bytes_per_token

    def wire_factor(self, samples, ranks: dict[str, int]) -> float:
        """The wire's bytes per code byte (scoring.wire_factor) at `ranks`, on the codes of `samples`' prefixes
        (closed-form Reuse-only artifact)."""
        return scoring.wire_factor(self.producer, self.artifacts_for(self.base_plan, **ranks), [s.prefix for s in samples])

    def fits_budget(self, patched: list[int]) -> bool:
        """Whether Patching these layers keeps the payload within cfg.payload_budget (always, without one).
        A Patch code replaces a per-layer Reuse code but adds to a code shared by a group of layers."""
        return not self.cfg.payload_budget or self.plan_payload(self.plan_with(patched)) <= self.cfg.payload_budget + 1e-9

    def rank_candidates(self) -> list[dict[str, int]]:
        """Ranks on the budget's frontier, from a geometric grid. Per-head Reuse: for each r_k up to the head
        dim, the largest r_v that keeps the payload within cfg.payload_budget. Hidden-state Reuse: the three
        largest r_x within it (up to the K and V width of a code's layers)."""
        fits = lambda r: self.payload_ratio(r) <= self.cfg.payload_budget + 1e-9  # noqa: E731
        if self.cfg.reuse_source == "hidden":
            top = 2 * self.spec.num_kv_heads * self.spec.head_dim * max(map(len, self.x_groups or [[1]]))
            grid = sorted({r for r in (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 288, 320, 384, 512, 640, 768, 896,
                                       1024, 1152, 1280, 1536, 2048) if r <= top} | {top})
            return [{"r_x": r} for r in grid if fits({"r_x": r})][-3:]
        d = self.spec.head_dim
        grid = sorted({r for r in (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if r <= d} | {d})
        out = []
        for r_k in grid:
            ok = [r_v for r_v in grid if fits({"r_k": r_k, "r_v": r_v})]
            if ok:
                out.append({"r_k": r_k, "r_v": ok[-1]})
        return out

    def ranks(self, val_samples) -> dict:
        """Stage 2b (only with cfg.payload_budget > 0): Reuse-only validation KL of every candidate on the
        budget's frontier; the cheapest one whose KL the lowest does not beat (scoring.beats) is used from here
        on. Checkpointed; returns its record."""
        path, inputs = self.plan_dir / "ranks.json", {"val": samples_digest(val_samples), "choose": KEEP_RULE}
        if codec.default_compress(self.cfg.code_dtype) != "none":                 # counted as sent
            inputs["wire"] = f"{codec.default_compress(self.cfg.code_dtype)}-{codec.ZSTD_LEVEL}"
        record = load_record(path, inputs, self.log)
        if record is not None:
            self._wire = record.get("wire_factor", 1.0)
            self.log(f"stage ranks: resumed from checkpoint ({record['chosen']})")
        else:
            cands = self.rank_candidates()          # in code bytes: the wire sends at most that many
            if not cands:
                raise ValueError(f"payload_budget {self.cfg.payload_budget} is below the smallest code of this "
                                 f"model ({self.cfg.reuse_source} Reuse)")
            self._wire = self.wire_factor(val_samples, cands[-1])
            cands = self.rank_candidates()          # as sent: the budget may buy more rank
            scorer = PlanScorer(self.producer, self.consumer, val_samples, self.artifacts_for)
            tried = []
            for ranks in tqdm(cands, desc="ranks", disable=not self.progress):
                scorer.art_for = lambda plan, r=ranks: self.artifacts_for(plan, **r)
                kls = scorer.kls(self.base_plan)
                tried.append({**ranks, "payload_ratio": self.payload_ratio(ranks), "kl": sum(kls) / len(kls), "kls": kls})
            # the smallest code that the best one does not beat beyond the validation samples' noise: a wider
            # code costs bytes on the wire and FLOPs in the consumer's rebuild, and has to earn them
            best, pick = min(tried, key=lambda t: t["kl"]), cheapest_within_noise(tried)
            chosen = {k: pick[k] for k in cands[0]}
            record = save_record(path, {"budget": self.cfg.payload_budget, "source": self.cfg.reuse_source,
                                        "wire_factor": self._wire, "tried": tried, "best": {k: best[k] for k in chosen},
                                        "chosen": chosen}, inputs)
            noise = "" if pick is best else (f"; the lowest, {best['kl']:.4f} at {best['payload_ratio']:.3f}, is no "
                                             f"gain beyond the noise ({KEEP_RULE})")
            self.log(f"stage ranks: {chosen} (reuse-only KL {pick['kl']:.4f} at payload {pick['payload_ratio']:.3f} as "
                     f"sent, the wire sending {self._wire:.3f} of the code bytes{noise}; {len(tried)} candidates "
                     f"within {self.cfg.payload_budget})")
        self._ranks = dict(record["chosen"])
        return record

    # -- stage 3 -------------------------------------------------------------------------------------
    def aligner(self, layer: int) -> tuple[Aligner, dict]:
        """Train (or load) the Patch aligner of one layer on the traced (Z_H, x_norm_B) rows."""
        def rows(n: int):           # the trace chunks in order until they hold n whole sequences (all for 0)
            got, seqs = [], 0
            for c in read_chunks(self.trace_dir / "traces"):
                got.append((c[f"xa.{layer}"], c[f"xb.{layer}"], c["posa"], c["xb.0"]))
                seqs += int((c["posa"] == 0).sum())
                if n and seqs >= n:
                    break
            return tuple(torch.cat(t) for t in zip(*got))

        g, curve, trained = patch_aligner(self.aligner_dir / f"layer_{layer}.safetensors", self.cfg,
                                          self.spec.hidden_size, self.linear()[2][layer], self.consumer, layer, rows)
        if trained:
            self.log(f"stage policy: aligner for layer {layer} trained (best val {min(curve['val']):.4f} "
                     f"at epoch {curve['best_epoch']})")
        elif layer not in self._aligners_logged:      # once a layer, and not when it was trained in this run
            self.log(f"stage policy: aligner for layer {layer} resumed from checkpoint")
        self._aligners_logged.add(layer)
        return g, curve

    def artifacts_for(self, plan: list[str], r_k: int | None = None, r_v: int | None = None,
                      r_x: int | None = None) -> PairArtifacts:
        """The artifact of a plan at the given (else chosen, else configured) ranks. It holds the Reuse codecs
        of every layer of its reuse source, so that its Reuse-only form (methods.reuse_only) is complete."""
        reuse_k, reuse_v, patch_enc = self.linear(r_k, r_v)
        reuse_x = {}
        if self.cfg.reuse_source == "hidden":
            reuse_k, reuse_v, reuse_x = {}, {}, self.hidden(r_x)
        patched = [l for l, k in enumerate(plan) if k == "patch"]
        aligners = {l: self.aligner(l)[0] for l in patched}
        return PairArtifacts(self.pair, self.spec, r_k or self.r_k, r_v or self.r_v, self.cfg.r_h,
                             self.cfg.aligner_width, list(plan), reuse_k, reuse_v, {l: patch_enc[l] for l in patched},
                             aligners, aligner_context=self.cfg.aligner_context,
                             aligner_tokens=self.cfg.aligner_tokens, aligner_window=self.cfg.aligner_window,
                             r_x=(r_x or self.r_x) if reuse_x else 0, reuse_x=reuse_x, code_dtype=self.cfg.code_dtype,
                             x_groups=self.x_groups if reuse_x else [])

    def plan_with(self, layers) -> list[str]:
        return [("patch" if l in layers else k) for l, k in enumerate(self.base_plan)]

    def policy(self, val_samples) -> dict:
        """Run the layer policy on validation samples (or load its checkpoint). Returns its JSON record."""
        path, inputs = self.plan_dir / "policy.json", {"val": samples_digest(val_samples), **self.chosen_ranks()}
        record = load_record(path, inputs, self.log)
        if record is not None and not self.fits_budget(record["chosen"]):    # chosen before Patch codes counted
            self.log("stage policy: the checkpoint's plan exceeds the payload budget; recomputing")
            for stale in self.plan_dir.glob("tune-*/finetuned/record.json"):     # fine-tuned for that plan
                stale.unlink()
        elif record is not None:
            self.log("stage policy: resumed from checkpoint")
            return record
        scorer = PlanScorer(self.producer, self.consumer, val_samples, self.artifacts_for)
        base_kl = scorer.kl(self.base_plan)
        layers = list(range(1, self.spec.num_layers))
        res = policy.plan_layers(layers, lambda l: scorer.kl(self.base_plan, restore=l),
                                 lambda ls: scorer.kl(self.plan_with(ls)), base_kl, min(self.cfg.pool, len(layers)),
                                 self.cfg.patch_cost, train_pool=lambda pool: [self.aligner(l) for l in pool],
                                 fits=self.fits_budget, progress=self.progress)
        record = {"base_kl": res.base_kl, "sensitivity": {str(k): v for k, v in res.sensitivity.items()},
                  "pool": res.pool, "order": res.order, "curve": res.curve, "k_star": res.k_star,
                  "efficiency": res.efficiency, "chosen": res.chosen,
                  "aligner_curves": {str(l): self.aligner(l)[1] for l in res.pool}}
        save_record(path, record, inputs)
        self.log(f"stage policy: patch layers {res.chosen} (k*={res.k_star}); KL reuse-only {base_kl:.4f} -> "
                 f"{res.curve[res.k_star]:.4f}")
        return record

    # -- stage 4 (optional) ----------------------------------------------------------------------------
    def finetune(self, art: PairArtifacts, tune_samples, val_samples) -> dict:
        """End-to-end fine-tuning of the chosen plan's aligners (scd.fitting.finetune), or its checkpoint. Returns its
        record; art's aligners are replaced by the fine-tuned ones."""
        d = self.dir / "finetuned"
        inputs = {"tune": samples_digest(tune_samples), "val": samples_digest(val_samples), "keep": KEEP_RULE,
                  **self.chosen_ranks()}
        done = load_record(d / "record.json", inputs, self.log)
        if done is not None and done.get("plan", art.plan) != art.plan:      # (an older record names no plan)
            self.log("stage finetune: the checkpoint was fine-tuned for another plan; recomputing")
            done = None
        if done is not None:
            for l in art.patch_layers:
                art.aligners[l].load_state_dict(load_file(str(d / f"layer_{l}.safetensors")))
            if (d / "hidden.safetensors").is_file():
                t = load_file(str(d / "hidden.safetensors"))
                art.reuse_x = {l: LinearCodec.from_tensors(t, f"hidden.{l}") for l in art.reuse_x}
            art.derived.clear()
            self.log("stage finetune: resumed from checkpoint")
            return done
        d.mkdir(exist_ok=True)
        resume = Progress(d / "progress.safetensors", {**inputs, "plan": art.plan})     # the epochs done so far
        fit = finetune_scored(self.producer, self.consumer, art, tune_samples, val_samples, self.cfg, self.pad_id,
                              self.progress, lambda line: self.log(f"stage {line}"), encoders=self.cfg.finetune_encoders,
                              resume=resume)
        for l in art.patch_layers:
            save_file({k: v.contiguous() for k, v in art.aligners[l].state_dict().items()}, str(d / f"layer_{l}.safetensors"))
        if art.reuse_x:
            save_file({k: v for l, c in art.reuse_x.items() for k, v in c.tensors(f"hidden.{l}").items()},
                      str(d / "hidden.safetensors"))
        record = save_record(d / "record.json", {"samples": len(tune_samples), **fit.record(), "plan": art.plan},
                             inputs)
        resume.clear()
        self.log(f"stage finetune: validation KL {fit.val[0]:.4f} -> {fit.val[fit.best_epoch]:.4f} "
                 f"(epoch {fit.best_epoch} of {len(fit.train)})")
        return record

    # -- all -----------------------------------------------------------------------------------------
    def run(self, val_samples, capture_pair: CapturePair | None = None, tune_samples=None) -> PairArtifacts:
        """traces -> policy -> artifacts of the chosen plan, then, with cfg.finetune_samples and
        tune_samples given, end-to-end fine-tuning of its aligners."""
        rows = self.traces(capture_pair)
        ranks = self.ranks(val_samples) if self.cfg.payload_budget else None
        record = self.policy(val_samples)
        art = self.artifacts_for(self.plan_with(record["chosen"]))
        info = {"calibration": {"prefixes": len(self.prefixes), "rows": rows, "data_digest": data_digest(
            self.prefixes), "config": self.cfg.model_dump()}, "policy": record}
        if ranks:
            info["ranks"] = ranks
        if self.cfg.finetune_samples and tune_samples and (art.patch_layers or "hidden" in art.plan):
            info["finetune"] = self.finetune(art, tune_samples[:self.cfg.finetune_samples], val_samples)
        if self.cfg.choose_level and len(art.levels) > 1:
            info["level"] = self.level(art, val_samples)
            art = art.at_level({k: info["level"]["chosen"][k] for k in art.reuse_ranks})
        art.info = info
        return art

    def level(self, art: PairArtifacts, val_samples) -> dict:
        """Stage 5 (cfg.choose_level): the validation KL of the finished artifact at each of its nested levels;
        the one with the lowest is served: a wider code that scores no lower pays bytes and decode FLOPs for
        nothing. (Not the ranks stage's noise rule: a level within the noise of a wider one may still score
        worse, and the served quality is not traded down here.) Checkpointed on the artifact's tensors; returns
        its record."""
        path = self.plan_dir / "level.json"
        inputs = {"val": samples_digest(val_samples), "choose": LEVEL_RULE, "plan": art.plan,
                  "artifact": weights_digest(art.tensors())}
        record = load_record(path, inputs, self.log)
        if record is not None:
            self.log(f"stage level: resumed from checkpoint ({record['chosen']})")
            return record
        ranks = lambda t: {k: t[k] for k in art.reuse_ranks}  # noqa: E731
        tried = [{**t, "payload_ratio": self.payload_ratio(ranks(t))}
                 for t in scoring.level_kls(self.producer, self.consumer, art, val_samples, self.progress)]
        pick, full = min(tried, key=lambda t: (t["kl"], t["payload_ratio"])), tried[-1]
        record = save_record(path, {"tried": tried, "chosen": ranks(pick)}, inputs)
        self.log(f"stage level: serving {level_tag(ranks(pick))}, validation KL {pick['kl']:.4f} at payload "
                 f"{pick['payload_ratio']:.3f} (the full code: {full['kl']:.4f} at {full['payload_ratio']:.3f})")
        return record


def calibrate(producer, consumer, spec: ModelSpec, pair: str, prefixes: list[torch.Tensor], val_samples,
              work_dir: str | Path, cfg: CalibConfig = CalibConfig(), pad_id: int | None = 0, progress: bool = True,
              log: Callable[[str], None] = lambda s: None) -> PairArtifacts:
    """The whole offline pipeline in one process (resumable through `work_dir`)."""
    return Calibration(producer, consumer, spec, pair, prefixes, work_dir, cfg, pad_id, progress, log).run(val_samples)
