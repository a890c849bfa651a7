"""Fingerprints of the models an artifact was calibrated for, and the check against the models loaded.

Artifacts are only valid for the exact producer/consumer weights and tokenizer they were fitted on: a codec
fitted for one fine-tune silently produces a wrong cache for another. So every artifact records
  config hash     = ModelSpec.fingerprint() (architecture fields that shape the KV cache),
  weights digest  = sha256 over the state_dict (names, dtypes, shapes, bytes; sorted by name), or for a
                    PEFT adapter merged at load, sha256 of base folder digest + adapter digest (scd.online.models.load),
  tokenizer       = scd.online.models.tokenizer_fingerprint (vocabulary),
and loading with `expect=` refuses any difference, naming which one.
"""
from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from artifacts_store.errors import FingerprintMismatch, InvalidReference
from artifacts_store.refs import parse_ref


class ModelFingerprint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    config_hash: str = Field(description="ModelSpec.fingerprint(): the architecture fields that shape the KV cache")
    weights_digest: str = Field(description="weights_digest() of the model's state_dict")

    @classmethod
    def of(cls, model) -> "ModelFingerprint":
        """Fingerprint of a loaded transformers model (its config must be one ModelSpec supports)."""
        from scd.online.models import ModelSpec, model_digest
        return cls(config_hash=ModelSpec.from_config(model.config).fingerprint(), weights_digest=model_digest(model))


class Fingerprints(BaseModel):
    """Both models and the shared tokenizer. As an expectation, a field left None is not checked
    (a consumer replica may hold only its own model)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    producer: ModelFingerprint | None = Field(default=None, description="the base model that prefills and encodes")
    consumer: ModelFingerprint | None = Field(default=None, description="the specialist that rebuilds its cache")
    tokenizer: str | None = Field(default=None, description="scd.online.models.tokenizer_fingerprint of the shared tokenizer")

    @classmethod
    def of(cls, producer=None, consumer=None, tokenizer=None) -> "Fingerprints":
        from scd.online.models import tokenizer_fingerprint
        return cls(producer=ModelFingerprint.of(producer) if producer is not None else None,
                   consumer=ModelFingerprint.of(consumer) if consumer is not None else None,
                   tokenizer=tokenizer_fingerprint(tokenizer) if tokenizer is not None else None)

    @property
    def complete(self) -> bool:
        return self.producer is not None and self.consumer is not None and self.tokenizer is not None


def differences(recorded: Fingerprints, loaded: Fingerprints) -> list[str]:
    """One line per fingerprint that differs, e.g. 'consumer weights digest: artifact=ab12 loaded=cd34'."""
    out = []
    for side in ("producer", "consumer"):
        a, b = getattr(recorded, side), getattr(loaded, side)
        if a is None or b is None:
            continue
        if a.config_hash != b.config_hash:
            out.append(f"{side} config hash: artifact={a.config_hash} loaded={b.config_hash}")
        if a.weights_digest != b.weights_digest:
            out.append(f"{side} weights digest: artifact={a.weights_digest} loaded={b.weights_digest}")
    if recorded.tokenizer is not None and loaded.tokenizer is not None and recorded.tokenizer != loaded.tokenizer:
        out.append(f"tokenizer fingerprint: artifact={recorded.tokenizer} loaded={loaded.tokenizer}")
    return out


def check(what: str, recorded: Fingerprints, loaded: Fingerprints) -> None:
    diffs = differences(recorded, loaded)
    if diffs:
        raise FingerprintMismatch(f"{what} was calibrated for other models than the ones loaded: " + "; ".join(diffs)
                                  + ". Load the models it was calibrated for, or recalibrate and publish the pair "
                                  "for these models.", diffs)


def check_publishable(what: str, spec_hash: str, f: Fingerprints) -> None:
    """Publishing needs all three fingerprints, of models with the architecture the artifacts were fitted for
    (`spec_hash`, their ModelSpec fingerprint)."""
    if not f.complete:
        raise ValueError("publish needs producer, consumer and tokenizer fingerprints "
                         "(Fingerprints.of(producer_model, consumer_model, tokenizer))")
    diffs = [f"{side} config hash: artifact spec={spec_hash} given={getattr(f, side).config_hash}"
             for side in ("producer", "consumer") if getattr(f, side).config_hash != spec_hash]
    if diffs:
        raise FingerprintMismatch(f"publishing {what}: fingerprints are not of models with the artifact's "
                                  "architecture: " + "; ".join(diffs), diffs)


def of_family(family: str, spec_hash: str,
              prints: Mapping[str, Fingerprints]) -> tuple[Fingerprints, dict[str, ModelFingerprint]]:
    """What a family's manifest records, from each member's pair fingerprints (member pair id -> them): the
    one producer and tokenizer of all (Fingerprints without a consumer), and member name -> its consumer's.
    Every member must be a consumer of the family's producer, publishable (check_publishable), and fitted
    with the same producer and tokenizer."""
    fam = parse_ref(family)
    members = {}
    for name, f in prints.items():
        member = parse_ref(name)
        if member.producer != fam.producer or member.consumer == fam.consumer:
            raise InvalidReference(f"family {family}: member {name!r} must be {fam.producer}:<another name>")
        check_publishable(name, spec_hash, f)
        members[member.consumer] = f.consumer
    first = next(iter(prints.values()))
    if any((f.producer, f.tokenizer) != (first.producer, first.tokenizer) for f in prints.values()):
        raise FingerprintMismatch(f"publishing {family}: members were fitted with different producers or "
                                  "tokenizers; a family has one producer")
    return Fingerprints(producer=first.producer, tokenizer=first.tokenizer), members
