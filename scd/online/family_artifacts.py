"""A family's artifacts: one code for several specialists (scd.fitting.family builds them, jobs.family
publishes them). Each member is a PairArtifacts (scd.online.artifacts) that shares the producer-side
encoders with the others, so one encode and one payload serve a fan-out to all of them."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from scd.online.artifacts import EXACT_KINDS, IncompatibleArtifact, PairArtifacts

FAMILY_FORMAT_VERSION = 1
SHARED_SUFFIXES = (".mu_a", ".enc")       # a codec's producer side: what a family's members share
@dataclass
class FamilyArtifacts:
    """One code for several specialists (scd.fitting.family): a member artifact per specialist, every one
    with the same producer-side encoders, so that one encode and one payload serve a fan-out to all of them.
    Each member's `pair` is the family's id (what its payloads carry); `members` maps the member's own pair id
    ("producer:consumer") to it. Members may Patch different layers: the payload then carries every code any
    member needs (the family plan Patches a layer wherever a member does, and keeps a hidden-state code
    wherever a member reads one), and each member rebuilds from the codes its own plan uses."""
    family: str                                 # "producer:family-name"
    members: dict[str, PairArtifacts]
    info: dict = field(default_factory=dict)
    encoder: PairArtifacts = field(init=False, repr=False, compare=False)   # what the producer encodes with

    def __post_init__(self):
        if len(self.members) < 2:
            raise ValueError(f"a family needs two or more members, got {sorted(self.members)}")
        first = next(iter(self.members.values()))
        for name, art in self.members.items():
            if art.pair != self.family:
                raise ValueError(f"member {name} carries pair {art.pair!r}, not the family's {self.family!r}")
        if all(k in EXACT_KINDS for art in self.members.values() for k in art.plan):
            self._exact(first)
            return
        encoders: dict[str, torch.Tensor] = {}
        for name, art in self.members.items():
            same = (art.spec, art.reuse_ranks, art.code_dtype, art.x_groups) == \
                (first.spec, first.reuse_ranks, first.code_dtype, first.x_groups)
            other_kinds = [(a, b) for a, b in zip(art.plan, first.plan) if a != b and "patch" not in (a, b)]
            if art.reuse_kind != "hidden" and art.plan != first.plan:
                other_kinds.append("per-head Reuse codes need one plan")
            own = _shared(art)
            if not same or other_kinds or any(not torch.equal(v, encoders.get(k, v)) for k, v in own.items()):
                raise ValueError(f"member {name} does not share the family's plan, ranks and encoders")
            encoders.update(own)
        plan = ["patch" if any(a.plan[l] == "patch" for a in self.members.values()) else kind
                for l, kind in enumerate(first.plan)]
        x_codes = sorted({s for a in self.members.values() for s in a.hidden_codes()}) \
            if first.reuse_kind == "hidden" else None
        patched = {l: a for a in self.members.values() for l in a.patch_layers}
        self.members = {name: dataclasses.replace(art, wire_plan=plan, wire_x_codes=x_codes, derived={})
                        for name, art in self.members.items()}
        self.encoder = dataclasses.replace(
            first, plan=plan, patch_enc={l: a.patch_enc[l] for l, a in patched.items()},
            aligners={l: a.aligners[l] for l, a in patched.items()}, wire_plan=[], wire_x_codes=x_codes, derived={})

    def _exact(self, first: PairArtifacts) -> None:
        """Members on exact plans (nothing learned): the payload is the union of their plans, the producer's K and V
        of every layer a member shares and its residual at every layer a member enters (`union_kind`), sent
        once; each member takes what lies below its own entry."""
        if first.code_dtype == "klt":
            raise ValueError("klt codes are fitted per pair: a family's exact payload travels in bf16, int8 or kivi4")
        other = [name for name, a in self.members.items() if (a.spec, a.code_dtype) != (first.spec, first.code_dtype)]
        if other:
            raise ValueError(f"members {other} do not share the family's model shape and wire precision")
        plan = [union_kind([a.plan[l] for a in self.members.values()]) for l in range(first.spec.num_layers)]
        self.members = {name: dataclasses.replace(art, wire_plan=plan, derived={}) for name, art in self.members.items()}
        self.encoder = PairArtifacts.exact(self.family, first.spec, plan, first.code_dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The shared encoders once ("shared.*": every member's, the family's encoder), then each member's own
        tensors ("member.<pair>.*")."""
        out = {f"shared.{k}": v for k, v in _shared(self.encoder).items()}
        for name, art in self.members.items():
            out.update({f"member.{name}.{k}": v for k, v in art.tensors().items() if not k.endswith(SHARED_SUFFIXES)})
        return out

    def description(self) -> dict:
        return {"format_version": FAMILY_FORMAT_VERSION, "family": self.family, "info": self.info,
                "members": {name: art.description() for name, art in self.members.items()}}

    @classmethod
    def from_parts(cls, desc: dict, t: dict[str, torch.Tensor]) -> "FamilyArtifacts":
        if desc.get("format_version") != FAMILY_FORMAT_VERSION:
            raise IncompatibleArtifact(f"family artifact format {desc.get('format_version')!r} was written by another "
                                       f"SCD Serve build (this one reads {FAMILY_FORMAT_VERSION}): fit the family again")
        shared = {k[len("shared."):]: v for k, v in t.items() if k.startswith("shared.")}
        members = {}
        for name, member_desc in desc["members"].items():
            pre = f"member.{name}."
            own = {k[len(pre):]: v for k, v in t.items() if k.startswith(pre)}
            members[name] = PairArtifacts.from_parts(member_desc, {**shared, **own})
        return cls(desc["family"], members, desc.get("info", {}))

    def to(self, device) -> "FamilyArtifacts":
        return FamilyArtifacts(self.family, {n: a.to(device) for n, a in self.members.items()}, self.info)

    def save(self, directory: str | Path) -> None:
        """tensors.safetensors + family.json (what the artifact store publishes for a family)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors(), str(d / "tensors.safetensors"))
        (d / "family.json").write_text(json.dumps(self.description(), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "FamilyArtifacts":
        d = Path(directory)
        return cls.from_parts(json.loads((d / "family.json").read_text()), load_file(str(d / "tensors.safetensors")))


def union_kind(kinds: list[str]) -> str:
    """What one layer of an exact family's payload carries, given each member's plan kind there: the producer's K
    and V if a member shares the layer, its residual if a member enters there (both: "shared_entry"), nothing if
    every member runs it or regenerates it (layer 0)."""
    shared, entered = "shared" in kinds, "entry" in kinds
    if shared or entered:
        return "shared_entry" if shared and entered else "shared" if shared else "entry"
    return "recompute" if "recompute" in kinds else "exact"


def _shared(art: PairArtifacts) -> dict[str, torch.Tensor]:
    """An artifact's producer-side tensors (its codecs' means and encoders)."""
    return {k: v for k, v in art.tensors().items() if k.endswith(SHARED_SUFFIXES)}
