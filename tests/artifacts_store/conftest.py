"""Tiny hand-built PairArtifacts and their fingerprints: publishing one takes milliseconds."""
from __future__ import annotations

import pytest
import torch

from artifacts_store import ArtifactStore, CalibrationData, Fingerprints, ModelFingerprint, weights_digest
from scd.online.artifacts import PairArtifacts
from scd.online.models import ModelSpec, tokenizer_fingerprint
from scd.online.patch import Aligner
from scd.online.reuse import LinearCodec

SPEC = ModelSpec("llama", 2, 4, 2, 8, 32, 64, 10000.0)      # 2 layers, head_dim 8, hidden 32


class FakeTokenizer:
    def __init__(self, extra: str = ""):
        self.vocab = {f"t{i}{extra}": i for i in range(SPEC.vocab_size)}

    def get_vocab(self):
        return self.vocab


def _codec(g: torch.Generator, d_a: int, d_b: int, r: int) -> LinearCodec:
    return LinearCodec(torch.randn(d_a, generator=g), torch.randn(d_a, r, generator=g),
                       torch.randn(d_b, generator=g), torch.randn(r, d_b, generator=g))


def tiny_artifacts(seed: int = 0, patch: bool = False, pair: str = "base:qa") -> PairArtifacts:
    """Reuse codecs (d = head_dim) for layers 0..1; with patch=True layer 1 is a Patch layer with an aligner."""
    g = torch.Generator().manual_seed(seed)
    r_k, r_v, r_h, width = 3, 4, 6, 5
    reuse_k = {l: _codec(g, SPEC.head_dim, SPEC.head_dim, r_k) for l in range(2)}
    reuse_v = {l: _codec(g, SPEC.head_dim, SPEC.head_dim, r_v) for l in range(2)}
    patch_enc, aligners = {}, {}
    if patch:
        patch_enc[1] = _codec(g, SPEC.hidden_size, SPEC.hidden_size, r_h)
        torch.manual_seed(seed)
        aligners[1] = Aligner(r_h, SPEC.hidden_size, width).eval()
    plan = ["exact", "patch" if patch else "reuse"]
    return PairArtifacts(pair, SPEC, r_k, r_v, r_h, width, plan, reuse_k, reuse_v, patch_enc, aligners,
                         info={"note": "tiny", "kl": 0.25})


def model_fingerprint(seed: int) -> ModelFingerprint:
    g = torch.Generator().manual_seed(seed)
    return ModelFingerprint(config_hash=SPEC.fingerprint(),
                            weights_digest=weights_digest({"w": torch.randn(4, 4, generator=g)}))


def fingerprints(producer_seed: int = 1, consumer_seed: int = 2, tok: str = "") -> Fingerprints:
    return Fingerprints(producer=model_fingerprint(producer_seed), consumer=model_fingerprint(consumer_seed),
                        tokenizer=tokenizer_fingerprint(FakeTokenizer(tok)))


CALIB = CalibrationData(digest="0" * 32, n_prefixes=8, rows=512)
METRICS = {"kl": 0.0123, "payload_bytes": 4096.0, "f1": 0.81}


def publish(store: ArtifactStore, art: PairArtifacts | None = None, **kw):
    return store.publish(art or tiny_artifacts(), fingerprints(), CALIB, METRICS, **kw)


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


def tiny_family(members=("base:qa", "base:prose"), family: str = "base:fam"):
    """A FamilyArtifacts of tiny members: one set of encoders, a decoder per member; and their fingerprints."""
    import dataclasses

    from scd.online.family_artifacts import FamilyArtifacts
    first = tiny_artifacts(0, pair=family)
    arts = {}
    for i, name in enumerate(members):
        g = torch.Generator().manual_seed(100 + i)
        redec = lambda codecs: {l: dataclasses.replace(c, dec=torch.randn(c.dec.shape, generator=g),  # noqa: E731
                                                    mu_b=torch.randn(c.mu_b.shape, generator=g))
                                for l, c in codecs.items()}
        arts[name] = dataclasses.replace(first, reuse_k=redec(first.reuse_k), reuse_v=redec(first.reuse_v))
    prints = {name: fingerprints(1, 10 + i) for i, name in enumerate(members)}
    return FamilyArtifacts(family, arts), prints
