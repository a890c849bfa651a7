"""The learned artifacts of one producer->consumer pair, as tensors + a JSON description.

This is the numeric content only; the registry (versions, fingerprints, checksums) wraps it. The layer
plan says how each layer is rebuilt: "exact" (layer 0 from token ids, zero payload), "reuse" (per-head
K and V codecs), "hidden" (Reuse from the producer's hidden state: one code per token decoded into the K and V
of every head) or "patch". A consumer that shares layers with its producer (scd.fitting.structure) has three
more, which need no learned tensors: "shared" (the producer's own K and V, as they are), "entry" (a layer the
consumer runs itself, from the producer's residual stream entering it, sent) and "recompute" (a layer the
consumer runs itself after the one below it): `exact_plan`. A family of such consumers sends one payload laid
out by the union of their plans, where a layer may carry both the producer's K and V and its residual
("shared_entry": a wire kind only, one member shares the layer while another enters there).

Hidden-state codes may serve a group of adjacent layers (`x_groups`, xKV's shared cross-layer subspace): one
code per token read from the producer's x_norm of every layer of the group side by side and decoded into the
K and V of each of them. A group's codec is kept under its first layer and its code travels there; a group
whose layers are all Patched sends nothing. Without groups, every hidden layer has a code of its own.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from scd.online.models import ModelSpec
from scd.online.patch import Aligner
from scd.online.reuse import LinearCodec
from scd.settings import CODE_DTYPES, EXACT_DTYPES

FORMAT_VERSION = 2                  # 2: aligners with a causal window and token features
KINDS = ("exact", "reuse", "hidden", "patch", "shared", "entry", "recompute", "shared_entry")
RUN_KINDS = ("entry", "recompute")          # layers the consumer runs itself over the prefix
EXACT_KINDS = ("exact", "shared") + RUN_KINDS  # an exact plan's: nothing learned
ENTERED = ("entry", "shared_entry")         # wire kinds that carry a residual stream
TAIL_RULES = ("last", "attention", "learned", "suffix")  # which of a prefix's positions a tail's tokens are
# the code sizes one artifact serves, as fractions of its Reuse ranks (nested codes: a shorter code is the
# leading columns of a longer one); the producer picks one per request (scd.online.links)
LEVELS = (0.25, 0.5, 0.75, 1.0)


def layer_groups(num_layers: int, size: int) -> list[list[int]]:
    """Layers 1..L-1 in runs of `size` adjacent layers (0: one run), each sharing a hidden-state code; [] for
    size 1 (a code per layer, no groups)."""
    if size == 1:
        return []
    layers = list(range(1, num_layers))
    size = size or len(layers)
    return [layers[i:i + size] for i in range(0, len(layers), size)]


def code_groups(num_layers: int, size: int) -> list[list[int]]:
    """The layers of each hidden-state code: runs of `size` (layer_groups), or every layer >= 1 alone."""
    return layer_groups(num_layers, size) or [[l] for l in range(1, num_layers)]


def exact_plan(num_layers: int, first_adapted: int, whole_prefix: bool = False) -> list[str]:
    """The plan of a consumer that shares layers [0, first_adapted) with its producer: layer 0 from token ids,
    the producer's K and V up to first_adapted, then the consumer's own layers entered from the producer's
    residual (first_adapted == num_layers: every layer but 0 shared, no entry). whole_prefix: the whole
    prefix's cache is the producer's (an activated LoRA before its invocation), every layer shared, layer 0 too
    (the consumer's own weights are the adapted ones)."""
    if whole_prefix:
        return ["shared"] * num_layers
    if not 0 < first_adapted <= num_layers:
        raise ValueError(f"an exact entry needs shared layers below an adapted one, got layer {first_adapted} "
                         f"of {num_layers}")
    run = ["entry"] + ["recompute"] * (num_layers - first_adapted - 1) if first_adapted < num_layers else []
    return ["exact"] + ["shared"] * (first_adapted - 1) + run


def level_tag(level: dict[str, int]) -> str:
    """A level's ranks as text, e.g. "r_k=2,r_v=3" (cache keys, method names, tables)."""
    return ",".join(f"{k}={v}" for k, v in sorted(level.items()))


class IncompatibleArtifact(ValueError):
    """Artifacts in a layout this build does not read (an older or newer format): recalibrate."""


@dataclass
class PairArtifacts:
    pair: str                                   # "producer:consumer"
    spec: ModelSpec
    r_k: int
    r_v: int
    r_h: int
    aligner_width: int
    plan: list[str]                             # per layer, one of KINDS
    reuse_k: dict[int, LinearCodec]
    reuse_v: dict[int, LinearCodec]
    patch_enc: dict[int, LinearCodec] = field(default_factory=dict)
    aligners: dict[int, Aligner] = field(default_factory=dict)
    info: dict = field(default_factory=dict)    # policy curves, calibration metrics: free-form JSON
    aligner_context: int = 1                    # codes per aligner input window (1 = per token)
    aligner_tokens: int = 0                     # width of the aligners' token features (0 = none)
    aligner_window: int = 8                     # per-position width of the aligners' window
    r_x: int = 0                                # rank of the "hidden" layers' codes
    reuse_x: dict[int, LinearCodec] = field(default_factory=dict)   # x_norm (H) -> [K content; V] (2 n_kv d)
    code_dtype: str = "fp16"                    # precision of the codes on the wire, one of CODE_DTYPES
    x_groups: list[list[int]] = field(default_factory=list)   # adjacent layers sharing one hidden-state code
    # a family member's payloads are laid out for the whole family (FamilyArtifacts sets both): the family's
    # plan (Patch wherever a member Patches) and the layers carrying a hidden-state code (wherever a member
    # needs one); the member rebuilds from the codes its own plan uses
    wire_plan: list[str] = field(default_factory=list)
    wire_x_codes: list[int] | None = None
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # per-use tensors made on first use
    # an entry layer's aligner (a recompute block over codes, scd.fitting.blocks): the consumer adds
    # decode(encode(x)) to the residual x it receives before running its own layers from there
    entry_align: dict[int, LinearCodec] = field(default_factory=dict)
    # code_dtype "klt": each shared layer's transform codes of its keys (before RoPE) and values (scd.online.klt)
    klt_k: dict[int, LinearCodec] = field(default_factory=dict)
    klt_v: dict[int, LinearCodec] = field(default_factory=dict)
    # the consumer runs the prefix's last tail_tokens tokens itself, through every layer, over the cache rebuilt
    # for the tokens before them (scd.online.selective.run_tail): the recent window a continuation reads most.
    # With tail_of, the tail is that share of a prefix measured at tail_of tokens, and a prefix of T tokens
    # runs its last tail_tokens * T / tail_of (tail_for): the same share of the compute, and what that share
    # buys held at other lengths where a fixed count's did not (docs/method.md, "tails")
    tail_tokens: int = 0
    tail_of: int = 0
    # which positions those tail_tokens are: "last" (the prefix's last ones), or "attention" (the positions
    # the last selective.WINDOW attend to most over the rebuilt cache, those included:
    # scd.online.selective.attention; the consumer runs every layer for them, docs/method.md)
    tail_rule: str = "last"
    # a selector fitted at calibration (scd.fitting.selector): its weights over
    # selective.selector_features at selector_layers; tail_rule "learned" runs the positions it scores highest.
    # tail_rule "suffix": the positions the request's own tokens after the prefix read most over the rebuilt
    # cache (selective.repair; rebuild's `reader`)
    selector: torch.Tensor | None = field(default=None, compare=False)
    selector_layers: list[int] = field(default_factory=list)

    def __post_init__(self):
        exact_only = all(k in EXACT_KINDS + ("shared_entry",) for k in self.plan)
        allowed = EXACT_DTYPES if exact_only else CODE_DTYPES
        if self.code_dtype not in allowed:
            raise ValueError(f"code_dtype must be one of {allowed} for plan kinds {sorted(set(self.plan))}, got "
                             f"{self.code_dtype!r}")
        if len(self.plan) != self.spec.num_layers or any(k not in KINDS for k in self.plan):
            raise ValueError(f"plan must name one of {KINDS} for each of {self.spec.num_layers} layers: {self.plan}")
        for l, kind in enumerate(self.plan):
            if kind == "exact" and l != 0:
                raise ValueError(f"only layer 0 can be regenerated exactly from token ids, not layer {l}")
            if kind == "reuse" and (l not in self.reuse_k or l not in self.reuse_v):
                raise ValueError(f"layer {l} is planned as reuse but has no Reuse codecs")
            if kind == "hidden" and self.group(l)[0] not in self.reuse_x:
                raise ValueError(f"layer {l} is planned as hidden but has no hidden-state codec")
            if kind == "patch" and (l not in self.patch_enc or l not in self.aligners):
                raise ValueError(f"layer {l} is planned as patch but has no encoder/aligner")
            if kind in ENTERED and l == 0:
                raise ValueError("layer 0 cannot be entered from a residual stream: running it is a prefill")
            if l in self.entry_align and kind != "entry":
                raise ValueError(f"layer {l} has an entry aligner but is planned as {kind}, not entry")
            if kind == "recompute" and (l == 0 or self.plan[l - 1] not in RUN_KINDS + ("shared_entry",)):
                raise ValueError(f"layer {l} is planned as recompute but layer {l - 1} below it is not run by "
                                 f"the consumer (a block starts with an entry)")

        if self.code_dtype == "klt":
            missing = [l for l, k in enumerate(self.plan) if k == "shared" and (l not in self.klt_k or l not in self.klt_v)]
            if missing or "shared_entry" in self.plan:
                raise ValueError(f"klt sends a pair's shared layers by their own transform codes: layers {missing} "
                                 f"have none" if missing else "klt is a pair's wire form, not a family's")
        if self.tail_tokens < 0 or self.tail_of < 0:
            raise ValueError(f"tail_tokens and tail_of must be 0 or more, got {self.tail_tokens} and {self.tail_of}")
        if self.tail_rule not in TAIL_RULES:
            raise ValueError(f"tail_rule must be one of {TAIL_RULES}, got {self.tail_rule!r}")
        if self.tail_rule == "learned" and self.selector is None:
            raise ValueError("tail_rule 'learned' needs a fitted selector; this artifact has none")
        if self.selector is not None and any(not 0 <= l < self.spec.num_layers for l in self.selector_layers):
            raise ValueError(f"selector_layers must lie in 0..{self.spec.num_layers - 1}: {self.selector_layers}")
        covered = [l for g in self.x_groups for l in g]
        if len(covered) != len(set(covered)) or any(g != list(range(g[0], g[0] + len(g))) for g in self.x_groups):
            raise ValueError(f"x_groups must be disjoint runs of adjacent layers: {self.x_groups}")

    @classmethod
    def exact(cls, pair: str, spec: ModelSpec, plan: list[str], code_dtype: str = "bf16",
              info: dict | None = None, klt: tuple[dict, dict] | None = None) -> "PairArtifacts":
        """The artifact of an exact plan (`exact_plan`): nothing fitted but, for code_dtype "klt", the shared
        layers' transform codes `klt` (keys, values: {layer: LinearCodec}, scd.online.klt); only how the shared
        layers and the residual travel (code_dtype: bf16, the wire's rounding the only error; int8 with a scale
        per row; kivi4; klt)."""
        if any(k not in EXACT_KINDS + ("shared_entry",) for k in plan):
            raise ValueError(f"an exact plan shares, enters and recomputes layers, nothing else: {plan}")
        shared = [l for l, k in enumerate(plan) if k == "shared"]
        klt_k, klt_v = ({l: c[l] for l in shared if l in c} for c in klt) if klt else ({}, {})
        return cls(pair, spec, 0, 0, 0, 0, list(plan), {}, {}, info=info or {}, code_dtype=code_dtype,
                   klt_k=klt_k, klt_v=klt_v)

    def group(self, layer: int) -> list[int]:
        """The layers that share a layer's hidden-state code (itself alone without x_groups)."""
        return next((g for g in self.x_groups if layer in g), [layer])

    @property
    def exact_only(self) -> bool:
        """Whether its plan is an exact plan's (`exact_plan`): nothing learned."""
        return all(k in EXACT_KINDS for k in self.plan)

    @property
    def payload_plan(self) -> list[str]:
        """The plan its payloads are laid out in: its own, or a family member's family plan."""
        return self.wire_plan or self.plan

    @property
    def x_codes(self) -> list[int] | None:
        """The layers whose payload slot carries a hidden-state code (the first layer of each group with a
        hidden layer, or a family's); None without groups (then every hidden layer carries its own)."""
        if self.wire_x_codes is not None:
            return self.wire_x_codes
        return sorted(self.hidden_codes()) if self.x_groups else None

    @property
    def patch_layers(self) -> list[int]:
        return [l for l, k in enumerate(self.plan) if k == "patch"]

    @property
    def blocks(self) -> list[tuple[int, int]]:
        """The layers the consumer runs itself, as [start, stop) blocks, each starting at an entry."""
        starts = [l for l, k in enumerate(self.plan) if k == "entry"]
        out = []
        for s in starts:
            e = s + 1
            while e < len(self.plan) and self.plan[e] == "recompute":
                e += 1
            out.append((s, e))
        return out

    @property
    def consumer_layers(self) -> int:
        """How many layers the consumer runs over the prefix: its cost, by layer count, over its own prefill."""
        return sum(e - s for s, e in self.blocks)

    @property
    def needs_hidden(self) -> bool:
        """Whether its payloads carry a residual stream (the producer's trace must hold them)."""
        return bool(set(ENTERED) & set(self.payload_plan))

    def reuse_decoders(self, layers: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Decoders of the given Reuse layers stacked for one batched matmul, made once:
        (dec_k (L, r_k, d), mu_k (L, 1, d), dec_v (L, r_v, d), mu_v (L, 1, d))."""
        key = (layers, dtype)
        if key not in self.derived:
            stack = lambda codecs: (torch.stack([codecs[l].dec for l in layers]).to(dtype),  # noqa: E731
                                    torch.stack([codecs[l].mu_b for l in layers]).to(dtype)[:, None])
            self.derived[key] = (*stack(self.reuse_k), *stack(self.reuse_v))
        return self.derived[key]

    def hidden_source(self, layer: int) -> tuple[int, int]:
        """(the layer whose code a hidden layer is decoded from, its place in that code's group)."""
        g = self.group(layer)
        return g[0], g.index(layer)

    def hidden_codes(self) -> dict[int, list[int]]:
        """Each hidden-state code its plan reads (the layer its codec is kept under) -> the hidden layers
        decoded from it."""
        out: dict[int, list[int]] = {}
        for l, kind in enumerate(self.plan):
            if kind == "hidden":
                out.setdefault(self.hidden_source(l)[0], []).append(l)
        return out

    def _hidden_halves(self, layers: tuple[int, ...], dtype: torch.dtype,
                       part: Callable[[LinearCodec], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """part(codec) (..., d_b) of each given hidden layer's code, cut to that layer's columns (a grouped
        code decodes several layers side by side), stacked and split into K and V halves: (L, ..., n_kv d)."""
        m = self.spec.num_kv_heads * self.spec.head_dim
        sources = [self.hidden_source(l) for l in layers]                   # (code, place in its group)
        x = torch.stack([part(self.reuse_x[s])[..., i * 2 * m:(i + 1) * 2 * m] for s, i in sources]).to(dtype)
        return x[..., :m].contiguous(), x[..., m:].contiguous()

    def _all_or_none(self, layers: tuple[int, ...], field: str, what: str) -> bool:
        """Whether the given hidden layers' codes carry `field`; refused when some do and some do not."""
        have = {getattr(self.reuse_x[self.hidden_source(l)[0]], field) is not None for l in layers}
        if len(have) > 1:
            raise ValueError(f"{self.pair}: some hidden-state codecs have {what} and some do not")
        return have == {True}

    def hidden_decoders(self, dtype: torch.dtype) -> dict[int, tuple]:
        """Decoders of the plan's hidden layers, one set per code, made once: {code: (its layers (hidden_codes),
        dec_k (r_x, G n_kv d), mu_k (G n_kv d), dec_v, mu_v)}, the G layers decoded from that code side by side
        in that order, so that one matmul decodes the keys of all of them and one their values. With token
        tables mu_k and mu_v are the biases, (K + 1 [+ K2], G n_kv d): index them with
        reuse_x[code].bias_rows(token_ids, bigram keys)."""
        key = ("hidden", tuple(self.plan), dtype)
        if key not in self.derived:
            codes = self.hidden_codes()
            tabled = self._all_or_none(tuple(l for ls in codes.values() for l in ls), "table", "token tables")
            side = lambda x: x.movedim(0, -2).flatten(-2).contiguous()   # noqa: E731  (G, ..., m) -> (..., G m)
            out = {}
            for code, ls in codes.items():
                dec_k, dec_v = self._hidden_halves(tuple(ls), dtype, lambda c: c.dec)
                mu_k, mu_v = self._hidden_halves(tuple(ls), dtype, lambda c: c.biases() if tabled else c.mu_b)
                out[code] = (ls, side(dec_k), side(mu_k), side(dec_v), side(mu_v))
            self.derived[key] = out
        return self.derived[key]

    def hidden_bigrams(self, layers: tuple[int, ...]) -> bool:
        """Whether the given hidden layers' codes carry bigram tables (all of them or none)."""
        return self._all_or_none(layers, "bigram", "bigram tables")

    @property
    def reuse_ranks(self) -> dict[str, int]:
        """The ranks of its Reuse codes: {"r_x": ...} for hidden-state codes, else {"r_k": ..., "r_v": ...}."""
        if not (self.reuse_x or self.reuse_k):
            return {}                               # an exact plan: nothing learned, one level
        return {"r_x": self.r_x} if self.reuse_x else {"r_k": self.r_k, "r_v": self.r_v}

    @property
    def levels(self) -> list[dict[str, int]]:
        """The Reuse ranks of the codes this artifact serves, smallest first, the full ranks last: LEVELS of
        each rank, rounded (at least 1). Patch codes are always sent whole."""
        out: list[dict[str, int]] = []
        for f in LEVELS:
            level = {k: max(1, round(r * f)) for k, r in self.reuse_ranks.items()}
            if level not in out:
                out.append(level)
        return out

    @property
    def servable_levels(self) -> list[dict[str, int]]:
        """The levels a link may be sent: those whose held-out KL passed the quality gate at calibration
        (`info["levels"][i]["servable"]`; every level when that was not recorded). The full code always."""
        failed = [{k: v for k, v in e.items() if k.startswith("r_")} for e in self.info.get("levels", [])
                  if not e.get("servable", True)]
        return [lv for lv in self.levels[:-1] if lv not in failed] + self.levels[-1:]

    @property
    def reuse_kind(self) -> str:
        """What a Reuse-only plan of this artifact uses: "hidden" if it has hidden-state codecs, else "reuse"."""
        return "hidden" if self.reuse_x else "reuse"

    def with_plan(self, plan: list[str], entry_align: dict[int, LinearCodec] | None = None) -> "PairArtifacts":
        """The same learned tensors under another layer plan (e.g. Reuse-only), with `entry_align` (default: those
        of its own entries that the new plan enters too)."""
        if entry_align is None:
            entry_align = {l: a for l, a in self.entry_align.items() if plan[l] == "entry"}
        return dataclasses.replace(self, plan=list(plan), wire_plan=[], wire_x_codes=None, derived={},
                                   entry_align=dict(entry_align))

    def with_tail(self, tokens: int, of: int = 0, rule: str = "last") -> "PairArtifacts":
        """The same artifact with the consumer running `tokens` of the prefix's tokens itself (tail_tokens), or
        with `of`, that share of a prefix of `of` tokens at every length (tail_of): its last ones, or with
        rule "attention" the ones its last attend to most, with "learned" the ones its selector scores highest
        (tail_rule)."""
        return dataclasses.replace(self, tail_tokens=tokens, tail_of=of if tokens else 0,
                                   tail_rule=rule if tokens else "last")

    def tail_for(self, tokens: int) -> int:
        """How many of a prefix's last tokens the consumer runs itself, for a prefix of `tokens` (at least one
        where the artifact has a tail)."""
        if not self.tail_tokens or not self.tail_of:
            return self.tail_tokens
        return max(1, round(self.tail_tokens * tokens / self.tail_of))

    def at_level(self, level: dict[str, int]) -> "PairArtifacts":
        """The artifact whose full code is `level` of this one's (one of self.levels): the encoders' leading
        columns and the decoders' leading rows, which is what a link sent that level decodes with (nested
        codes), so the served code is that level and its own levels are fractions of it."""
        if level not in self.levels:
            raise ValueError(f"{level_tag(level)} is not a level of {self.pair} ({[level_tag(lv) for lv in self.levels]})")
        cut = lambda codecs, r: {l: dataclasses.replace(c, enc=c.enc[:, :r].contiguous(),  # noqa: E731
                                                        dec=c.dec[:r].contiguous()) for l, c in codecs.items()}
        ranks = {**{"r_k": self.r_k, "r_v": self.r_v, "r_x": self.r_x}, **level}
        return dataclasses.replace(self, r_k=ranks["r_k"], r_v=ranks["r_v"], r_x=ranks["r_x"], derived={},
                                   reuse_k=cut(self.reuse_k, ranks["r_k"]), reuse_v=cut(self.reuse_v, ranks["r_v"]),
                                   reuse_x=cut(self.reuse_x, ranks["r_x"]),
                                   info={k: v for k, v in self.info.items() if k != "levels"})

    def to(self, device) -> "PairArtifacts":
        """A copy whose tensors live on `device` (where the model that uses them runs)."""
        move = lambda d: {l: c.to(device) for l, c in d.items()}  # noqa: E731
        return dataclasses.replace(self, plan=list(self.plan), reuse_k=move(self.reuse_k), reuse_v=move(self.reuse_v),
                                   patch_enc=move(self.patch_enc), derived={},
                                   aligners={l: g.to(device) for l, g in self.aligners.items()},
                                   reuse_x=move(self.reuse_x), entry_align=move(self.entry_align),
                                   klt_k=move(self.klt_k), klt_v=move(self.klt_v))

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for l, c in self.reuse_k.items():
            out.update(c.tensors(f"reuse.{l}.k"))
        for l, c in self.reuse_v.items():
            out.update(c.tensors(f"reuse.{l}.v"))
        for l, c in self.reuse_x.items():
            out.update(c.tensors(f"hidden.{l}"))
        for l, c in self.patch_enc.items():
            out.update(c.tensors(f"patch.{l}.enc"))
        for l, g in self.aligners.items():
            out.update({f"patch.{l}.aligner.{k}": v for k, v in g.state_dict().items()})
        for l, c in self.entry_align.items():
            out.update(c.tensors(f"entry.{l}"))
        for l in self.klt_k:
            out.update({**self.klt_k[l].tensors(f"klt.{l}.k"), **self.klt_v[l].tensors(f"klt.{l}.v")})
        if self.selector is not None:
            out["selector"] = self.selector
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}

    def description(self) -> dict:
        return {"format_version": FORMAT_VERSION, "pair": self.pair, "spec": asdict(self.spec),
                "r_k": self.r_k, "r_v": self.r_v, "r_h": self.r_h, "aligner_width": self.aligner_width,
                "aligner_context": self.aligner_context, "aligner_tokens": self.aligner_tokens,
                "aligner_window": self.aligner_window, "r_x": self.r_x, "code_dtype": self.code_dtype,
                "x_groups": self.x_groups, "plan": self.plan, "info": self.info,
                **({"tail_tokens": self.tail_tokens} if self.tail_tokens else {}),
                **({"tail_of": self.tail_of} if self.tail_of else {}),
                **({"tail_rule": self.tail_rule} if self.tail_rule != "last" else {}),
                **({"selector_layers": self.selector_layers} if self.selector is not None else {})}

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors(), str(d / "tensors.safetensors"))
        (d / "artifact.json").write_text(json.dumps(self.description(), indent=2))

    @classmethod
    def from_parts(cls, desc: dict, t: dict[str, torch.Tensor]) -> "PairArtifacts":
        if desc.get("format_version") != FORMAT_VERSION:
            raise IncompatibleArtifact(f"artifact format {desc.get('format_version')!r} was written by another SCD "
                                       f"Serve build (this one reads format {FORMAT_VERSION}): recalibrate the pair")
        spec = ModelSpec(**desc["spec"])
        layers = lambda pre: sorted({int(k.split(".")[1]) for k in t if k.startswith(pre)})  # noqa: E731
        reuse_k = {l: LinearCodec.from_tensors(t, f"reuse.{l}.k") for l in layers("reuse.")}
        reuse_v = {l: LinearCodec.from_tensors(t, f"reuse.{l}.v") for l in layers("reuse.")}
        reuse_x = {l: LinearCodec.from_tensors(t, f"hidden.{l}") for l in layers("hidden.")}
        patch_enc, aligners = {}, {}
        for l in layers("patch."):
            if f"patch.{l}.enc.dec" not in t:
                continue                    # a family's shared encoder of a layer that only other members Patch
            patch_enc[l] = LinearCodec.from_tensors(t, f"patch.{l}.enc")
            g = Aligner(desc["r_h"], spec.hidden_size, desc["aligner_width"], desc.get("aligner_context", 1),
                        desc.get("aligner_tokens", 0), desc.get("aligner_window", 8))
            pre = f"patch.{l}.aligner."
            g.load_state_dict({k[len(pre):]: v for k, v in t.items() if k.startswith(pre)})
            aligners[l] = g.eval()
        entry_align = {l: LinearCodec.from_tensors(t, f"entry.{l}") for l in layers("entry.")}
        klt_k = {l: LinearCodec.from_tensors(t, f"klt.{l}.k") for l in layers("klt.")}
        klt_v = {l: LinearCodec.from_tensors(t, f"klt.{l}.v") for l in layers("klt.")}
        return cls(desc["pair"], spec, desc["r_k"], desc["r_v"], desc["r_h"], desc["aligner_width"], desc["plan"],
                   reuse_k, reuse_v, patch_enc, aligners, desc.get("info", {}), desc.get("aligner_context", 1),
                   desc.get("aligner_tokens", 0), desc.get("aligner_window", 8), desc.get("r_x", 0), reuse_x,
                   desc.get("code_dtype", "fp16"), [list(g) for g in desc.get("x_groups", [])],
                   entry_align=entry_align, klt_k=klt_k, klt_v=klt_v, tail_tokens=desc.get("tail_tokens", 0),
                   tail_of=desc.get("tail_of", 0), tail_rule=desc.get("tail_rule", "last"), selector=t.get("selector"),
                   selector_layers=list(desc.get("selector_layers", [])))

    @classmethod
    def load(cls, directory: str | Path) -> "PairArtifacts":
        d = Path(directory)
        return cls.from_parts(json.loads((d / "artifact.json").read_text()), load_file(str(d / "tensors.safetensors")))
