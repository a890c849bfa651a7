"""End-to-end fine-tuning of a pair's Patch aligners and hidden-state Reuse decoders on the consumer's own
next-token distribution.

The aligners are first fitted locally (each on the K/V error of its own layer). Here, with the layer plan
fixed, the consumer runs teacher-forced continuations on top of the rebuilt cache, and the aligners are
trained on KL(oracle || rebuilt) of its predictions: they learn what matters to the consumer's outputs, and
to make up for the error the Reuse layers leave. The decoders of "hidden" layers (fitted in closed form on
the K/V error) are trained with them; with `encoders=True` so are their producer-side encoders, and the codes
themselves learn what the consumer needs (through the wire's rounding with a straight-through gradient).
The consumer stays fixed. The weights of the best epoch on the validation samples are kept, and only if they
beat the locally fitted ones by more than the validation samples' own spread (`beats`): a gain that small
samples cannot tell from noise keeps the closed-form fit.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from scd.fitting.traces import pad
from scd.fitting.scoring import PlanScorer, beats
from scd.online import cache, codec
from scd.online.artifacts import PairArtifacts
from scd.online.patch import regenerate_kv
from scd.online.rebuild import encode, rebuild
from scd.online.reuse import LinearCodec, bigram_keys
from scd.online.rope import apply_rope, cos_sin, positions_from_mask
from scd.online.tables import layer0_input
from scd.online.trace import capture


@dataclass
class FinetuneFit:
    train: list[float]          # mean training KL per epoch
    val: list[float]            # validation KL before training (index 0) and after each epoch
    best_epoch: int             # 0 = the locally fitted aligners were kept
    gain_kept: list[bool]       # per epoch: whether its gain over epoch 0 stood out of the validation noise

    def record(self) -> dict:
        """The checkpoint record's fields (callers add what they know besides)."""
        return {"train": self.train, "val": self.val, "gain_kept": self.gain_kept, "best_epoch": self.best_epoch}


@torch.no_grad()
def _batch(producer, consumer, art: PairArtifacts, samples, pad_id: int | None, encoders: bool) -> dict:
    """Everything fixed for one batch, compact so that many samples fit in memory: the codes as received, in
    their wire precision (and, to train encoders, the producer's x_norm of the hidden layers, in bf16), the
    non-trained layers' K/V, the oracle's log-probabilities in bf16."""
    ids, mask = pad([s.prefix for s in samples], pad_id, left=True)
    cont, cmask = pad([s.cont for s in samples], pad_id, left=False)
    trace = capture(producer, ids, mask)
    codes = codec.as_received(encode(art, trace, ids), art.code_dtype)
    wire = {l: {name: (tuple(x.shape), codec.wire_tensors(x, art.code_dtype)) for name, x in fields.items()}
            for l, fields in codes.layers.items()}                    # exact: x is already wire-rounded
    xa = {src: torch.cat([trace.xnorm[l] for l in art.group(src)], -1).to(torch.bfloat16)
          for src in art.hidden_codes()} if encoders else {}
    kv, _ = rebuild(consumer, art, codes)
    trained = {l for layers in art.hidden_codes().values() for l in layers} | set(art.patch_layers)
    # _kl makes the trained layers' K/V; keep only the others, as copies (they are views of whole-model buffers)
    kv = [None if l in trained else (layer[0].clone(), layer[1].clone()) for l, layer in enumerate(kv)]
    o = capture(consumer, ids, mask, want_xnorm=False)
    ref, _ = cache.extend(consumer, cache.assemble(consumer, list(zip(o.keys, o.values))), mask, cont[:, :-1],
                          cmask[:, :-1])
    cos, sin = cos_sin(consumer, positions_from_mask(mask))
    return {"ids": ids, "keys": bigram_keys(ids, mask), "mask": mask, "cont": cont, "cmask": cmask, "wire": wire,
            "kv": kv, "cos": cos, "sin": sin, "ref": F.log_softmax(ref.float(), -1).bfloat16(),
            "x0": layer0_input(consumer, ids), "xa": xa}


def _code(b: dict, layer: int, name: str) -> torch.Tensor:
    """One layer's code of a batch as received, float32."""
    shape, parts = b["wire"][layer][name]
    return codec.from_wire_tensors(parts, shape)


