"""Quality metrics of a method against the oracle (the consumer's own prefill)."""
from __future__ import annotations

import re
from collections import Counter

import torch


def kl_tv_top1(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[float, float, float]:
    """Mean per-position KL(p || q) in nats, total variation and top-1 agreement; logits (..., V)."""
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    tv = 0.5 * (lp.exp() - lq.exp()).abs().sum(-1)
    top1 = (p_logits.argmax(-1) == q_logits.argmax(-1)).double()
    return kl.mean().item(), tv.mean().item(), top1.mean().item()


def nll(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats/token) of labels (...,) under logits (..., V); exp() = perplexity."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1)).item()


def greedy_agreement(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Fraction of positions where two generated sequences agree."""
    n = min(ref.shape[-1], got.shape[-1])
    return (ref[..., :n] == got[..., :n]).double().mean().item() if n else 1.0


def _words(s: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", s.lower()).split()


def f1_em(prediction: str, gold: str) -> tuple[float, float]:
    """SQuAD-style token F1 and exact match on lower-cased, punctuation-stripped words."""
    p, g = _words(prediction), _words(gold)
    common = sum((Counter(p) & Counter(g)).values())
    em = float(p == g)
    if not p or not g or common == 0:
        return float(p == g), em
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec), em
