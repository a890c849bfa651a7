"""Evaluation harness: every method on the same held-out samples, measured against the oracle in one run.

A sample is a prefix (what gets cached) plus a continuation fed on top of the cache. KL/TV/top-1 compare
the next-token distributions over the teacher-forced continuation; greedy agreement compares N generated
tokens (32 by default), position by position; QA samples also generate an answer after their question and
score F1/EM against the gold span.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
from tqdm import tqdm

from scd.evaluation import metrics
from scd.evaluation.methods import Built, DroidSpeak, Method, Oracle, built_for
from scd.online import cache, decode
from scd.online.trace import capture

DECODE_BATCH = 8      # methods of a sample built and decoded together: their caches are held at once


@dataclass
class Sample:
    prefix: torch.Tensor                    # (T,) token ids, cached
    cont: torch.Tensor                      # (N,) teacher-forced continuation (QA: question + answer)
    question: torch.Tensor | None = None    # (S,) QA only: the suffix the answer is generated after
    answer: str | None = None               # QA only: gold span


def reader_of(s: Sample) -> torch.Tensor | None:
    """The request's tokens after a sample's prefix, (1, n), as a method that reads them takes them (a QA
    sample's question); None for a text window."""
    return None if s.question is None else s.question[None]


@dataclass
class SampleResult:
    method: str
    kl: float
    tv: float
    top1: float
    nll: float
    greedy: float
    f1: float | None
    em: float | None
    payload_bytes: int
    consumer_ms: float
    oracle_ms: float
    raw_bytes: int
    producer_ms: float = 0.0        # the producer's work after its prefill (SCD's encode)
    entry_bytes: int = 0            # E-first: the payload's entry part, sent first
    block_ms: float = 0.0           # the consumer's own layers (of consumer_ms), startable once the entry is in
    tail_ms: float = 0.0            # the positions it runs through every layer (of consumer_ms), after the rest


class Evaluator:
    def __init__(self, producer, consumer, tokenizer=None, greedy_tokens: int = 32, answer_tokens: int = 12):
        self.producer, self.consumer, self.tok = producer, consumer, tokenizer
        self.greedy_tokens, self.answer_tokens = greedy_tokens, answer_tokens
        # an answer ends at a newline or at a special token (a chat model's end of turn)
        self.stop = set() if tokenizer is None else {
            i for t, i in tokenizer.get_vocab().items() if "\n" in tokenizer.convert_tokens_to_string([t])
        } | set(tokenizer.all_special_ids)

    def _answer(self, out: list[int]) -> str:
        """An answer's text: its generated tokens up to a stop token."""
        cut = next((i for i, t in enumerate(out) if t in self.stop), len(out))
        return self.tok.decode(out[:cut])

    @staticmethod
    def _generate(model, kvs: list, mask: torch.Tensor, first: torch.Tensor, n: int) -> list[list[int]]:
        """Greedy tokens after `first` (1, S) over each of several caches of one prefix (`mask` (1, T)), decoded
        together: caches of one shape and dtype share a batch, as rows of the serving engines' decode loop."""
        out: list[list[int] | None] = [None] * len(kvs)
        groups: dict[tuple, list[int]] = {}
        for i, kv in enumerate(kvs):
            groups.setdefault(tuple((k.shape, k.dtype, v.shape, v.dtype) for k, v in kv), []).append(i)
        for idx in groups.values():
            kv = [(torch.cat([kvs[i][l][0] for i in idx]), torch.cat([kvs[i][l][1] for i in idx]))
                  for l in range(len(kvs[idx[0]]))]
            got = decode.generate(model, cache.assemble(model, kv), mask.expand(len(idx), -1),
                                  first.expand(len(idx), -1), n)
            for row, i in zip(got.tolist(), idx):
                out[i] = row
        return out

    def _said(self, model, kvs: list, mask: torch.Tensor, s: Sample) -> list[tuple[list[int], list[int] | None]]:
        """Per cache of `kvs`: (its greedy tokens after the question, or the continuation's first token; its
        answer's tokens after the question, None for a sample that is not QA)."""
        first = (s.question if s.question is not None else s.cont[:1])[None]
        gens = self._generate(model, kvs, mask, first, self.greedy_tokens)
        qa = s.answer is not None and self.tok is not None
        answers = self._generate(model, kvs, mask, s.question[None], self.answer_tokens) if qa else [None] * len(kvs)
        return list(zip(gens, answers))

    @torch.no_grad()
    def reference(self, s: Sample) -> tuple:
        """What every method of a sample is compared with, computed once: (ids, mask, producer trace,
        oracle Built, oracle logits over the continuation)."""
        ids = s.prefix[None]
        mask = torch.ones_like(ids)
        ptrace = capture(self.producer, ids, mask, want_hidden=True)
        oracle = Oracle().build(self.consumer, ids, mask, ptrace)
        return ids, mask, ptrace, oracle, self._logits(oracle.kv, mask, s.cont)

    def _logits(self, kv, mask: torch.Tensor, cont: torch.Tensor, model=None) -> torch.Tensor:
        model = model or self.consumer
        return cache.extend(model, cache.assemble(model, kv), mask, cont[None])[0]

    @torch.no_grad()
    def kl(self, s: Sample, method: Method, ref: tuple | None = None, start: int = 0) -> float:
        """Teacher-forced KL(oracle || method) only: the cheap score used to profile a method's settings.
        Pass `ref` (from reference()) to score several settings against one oracle run; `start`: over the
        continuation's positions from there on."""
        ids, mask, ptrace, _, ref_logits = ref or self.reference(s)
        got = self._logits(built_for(method, self.consumer, ids, mask, ptrace, reader_of(s)).kv, mask, s.cont)
        return metrics.kl_tv_top1(ref_logits[:, start:], got[:, start:])[0]

    @torch.no_grad()
    def sample(self, s: Sample, methods: list[Method]) -> list[SampleResult]:
        ids, mask, ptrace, oracle, ref_logits = self.reference(s)
        raw = len(oracle.kv) * 2 * oracle.kv[0][0].numel() * 2          # all layers, K and V, bf16
        ref_gen, _ = ref = self._said(self.consumer, [oracle.kv], mask, s)[0]
        out = []
        for start in range(0, len(methods), DECODE_BATCH):
            chunk = methods[start:start + DECODE_BATCH]
            builts = [oracle if m.name == "oracle" else built_for(m, self.consumer, ids, mask, ptrace, reader_of(s))
                      for m in chunk]
            models = [getattr(m, "model", None) or self.consumer for m in chunk]   # base: the producer decodes
            said = {i: ref for i, m in enumerate(chunk) if m.name == "oracle"}
            for model in {id(m): m for m in models}.values():         # the methods of one model in one batch
                idx = [i for i, m in enumerate(models) if m is model and i not in said]
                said.update(zip(idx, self._said(model, [builts[i].kv for i in idx], mask, s)))
            for i, (m, built, model) in enumerate(zip(chunk, builts, models)):
                logits = self._logits(built.kv, mask, s.cont, model)
                kl, tv, top1 = metrics.kl_tv_top1(ref_logits, logits)
                gen, answer = said[i]
                f1, em = metrics.f1_em(self._answer(answer), s.answer) if answer is not None else (None, None)
                out.append(SampleResult(m.name, kl, tv, top1, metrics.nll(logits[0, :-1], s.cont[1:]),
                                        metrics.greedy_agreement(torch.tensor([ref_gen]), torch.tensor([gen])), f1,
                                        em, built.payload_bytes, built.consumer_ms, oracle.consumer_ms, raw,
                                        built.phases.get("encode_ms", 0.0), built.entry_bytes,
                                        built.phases.get("recompute_ms", 0.0), built.phases.get("tail_ms", 0.0)))
        return out

    def run(self, samples: list[Sample], methods: list[Method], desc: str = "eval", cost_tokens: int = 0,
            cost_repeats: int = 3) -> list[dict]:
        per = [r for s in tqdm(samples, desc=desc) for r in self.sample(s, methods)]
        rows = summarize(per, [m.name for m in methods])
        if cost_tokens:
            costs = self.cost(samples, methods, cost_tokens, cost_repeats)
            for r in rows:
                at = costs[r["method"]]
                r["cost_tokens"], r["cost_ratio"] = cost_tokens, at["ratio"] if at else None
                r["at_cost_tokens"] = at
        return rows

    @torch.no_grad()
    def cost(self, samples: list[Sample], methods: list[Method], tokens: int, repeats: int = 3) -> dict:
        """Each method's costs on one prefix of `tokens` tokens (the held-out prefixes end to end), measured side
        by side: the methods and the oracle's prefill take turns, `repeats` times; medians. Per method:
        {"ratio": consumer compute over the consumer's own prefill, "consumer_ms", "producer_ms" (encode),
        "payload_bytes", "entry_bytes", "block_ms", "tail_ms"} (what a modeled TTFT at that length needs); None for a
        method without a model (base)."""
        ids = torch.cat([s.prefix for s in samples])
        while ids.numel() < tokens:
            ids = torch.cat([ids, ids])
        ids = ids[:tokens][None]
        mask = torch.ones_like(ids)
        ptrace = capture(self.producer, ids, mask, want_hidden=True)
        runs: dict[str, list[Built]] = {m.name: [] for m in methods}
        prefill = []
        for _ in tqdm(range(repeats), desc=f"cost at {tokens} tokens"):
            prefill.append(Oracle().build(self.consumer, ids, mask, ptrace).consumer_ms)
            for m in methods:
                if m.name not in ("oracle", "base"):
                    runs[m.name].append(built_for(m, self.consumer, ids, mask, ptrace, reader_of(samples[0])))
        own = statistics.median(prefill)
        out = {}
        for name, built in runs.items():
            if name == "oracle":
                out[name] = {"ratio": 1.0, "consumer_ms": own, "producer_ms": 0.0, "payload_bytes": 0,
                             "entry_bytes": 0, "block_ms": 0.0, "tail_ms": 0.0}
                continue
            if not built:
                out[name] = None
                continue
            med = lambda f: statistics.median(map(f, built))                  # noqa: E731
            consumer = med(lambda b: b.consumer_ms)
            out[name] = {"ratio": consumer / own, "consumer_ms": consumer,
                         "producer_ms": med(lambda b: b.phases.get("encode_ms", 0.0)),
                         "payload_bytes": built[0].payload_bytes, "entry_bytes": built[0].entry_bytes,
                         "block_ms": med(lambda b: b.phases.get("recompute_ms", 0.0)),
                         "tail_ms": med(lambda b: b.phases.get("tail_ms", 0.0))}
        return out


def summarize(results: list[SampleResult], order: list[str]) -> list[dict]:
    """One row per method: means over samples (and each sample's KL, "kls", in the samples' order); ratios of
    totals for payload and time (same run)."""
    rows = []
    for name in order:
        rs = [r for r in results if r.method == name]
        mean = lambda f: statistics.fmean(getattr(r, f) for r in rs)  # noqa: E731
        qa = [r for r in rs if r.f1 is not None]
        consumer = statistics.median(r.consumer_ms for r in rs)
        oracle = statistics.median(r.oracle_ms for r in rs)
        rows.append({
            "method": name, "payload_bytes": round(mean("payload_bytes")),
            "payload_ratio": sum(r.payload_bytes for r in rs) / sum(r.raw_bytes for r in rs),
            "kl": mean("kl"), "kls": [r.kl for r in rs], "tv": mean("tv"), "top1": mean("top1"), "greedy": mean("greedy"),
            "ppl": float(torch.tensor(mean("nll")).exp()),
            "f1": statistics.fmean(r.f1 for r in qa) if qa else None,
            "em": statistics.fmean(r.em for r in qa) if qa else None,
            "consumer_ms": consumer, "prefill_ratio": consumer / oracle, "samples": len(rs),
            "producer_ms": statistics.median(r.producer_ms for r in rs),
            "entry_bytes": round(mean("entry_bytes")), "block_ms": statistics.median(r.block_ms for r in rs),
            "tail_ms": statistics.median(r.tail_ms for r in rs)})
    return retained_gain(rows)


def retained_gain(rows: list[dict]) -> list[dict]:
    """Each row's share of what the specialist adds over the base model alone: (method - base) / (oracle -
    base) of the task figure (F1 for QA, else the perplexity's log, lower is better). 1: the specialist's
    full gain; 0: no better than serving the base. None without both an oracle and a base row, or when the
    specialist adds nothing to measure (oracle == base)."""
    by = {r["method"]: r for r in rows}
    oracle, base = by.get("oracle"), by.get("base")
    for r in rows:
        r["retained_gain"] = None
        if oracle is None or base is None:
            continue
        if oracle["f1"] is not None:
            span, got = oracle["f1"] - base["f1"], r["f1"] - base["f1"]
        else:
            span, got = math.log(base["ppl"]) - math.log(oracle["ppl"]), math.log(base["ppl"]) - math.log(r["ppl"])
        r["retained_gain"] = got / span if abs(span) > 1e-9 else None
    return rows


def table(rows: list[dict], title: str = "") -> str:
    """Plain-text table shaped like the paper's Table 2."""
    head = f"{'method':<11} {'payload KB':>10} {'ratio':>6} {'KL':>7} {'TV':>6} {'top-1':>6} {'greedy':>6} " \
           f"{'PPL':>7} {'F1':>6} {'EM':>6} {'gain':>6} {'cons ms':>8} {'/prefill':>8}" + \
           (f" {'@' + str(rows[0]['cost_tokens']):>7}" if rows and rows[0].get("cost_tokens") else "")
    lines = ([title] if title else []) + [head, "-" * len(head)]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        lines.append(f"{r['method']:<11} {r['payload_bytes'] / 1024:>10.1f} {r['payload_ratio']:>6.3f} {r['kl']:>7.4f} "
                     f"{r['tv']:>6.3f} {r['top1']:>6.3f} {r['greedy']:>6.3f} {r['ppl']:>7.2f} {fmt(r['f1'], '>6.3f')} "
                     f"{fmt(r['em'], '>6.3f')} {fmt(r.get('retained_gain'), '>6.3f')} {r['consumer_ms']:>8.2f} "
                     f"{r['prefill_ratio']:>8.3f}" + (f" {fmt(r['cost_ratio'], '>7.3f')}" if r.get("cost_tokens") else ""))
    return "\n".join(lines)


def profile_droidspeak(ds: DroidSpeak, producer, consumer, val) -> int:
    """DroidSpeak picks its own recompute block: the start with the lowest KL on validation samples. A block
    starts at layer 1 at the earliest, so a model of L layers recomputes at most L - 1 of them."""
    ds.n = min(ds.n, producer.config.num_hidden_layers - 1)
    ev = Evaluator(producer, consumer)
    refs = [ev.reference(v) for v in val]                 # one oracle run per sample, shared by every start
    best = None
    for s in range(1, producer.config.num_hidden_layers - ds.n + 1):
        ds.start = s
        kl = sum(ev.kl(v, ds, ref) for v, ref in zip(val, refs)) / len(val)
        ds.profile[s] = kl
        best = s if best is None or kl < ds.profile[best] else best
    return best