def _kl(consumer, art: PairArtifacts, b: dict) -> torch.Tensor:
    """Mean KL(oracle || rebuilt) over the valid continuation targets, differentiable in the aligners."""
    kv = list(b["kv"])
    n_kv, d = art.spec.num_kv_heads, art.spec.head_dim
    m = n_kv * d
    for src, layers in art.hidden_codes().items():
        c = art.reuse_x[src]
        if src in b["xa"]:                                      # trained encoder: codes through the wire's rounding
            z = c.encode(b["xa"][src].float())
            z = z + (codec.wire_round(z, art.code_dtype) - z).detach()
        else:
            z = _code(b, src, "z_x")
        y = c.decode(z, b["ids"], b["keys"])                    # (B, T, 2 n_kv d) per layer of the group
        bt = y.shape[:2]
        for l in layers:
            i = art.hidden_source(l)[1] * 2 * m
            k = y[..., i:i + m].reshape(*bt, n_kv, d).transpose(1, 2)
            v = y[..., i + m:i + 2 * m].reshape(*bt, n_kv, d).transpose(1, 2)
            kv[l] = (apply_rope(k.to(b["cos"].dtype), b["cos"], b["sin"]), v.to(b["cos"].dtype))
    for l in art.patch_layers:
        x = art.aligners[l](_code(b, l, "z_h"), b["mask"], b["x0"])
        kv[l] = regenerate_kv(consumer.model.layers[l], x.to(b["cos"].dtype), b["cos"], b["sin"], art.spec.head_dim)
    logits, _ = cache.forward_on_cache(consumer, cache.assemble(consumer, kv), b["mask"], b["cont"][:, :-1],
                                       b["cmask"][:, :-1])
    lp, ref = F.log_softmax(logits.float(), -1), b["ref"].float()
    per_token = (ref.exp() * (ref - lp)).sum(-1)
    valid = b["cmask"][:, 1:].to(per_token.dtype)               # targets cont[1:] that are real tokens
    return (per_token * valid).sum() / valid.sum().clamp(min=1)


def _release_freed_memory() -> None:
    """Hand the memory freed by building a batch back to the OS (glibc's malloc_trim; a no-op elsewhere).
    Building a batch frees many times the temporaries it keeps; without this the heap's free pages stay
    resident and a long fine-tuning's memory grows by several times each batch's size."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _state(art: PairArtifacts) -> dict:
    """A copy of everything fine-tuning moves: aligner weights and hidden-state decoders."""
    hidden = art.hidden_codes()
    return {"aligners": {l: {k: t.detach().clone() for k, t in art.aligners[l].state_dict().items()}
                         for l in art.patch_layers},
            "hidden": {l: c.map(lambda t: t.detach().clone()) for l, c in art.reuse_x.items() if l in hidden}}


def _flat(state: dict, prefix: str) -> dict[str, torch.Tensor]:
    """A _state as flat named tensors (safetensors)."""
    out = {f"{prefix}al.{l}.{k}": t.contiguous() for l, sd in state["aligners"].items() for k, t in sd.items()}
    for l, c in state["hidden"].items():
        out.update(c.tensors(f"{prefix}hid.{l}"))
    return out


def _unflat(t: dict[str, torch.Tensor], prefix: str, art: PairArtifacts) -> dict:
    """The _state of `art`'s layers that _flat wrote under `prefix`."""
    return {"aligners": {l: {k[len(f"{prefix}al.{l}."):]: v for k, v in t.items() if k.startswith(f"{prefix}al.{l}.")}
                         for l in art.patch_layers},
            "hidden": {l: LinearCodec.from_tensors(t, f"{prefix}hid.{l}") for l in art.hidden_codes()}}


def _load_state(art: PairArtifacts, state: dict) -> None:
    """Put a _state's values into art's own tensors, in place (the optimiser holds them)."""
    with torch.no_grad():
        for l, sd in state["aligners"].items():
            art.aligners[l].load_state_dict(sd)
        for l, c in state["hidden"].items():
            for k, v in vars(art.reuse_x[l]).items():
                if v is not None:
                    v.copy_(getattr(c, k))


@dataclass
class Progress:
    """Where fine-tuning keeps its state after each epoch, so that a killed run goes on from the last epoch
    done (the batches are built again): `path`, one .safetensors written atomically (the fit so far and `key`
    in its metadata), and `key`, what the run depends on (the caller's checkpoint inputs); a file with
    another key is not resumed."""
    path: Path
    key: dict

    def save(self, epoch: int, fit: FinetuneFit, start: list[float], art: PairArtifacts, best: dict, opt, gen) -> None:
        t = {k: v.clone() for k, v in {**_flat(_state(art), "cur."), **_flat(best, "best.")}.items()}  # (shared ids)
        t["gen"] = gen.get_state()
        for i, st in opt.state_dict()["state"].items():
            t.update({f"opt.{i}.{k}": v.contiguous() for k, v in st.items()})
        meta = {"key": self.key, "epoch": epoch, "start": start, **fit.record()}
        tmp = self.path.with_suffix(".tmp")
        save_file(t, str(tmp), metadata={"progress": json.dumps(meta)})
        tmp.replace(self.path)

    def load(self, art: PairArtifacts, opt, gen) -> tuple[int, FinetuneFit, list[float], dict] | None:
        """(last epoch done, fit so far, the starting per-sample KLs, the best state) with art, opt and gen
        put back as they were after that epoch; None without a file for this key."""
        if not self.path.is_file():
            return None
        with safe_open(str(self.path), "pt") as f:
            meta = json.loads(f.metadata()["progress"])
            if meta.get("key") != json.loads(json.dumps(self.key)):
                return None
            t = {k: f.get_tensor(k) for k in f.keys()}
        _load_state(art, _unflat(t, "cur.", art))
        gen.set_state(t["gen"])
        state = {}
        for k, v in t.items():
            if k.startswith("opt."):
                _, i, name = k.split(".", 2)
                state.setdefault(int(i), {})[name] = v
        opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
        fit = FinetuneFit(meta["train"], meta["val"], meta["best_epoch"], meta["gain_kept"])
        return int(meta["epoch"]), fit, meta["start"], _unflat(t, "best.", art)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def finetune_scored(producer, consumer, art: PairArtifacts, samples, val_samples, cfg, pad_id: int | None,
                    progress: bool, log: Callable[[str], None], encoders: bool = False,
                    resume: Progress | None = None) -> FinetuneFit:
    """finetune_aligners under the calibration settings `cfg` (CalibConfig), each epoch scored by the
    consumer's next-token KL on `val_samples` (PlanScorer): what a pair's and a family member's calibration run."""
    scorer = PlanScorer(producer, consumer, val_samples, lambda plan: art.with_plan(plan))
    return finetune_aligners(producer, consumer, art, samples, lambda a: scorer.kls(a.plan), cfg.finetune_epochs,
                             cfg.finetune_lr, cfg.batch, pad_id, cfg.seed, progress, log, encoders=encoders,
                             resume=resume)


