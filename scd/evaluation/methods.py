"""Every way a consumer can get a KV cache for a prefix, behind one interface.

A method turns a prefix (token ids + mask, and the producer's trace computed once and shared) into the
consumer's per-layer (K, V), the bytes that had to cross the wire, and the consumer-side time:
  oracle      the consumer prefills the prefix itself (the reference; payload 0)
  base        no specialist: the producer answers on its own cache (the floor that retained gain starts from)
  raw_kv      the producer's KV as is, bf16 on the wire
  int4_kv     the producer's KV, group-wise asymmetric int4
  droidspeak  producer KV except a contiguous block of layers the consumer recomputes from the producer's
              hidden state entering the block (block chosen by profiling on calibration prefixes)
  reuse_only  SCD codes with every layer (but exact layer 0) rebuilt by Reuse
  scd         SCD codes: Reuse + Patch by the artifact's plan
  exact       a consumer that shares layers [0, s) with the producer: those layers' K, V and the residual
              entering s as they are (bf16; exact_int8: int8; exact_kivi4: keys int4 per channel, values
              int4, the residual bf16; exact_klt: transform coded, scd.online.klt), the consumer runs
              s..L-1 itself: SCD on
              the exact plan of its structure (scd.fitting.structure), through the same wire format
  <method>+<rule>@<f>  another method's cache repaired by selective token recompute at a share f of the
              prefix's positions (Selective; scd.online.selective)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from scd.online import codec, e_first, selective
from scd.online.artifacts import PairArtifacts, exact_plan, level_tag
from scd.online.rebuild import encode, rebuild
from scd.online.recompute import run_layers
from scd.online.trace import Trace, capture
from scd.settings import select_window_pass

KV = tuple[torch.Tensor, torch.Tensor]
METHODS = ("oracle", "base", "raw_kv", "int4_kv", "droidspeak", "reuse_only", "scd", "exact", "exact_int8",
           "exact_kivi4", "exact_klt")


@dataclass
class Built:
    kv: list[KV]
    payload_bytes: int
    consumer_ms: float
    phases: dict[str, float] = field(default_factory=dict)
    entry_bytes: int = 0             # E-first: the payload's entry part (sent first; part of payload_bytes)


class Method:
    name = "method"
    reads_request = False      # build takes the request's tokens after the prefix (reader=): built_for

    def build(self, consumer, ids: torch.Tensor, mask: torch.Tensor, producer_trace: Trace) -> Built:
        raise NotImplementedError


def built_for(m: Method, consumer, ids: torch.Tensor, mask: torch.Tensor, producer_trace: Trace,
              reader: torch.Tensor | None) -> Built:
    """m's cache of the prefix `ids`; `reader` (B, n): the request's tokens after it (a QA sample's question),
    given to a method that reads them (a plan repaired by the suffix rule)."""
    if not m.reads_request:
        return m.build(consumer, ids, mask, producer_trace)
    if reader is None:
        raise ValueError(f"{m.name} reads the request's tokens after the prefix: a sample without a question "
                         f"has none")
    return m.build(consumer, ids, mask, producer_trace, reader=reader)


class BaseAlone(Method):
    """No specialist at all: the producer (the base model) answers on its own cache. Not a way to serve the
    consumer, the floor of what a specialist adds: retained gain is measured from it (evaluate.summarize)."""
    name = "base"

    def __init__(self, producer):
        self.model = producer                     # the Evaluator decodes this method with this model

    def build(self, consumer, ids, mask, producer_trace):
        return Built(list(zip(producer_trace.keys, producer_trace.values)), 0, 0.0)


class Oracle(Method):
    name = "oracle"

    def build(self, consumer, ids, mask, producer_trace):
        t = time.perf_counter()
        tr = capture(consumer, ids, mask, want_xnorm=False)
        return Built(list(zip(tr.keys, tr.values)), 0, (time.perf_counter() - t) * 1e3)


def _bf16_bytes(kv_shape: tuple[int, ...], layers: int) -> int:
    b, h, t, d = kv_shape
    return layers * 2 * b * h * t * d * 2


class RawKV(Method):
    name = "raw_kv"

    def build(self, consumer, ids, mask, producer_trace):
        wire = [(k.bfloat16(), v.bfloat16()) for k, v in zip(producer_trace.keys, producer_trace.values)]
        t = time.perf_counter()
        kv = [(k.float(), v.float()) for k, v in wire]
        return Built(kv, _bf16_bytes(tuple(wire[0][0].shape), len(wire)), (time.perf_counter() - t) * 1e3)


def int4_roundtrip(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """Asymmetric int4 with an fp16 scale and zero per `group` values of the last dim. (dequantized, bytes)."""
    g = x.reshape(-1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
    lo = lo.half().float()
    q = torch.round((g - lo) / scale).clamp(0, 15)
    return (q * scale + lo).reshape(x.shape), g.numel() // 2 + g.shape[0] * 4


class Int4KV(Method):
    name = "int4_kv"

    def __init__(self, group: int = 32):
        self.group = group

    def build(self, consumer, ids, mask, producer_trace):
        t = time.perf_counter()
        kv, nbytes = [], 0
        group = min(self.group, producer_trace.keys[0].shape[-1])
        for k, v in zip(producer_trace.keys, producer_trace.values):
            (kq, nk), (vq, nv) = int4_roundtrip(k, group), int4_roundtrip(v, group)
            kv.append((kq, vq))
            nbytes += nk + nv
        # the quantize half runs on the producer; time it all as consumer work (an upper bound, it is tiny)
        return Built(kv, nbytes, (time.perf_counter() - t) * 1e3)


class DroidSpeak(Method):
    """Reuse the producer's KV everywhere except layers [start, start+n), which the consumer recomputes."""
    name = "droidspeak"

    def __init__(self, n_layers: int = 2, start: int | None = None):
        self.n, self.start = n_layers, start
        self.profile: dict[int, float] = {}

    @classmethod
    def entering(cls, entry: int, num_layers: int) -> "DroidSpeak":
        """DroidSpeak entered at `entry`: the consumer runs its layers entry..num_layers-1 from the producer's
        residual (a recompute block's entry without an aligner), named droidspeak@<entry>."""
        ds = cls(num_layers - entry, entry)
        ds.name = f"droidspeak@{entry}"
        return ds

    def recompute(self, consumer, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Run the consumer's layers of the block over the prefix from the producer's hidden state."""
        return run_layers(consumer, hidden, mask, positions, self.start, self.start + self.n)

    def build(self, consumer, ids, mask, producer_trace):
        if self.start is None:
            raise RuntimeError("droidspeak needs its block chosen (profile it, or pass start=)")
        tr = producer_trace
        s, e = self.start, self.start + self.n
        t = time.perf_counter()
        block = self.recompute(consumer, tr.hidden[s], mask, tr.positions)
        kv = list(zip(tr.keys, tr.values))
        kv[s:e] = block
        ms = (time.perf_counter() - t) * 1e3
        b, _, tok, _ = tr.keys[0].shape
        entry = b * tok * tr.hidden[s].shape[-1] * 2          # the residual at s, sent first (E-first)
        return Built(kv, _bf16_bytes(tuple(tr.keys[0].shape), len(kv) - self.n) + entry, ms, {"recompute_ms": ms}, entry)


class Selective(Method):
    """Another method's cache repaired by selective token recompute (scd.online.selective): the consumer runs
    every layer for `fraction` of the prefix's positions, chosen by `rule` (the learned one by `selector`:
    (weights, layers)); named <inner>+<rule>@<fraction>."""

    def __init__(self, inner: Method, rule: str, fraction: float, tok=None, layers: int = 1,
                 selector: tuple | None = None):
        self.inner, self.rule, self.fraction, self.tok, self.layers = inner, rule, fraction, tok, layers
        self.selector = selector
        self.name = f"{inner.name}+{rule}@{fraction:g}"
        self.spent: dict[int, list[float]] = {}         # prefix length -> each repaired row's counted share

    @property
    def reads_request(self) -> bool:
        return self.rule == "suffix" or self.inner.reads_request

    def build(self, consumer, ids, mask, producer_trace, reader: torch.Tensor | None = None):
        built = built_for(self.inner, consumer, ids, mask, producer_trace, reader)
        t = time.perf_counter()
        kv, sel = selective.repair(consumer, built.kv, ids, mask, self.rule, self.fraction, self.tok, self.layers,
                                   self.selector, reader)
        ms = (time.perf_counter() - t) * 1e3
        window = reader.shape[-1] if self.rule == "suffix" else None
        self.spent.setdefault(ids.shape[1], []).extend(self._cost(consumer.config, ids.shape[1], row.tolist(), window)
                                                       for row in sel)
        return Built(kv, built.payload_bytes, built.consumer_ms + ms, {**built.phases, "selective_ms": ms},
                     built.entry_bytes)

    def _cost(self, config, t: int, columns: list[int] | None = None, window: int | None = None) -> float:
        """`window`: the tokens run first to choose (the suffix rule's request; the attention rule's last ones)."""
        if window is None:
            window = selective.WINDOW if self.rule in ("attention", "suffix") else 0
        s = len(columns) if columns is not None else max(selective.count_for(torch.ones(1, t), self.fraction),
                                                          selective.WINDOW if self.rule == "attention" else 0)
        if self.rule == "attention":
            window = select_window_pass(s)
        return selective.cost(config, t, s, self.layers if self.rule == "deviation" else 0, window, columns)

    def counted(self, config, t: int) -> float:
        """The repair's multiply-adds over a prefix of t positions as a share of the consumer's own prefill
        (`config`: its transformers config; the deviation rule's first layers and the attention rule's window
        included, the inner method's compute not): the mean over the rows it repaired at that length, or, before
        any, the most its selection can cost."""
        spent = self.spent.get(t)
        return sum(spent) / len(spent) if spent else self._cost(config, t)


def sync() -> None:
    """Wait for the GPU's queued work (where CUDA is in use), so that a wall-clock timer around it counts it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class SCDMethod(Method):
    """Codes through the real wire format: producer encode -> bytes -> consumer decode + rebuild."""

    def __init__(self, art: PairArtifacts, name: str = "scd", dtype: str | None = None, artifact_id: str = "local",
                 level: dict[str, int] | None = None, encoder: PairArtifacts | None = None, wire: bool = False):
        """dtype: the codes' wire precision (default: the one the artifact was calibrated for); level: the Reuse
        ranks sent, one of art.levels (default: the full ones); encoder: what the producer encodes with, when
        not art (a family member's: FamilyArtifacts.encoder); wire: the payload stays on the codes' device
        (`codec.encode_wire`, as a producer sends it over Ray Direct Transport) instead of host bytes (as over
        the object store)."""
        self.art, self.name, self.dtype, self.artifact_id = art, name, dtype or art.code_dtype, artifact_id
        self.level, self.encoder, self.wire = level, encoder or art, wire

    @property
    def reads_request(self) -> bool:
        return bool(self.art.tail_tokens) and self.art.tail_rule == "suffix"

    def build(self, consumer, ids, mask, producer_trace, reader: torch.Tensor | None = None):
        sync()
        t0 = time.perf_counter()
        dims = codec.artifact_dims(self.art, self.level)
        codes = encode(self.encoder, producer_trace, ids, self.level)
        # as the producer sends it: E-first (entry part, then the rest) where the plan enters a block
        split = self.encoder is self.art and e_first.part_plans(self.art.payload_plan) is not None
        args = (self.art.pair, self.artifact_id)
        payload = e_first.encode_parts(codes, *args, dims, self.dtype, wire=self.wire) if split else \
            (codec.encode_wire if self.wire else codec.encode)(codes, *args, dims, self.dtype)
        sync()
        t1 = time.perf_counter()
        codes = (e_first.decode_parts if split else codec.decode)(payload, *args, self.art.payload_plan, dims,
                                                                   self.art.x_codes)
        codes = codes.to(next(consumer.parameters()).device)     # host bytes decode on the host: the copy counts
        sync()
        t2 = time.perf_counter()
        kv, phases = rebuild(consumer, self.art, codes, reader=reader)
        sync()
        t3 = time.perf_counter()
        phases = {"encode_ms": (t1 - t0) * 1e3, "decode_ms": (t2 - t1) * 1e3, **phases}
        return Built(kv, len(payload), (t3 - t1) * 1e3, phases, len(payload.entry) if split else 0)


def level_name(art: PairArtifacts, level: dict[str, int]) -> str:
    """The method name of SCD at one of art's levels: "scd" for the full code, else e.g. "scd@r_x=72"."""
    return "scd" if level == art.levels[-1] else f"scd@{level_tag(level)}"


def at_levels(art: PairArtifacts) -> list[SCDMethod]:
    """SCD at each level the artifact serves but the full one (named by level_name): the nested codes'
    (payload, KL) ladder."""
    return [SCDMethod(art, level_name(art, lv), level=lv) for lv in art.levels[:-1]]


def reuse_only(art: PairArtifacts) -> SCDMethod:
    plan = ["exact" if k == "exact" else art.reuse_kind for k in art.plan]
    return SCDMethod(art.with_plan(plan), name="reuse_only")


def exact(pair: str, spec, first_adapted: int, code_dtype: str = "bf16", whole_prefix: bool = False,
          klt_codes: tuple[dict, dict] | None = None) -> SCDMethod:
    """SCD on the exact plan of a consumer that shares layers [0, first_adapted) with its producer (or, with
    whole_prefix, the whole prefix's cache: an activated LoRA): "exact" at bf16, else "exact_<dtype>" (klt:
    with the transform codes `klt_codes`, scd.fitting.exact.klt_codecs)."""
    art = PairArtifacts.exact(pair, spec, exact_plan(spec.num_layers, first_adapted, whole_prefix), code_dtype,
                              klt=klt_codes)
    return SCDMethod(art, "exact" if code_dtype == "bf16" else f"exact_{code_dtype}")
