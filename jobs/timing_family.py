"""Publish random artifacts for a timing family (scd/online/shapes.py): one per specialist, of the plan kind its
name says, with the tensors' shapes a calibration would choose at that size. Their values are random: what
they rebuild is noise, and every answer says timing_only. Nothing is traced or fitted, so a family of any
shape is published in seconds, wherever its config is.

    python -m jobs.timing_family --config configs/timing-tiny.yaml

Plan kinds, by specialist name:
- `codes`: a hidden-state code per layer above layer 0 (layer 0 rebuilt from the token ids), its rank the
  largest whose payload as sent is at most `--payload` (0.1) of the raw bf16 KV, with a token table of every
  token id the tokenizer has, sent in int8/int4 (mixed);
- `block_2_3`, `block_1_3`: the same codes below an entry at 2/3 (1/3) of the layers, the producer's residual
  sent there through a rank-64 entry aligner, the specialist's own layers from the entry up;
- `exact_half`: an exact plan entered at half the layers (a layer-restricted adapter): the producer's K and V
  below, its residual at the entry, bf16;
- `alora`: every layer shared (an activated LoRA's prefix): no compute, no codes.
"""
from __future__ import annotations

import argparse
import sys

import torch

from artifacts_store import ArtifactStore
from artifacts_store.fingerprints import Fingerprints, ModelFingerprint
from artifacts_store.manifest import CalibrationData
from cluster.config import ConfigError, load_config
from scd.online import codec, shapes
from scd.online.artifacts import PairArtifacts, exact_plan
from scd.online.model_files import load_tokenizer
from scd.online.models import ModelSpec, tokenizer_fingerprint
from scd.online.reuse import LinearCodec

PLAN_KINDS = ("codes", "block_2_3", "block_1_3", "exact_half", "alora")
ENTRY_RANK = 64


def code_rank(spec: ModelSpec, payload: float, code_dtype: str = "mixed") -> int:
    """The largest hidden-state code rank (at most the hidden size) whose codes for every layer above layer 0
    take at most `payload` of the raw bf16 KV per token, as sent."""
    per_token = lambda r: (spec.num_layers - 1) * codec.code_bytes_per_row(r, code_dtype)   # noqa: E731
    r = 1
    while r < spec.hidden_size and per_token(r + 1) <= payload * spec.kv_bytes_per_token:
        r += 1
    return r


def _codec(g: torch.Generator, d_a: int, r: int, d_b: int, table_ids: torch.Tensor | None = None) -> LinearCodec:
    """Random encoder and decoder of the given widths, scaled so that decoded rows stay of unit size."""
    rnd = lambda *shape: torch.randn(*shape, generator=g)                         # noqa: E731
    table = rnd(len(table_ids), d_b) * 0.02 if table_ids is not None else None
    return LinearCodec(mu_a=rnd(d_a) * 0.02, enc=rnd(d_a, r) / d_a ** 0.5, mu_b=rnd(d_b) * 0.02,
                       dec=rnd(r, d_b) / r ** 0.5, table=table, table_ids=table_ids)


def random_artifact(kind: str, pair: str, spec: ModelSpec, vocab: int, payload: float = 0.1,
                    seed: int = 0, entry: int | None = None, stop: int | None = None) -> PairArtifacts:
    """A PairArtifacts of the plan kind `kind` (PLAN_KINDS) for a pair of `spec`, random values. `entry`: a
    codes plan's block entered at this layer instead of the kind's own (a calibrated plan's shape), ending below
    `stop` (the top by default) with the codes again from there up."""
    layers = spec.num_layers
    if kind == "exact_half":
        return PairArtifacts.exact(pair, spec, exact_plan(layers, layers // 2), info={"timing_only": True})
    if kind == "alora":
        return PairArtifacts.exact(pair, spec, exact_plan(layers, layers, whole_prefix=True),
                                   info={"timing_only": True})
    if kind not in PLAN_KINDS:
        raise ValueError(f"no plan kind {kind!r}; the kinds are {', '.join(PLAN_KINDS)}")
    if entry is None:
        entry = {"codes": layers, "block_2_3": round(layers * 2 / 3), "block_1_3": round(layers / 3)}[kind]
    elif not 1 <= entry <= layers:
        raise ValueError(f"an entry is a layer in 1..{layers}, got {entry}")
    stop = layers if stop is None else stop
    if entry < layers and not entry < stop <= layers:
        raise ValueError(f"a block [{entry}, {stop}) of {layers} layers: its stop is above its entry, at most {layers}")
    g = torch.Generator().manual_seed(seed)
    r_x = code_rank(spec, payload)
    kv_width = 2 * spec.num_kv_heads * spec.head_dim
    ids = torch.arange(vocab)
    plan = ["exact"] + ["hidden"] * (entry - 1)
    if entry < layers:
        plan += ["entry"] + ["recompute"] * (stop - entry - 1) + ["hidden"] * (layers - stop)
    reuse_x = {l: _codec(g, spec.hidden_size, r_x, kv_width, ids.clone()) for l, k in enumerate(plan) if k == "hidden"}
    entry_align = {}
    if entry < layers:
        entry_align[entry] = _codec(g, spec.hidden_size, ENTRY_RANK, spec.hidden_size)
    return PairArtifacts(pair, spec, 0, 0, 0, 0, plan, {}, {}, r_x=r_x, reuse_x=reuse_x, code_dtype="mixed",
                         entry_align=entry_align, info={"timing_only": True})


def fingerprints(producer_path: str, consumer_path: str, tok) -> Fingerprints:
    """What a timing pair's models are, without building them: their shape's config and their path's seed."""
    def of(path):
        ref = shapes.parse(path)
        return ModelFingerprint(config_hash=ModelSpec.from_config(shapes.config(ref.name)).fingerprint(),
                                weights_digest=f"shape:{ref.name}:{ref.seed}")
    return Fingerprints(producer=of(producer_path), consumer=of(consumer_path), tokenizer=tokenizer_fingerprint(tok))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jobs.timing_family", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--payload", type=float, default=0.1, help="the codes' payload over the raw bf16 KV (0.1)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    models = [cfg.producer, *cfg.specialists]
    not_shapes = [m.name for m in models if not shapes.is_shape(m.path)]
    unknown = [s.name for s in cfg.specialists if s.name not in PLAN_KINDS]
    if not_shapes or unknown:
        print(f"{args.config}: a timing family's models are shape:// paths and its specialists are named by plan "
              f"kind ({', '.join(PLAN_KINDS)}); not so: {', '.join(not_shapes + unknown)}", file=sys.stderr)
        return 2
    tok = load_tokenizer(cfg.producer.path)
    spec = ModelSpec.from_config(shapes.config(shapes.parse(cfg.producer.path).name))
    store = ArtifactStore(cfg.artifacts.uri)
    for i, s in enumerate(cfg.specialists):
        pair = f"{cfg.producer.name}:{s.name}"
        art = random_artifact(s.name, pair, spec, len(tok), args.payload, seed=i)
        m = store.publish(art, fingerprints(cfg.producer.path, s.path, tok),
                          CalibrationData(digest="0" * 64, n_prefixes=0, rows=0))
        ratio = codec.code_bytes(art, 1024) / (1024 * spec.kv_bytes_per_token) if art.reuse_x else 0.0
        print(f"{pair}@{m.version}: {s.name}, plan {art.plan}"
              + (f", r_x {art.r_x}, codes {ratio:.3f} of the raw KV per token" if art.reuse_x else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