def finetune_aligners(producer, consumer, art: PairArtifacts, samples, val_kl: Callable[[PairArtifacts], list[float]],
                      epochs: int = 3, lr: float = 1e-4, batch: int = 8, pad_id: int | None = 0, seed: int = 0,
                      progress: bool = False, log: Callable[[str], None] = lambda s: None,
                      encoders: bool = False, resume: Progress | None = None) -> FinetuneFit:
    """Fine-tune art's aligners and hidden-state decoders (and with `encoders`, their encoders) in place on
    (prefix, continuation) samples; val_kl(art) scores a candidate (its KL on each validation sample). With
    `resume`, the state after each epoch is kept there, and a run killed after some epochs goes on from them."""
    hidden = list(art.hidden_codes())
    if not art.patch_layers and not hidden:
        raise ValueError("the plan has no Patch or hidden layers: nothing to fine-tune")
    art.reuse_x = dict(art.reuse_x)              # own codecs: the calibration's closed-form ones stay as they are
    for l in hidden:
        c = art.reuse_x[l]
        own = lambda t, train: t.detach().clone().requires_grad_(train)  # noqa: E731
        art.reuse_x[l] = LinearCodec(own(c.mu_a, encoders), own(c.enc, encoders), own(c.mu_b, True), own(c.dec, True),
                                     None if c.table is None else own(c.table, True), c.table_ids,
                                     None if c.bigram is None else own(c.bigram, True), c.bigram_ids)
    params = [q for l in art.patch_layers for q in art.aligners[l].parameters()]
    params += [t for l in hidden for t in vars(art.reuse_x[l]).values() if t is not None and t.requires_grad]
    frozen = [q for q in consumer.parameters() if q.requires_grad]
    batches = []
    for i in tqdm(range(0, len(samples), batch), desc="finetune batches", disable=not progress):
        batches.append(_batch(producer, consumer, art, samples[i:i + batch], pad_id, encoders))
        _release_freed_memory()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(params, lr=lr)
    done = resume.load(art, opt, gen) if resume is not None else None
    if done is not None:
        last, fit, start, best_state = done
        log(f"finetune: resumed after epoch {last} of {epochs}")
    else:
        last, best_state = 0, _state(art)
        start = val_kl(art.with_plan(art.plan))
        fit = FinetuneFit([], [sum(start) / len(start)], 0, [])
    try:
        for q in frozen:
            q.requires_grad_(False)
        with torch.enable_grad():
            for epoch in range(last + 1, epochs + 1):
                tot = 0.0
                for i in tqdm(torch.randperm(len(batches), generator=gen).tolist(), desc=f"finetune {epoch}/{epochs}",
                              disable=not progress):
                    loss = _kl(consumer, art, batches[i])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    tot += loss.item()
                fit.train.append(tot / len(batches))
                kls = val_kl(art.with_plan(art.plan))               # a fresh copy: nothing derived is stale
                fit.val.append(sum(kls) / len(kls))
                fit.gain_kept.append(beats(start, kls))
                log(f"finetune epoch {epoch}: train KL {fit.train[-1]:.4f}, validation KL {fit.val[-1]:.4f}"
                    + ("" if fit.gain_kept[-1] or fit.val[-1] >= fit.val[0] else " (gain within the noise)"))
                if fit.gain_kept[-1] and fit.val[-1] < fit.val[fit.best_epoch]:
                    fit.best_epoch = epoch
                    best_state = _state(art)
                if resume is not None and epoch < epochs:
                    resume.save(epoch, fit, start, art, best_state, opt, gen)
    finally:
        for q in frozen:
            q.requires_grad_(True)
    for l in art.patch_layers:
        art.aligners[l].load_state_dict(best_state["aligners"][l])
        art.aligners[l].eval()
    for l in hidden:
        art.reuse_x[l] = best_state["hidden"][l]
    art.derived.clear()                                         # fused forms of the old weights
    return fit
