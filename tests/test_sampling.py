"""The sampler: `pick` draws from softmax(logits / T), from the nucleus only when top_p < 1 (the smallest set of
most likely tokens whose mass reaches top_p, renormalised), and a seeded generator repeats its draws.

Checked by counting draws on a tiny vocabulary against the distribution they must follow, with Pearson's
chi-square: each check fails a correct sampler with probability at most ALPHA (this file makes 11 of them: at
most 1.1e-5 for all), and its draws come from fixed seeds, so a run is deterministic. Each check also shows
that it can tell: the same counts are refused against the distribution that a sampler ignoring the setting
would draw from. There is no top-k in the project (the HTTP schema takes temperature and top_p only), so
there is nothing of it to test.
"""
import math

import pytest
import torch

from scd.online import cache, trace
from scd.online.decode import generate, pick
from tests.conftest import tiny_llama

ALPHA = 1e-6                  # the chance that one check below fails a sampler that is right
N = 20_000                    # draws per check
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5])
# top-p: probabilities whose running sums (0.42 0.65 0.81 0.90 0.96 1) keep clear of the p values tested,
# placed out of order so that the nucleus is not simply the first tokens
TOP_P_PROBS = torch.tensor([0.09, 0.42, 0.04, 0.16, 0.23, 0.06], dtype=torch.float64)


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square with df degrees of freedom (closed forms for whole df)."""
    if df % 2 == 0:
        term = total = 1.0
        for i in range(1, df // 2):
            term *= x / (2 * i)
            total += term
        return math.exp(-x / 2) * total
    total, term = math.erfc(math.sqrt(x / 2)), math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
    for i in range(1, (df + 1) // 2):
        total += term
        term *= x / (2 * i + 1)
    return total


def chi2_bound(df: int, alpha: float = ALPHA) -> float:
    """The x with P(X > x) = alpha: a chi-square statistic above it has that chance under the right distribution."""
    lo, hi = 0.0, 10_000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of counts (V,) against probabilities (V,), over the cells that can be drawn."""
    n, cells = counts.sum().item(), probs > 0
    expected = n * probs[cells].double()
    return float(((counts[cells].double() - expected) ** 2 / expected).sum())


def assert_follows(counts: torch.Tensor, probs: torch.Tensor, what: str, *wrongs: torch.Tensor) -> None:
    """counts are draws from probs: nothing outside its support, and a chi-square under the ALPHA bound;
    each of `wrongs` (what a broken sampler would draw from) is refused by the same counts."""
    outside = int(counts[probs == 0].sum())
    assert outside == 0, f"{what}: {outside} of {int(counts.sum())} draws outside the support {probs.tolist()}"
    df = int((probs > 0).sum()) - 1
    if df > 0:
        stat, bound = chi2(counts, probs), chi2_bound(df)
        assert stat <= bound, (f"{what}: chi-square {stat:.1f} > {bound:.1f} (df {df}, P = {ALPHA:g} for a right "
                               f"sampler); counts {counts.tolist()}, expected {(counts.sum() * probs).tolist()}")
    for wrong in wrongs:
        refused = (counts[wrong == 0].sum() > 0) or chi2(counts, wrong) > chi2_bound(int((wrong > 0).sum()) - 1)
        assert refused, f"{what}: the check cannot tell {probs.tolist()} from {wrong.tolist()}"


def draws(logits: torch.Tensor, temperature: float, top_p: float = 1.0, seed: int = 0) -> torch.Tensor:
    """N tokens drawn for the one row of logits (V,), one pick() call over N copies."""
    g = torch.Generator().manual_seed(seed)
    return pick(logits.expand(N, -1), temperature, top_p, g)


def counts_of(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (V,) kept to the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    sp, si = probs.sort(descending=True)
    mass = sp.cumsum(0)
    assert (mass - top_p).abs().min() > 1e-3, "a top_p this close to a running sum tests float rounding"
    k = int((mass < top_p).sum()) + 1
    kept = torch.zeros_like(probs)
    kept[si[:k]] = sp[:k]
    return kept / kept.sum()


def test_temperature_zero_is_the_argmax_whatever_the_seed():
    logits = torch.randn(64, 11, generator=torch.Generator().manual_seed(0))
    for seed in (0, 1):
        assert torch.equal(pick(logits, 0.0, 0.5, torch.Generator().manual_seed(seed)), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_the_softmax_of_the_logits_over_the_temperature(temperature):
    want = torch.softmax(LOGITS.double() / temperature, -1)
    ignored = torch.softmax(LOGITS.double(), -1)              # a sampler that ignores the temperature
    counts = counts_of(draws(LOGITS, temperature), len(LOGITS))
    assert_follows(counts, want, f"T={temperature}", *([] if temperature == 1.0 else [ignored]))


def test_one_seed_repeats_its_draws_and_two_seeds_differ():
    for top_p in (1.0, 0.8):
        a, again, b = draws(LOGITS, 1.0, top_p, 0), draws(LOGITS, 1.0, top_p, 0), draws(LOGITS, 1.0, top_p, 1)
        assert torch.equal(a, again), f"top_p={top_p}: seed 0 drew differently twice"
        assert (a != b).float().mean() > 0.3, f"top_p={top_p}: seeds 0 and 1 drew the same {(a == b).float().mean():.0%}"


@pytest.mark.parametrize("top_p, temperature, size", [(0.3, 1.0, 1), (0.6, 1.0, 2), (0.75, 1.0, 3), (0.93, 1.0, 5),
                                                      (0.75, 2.0, 4)])
def test_top_p_draws_only_the_nucleus_with_renormalised_frequencies(top_p, temperature, size):
    """(0.75, T=2): the nucleus is taken after the temperature (4 tokens; before it, there would be 3)."""
    logits = TOP_P_PROBS.log().float()
    probs = torch.softmax(logits.double() / temperature, -1)
    want = nucleus(probs, top_p)
    assert int((want > 0).sum()) == size, want
    # what a sampler would draw from that did not cut, or that cut before the temperature
    wrongs = [probs]
    if temperature != 1.0:
        early = nucleus(TOP_P_PROBS, top_p) ** (1 / temperature)
        wrongs.append(early / early.sum())
    counts = counts_of(draws(logits, temperature, top_p), len(logits))
    assert_follows(counts, want, f"top_p={top_p} T={temperature}", *wrongs)


def test_the_nucleus_is_cut_per_row():
    """Rows of one batch with different distributions: each keeps its own nucleus."""
    p = TOP_P_PROBS.log().float()
    logits = torch.stack([p, p.flip(0)]).repeat(N // 2, 1)          # rows alternate between two orders
    tokens = pick(logits, 1.0, 0.6, torch.Generator().manual_seed(0)).view(-1, 2)
    for row, probs in ((0, TOP_P_PROBS), (1, TOP_P_PROBS.flip(0))):
        assert_follows(counts_of(tokens[:, row], 6), nucleus(probs, 0.6), f"row {row}")


def sharp_tiny_llama():
    """A tiny random Llama whose next-token distributions are far from uniform (its output head scaled up:
    a fresh one gives logits of std ~0.1, where every temperature draws about the same)."""
    model = tiny_llama(0)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def test_generate_samples_the_models_next_token_distribution_at_the_asked_temperature():
    """Through the decode loop the engines run: copies of one prompt, one token each (CALLS batches of ROWS,
    one generator throughout); the counts follow the model's softmax(logits / T) (cells expected under 20
    pooled into one), and are refused as draws at T = 1."""
    model, rows, calls = sharp_tiny_llama(), 64, 40
    prefix, first = torch.tensor([[5, 9, 14, 3, 22, 40]]), torch.tensor([[11]])
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prefix, first], 1)).logits[0, -1].double()
    tr = trace.capture(model, prefix, torch.ones_like(prefix))
    kv = [(k.expand(rows, -1, -1, -1).contiguous(), v.expand(rows, -1, -1, -1).contiguous())
          for k, v in zip(tr.keys, tr.values)]
    mask = torch.ones(rows, prefix.shape[1], dtype=torch.long)
    for temperature in (0.5, 2.0):
        g = torch.Generator().manual_seed(0)
        out = torch.cat([generate(model, cache.assemble(model, [(k.clone(), v.clone()) for k, v in kv]), mask,
                                  first.expand(rows, -1), 1, temperature=temperature, generator=g)[:, 0]
                         for _ in range(calls)])
        counts = counts_of(out, logits.numel())
        want, at_one = torch.softmax(logits / temperature, -1), torch.softmax(logits, -1)
        big = want * out.numel() >= 20                          # chi-square cells: the likely tokens, the rest as one
        pooled = lambda x: torch.cat([x[big], x[~big].sum(0, keepdim=True)])      # noqa: E731
        assert_follows(pooled(counts), pooled(want), f"generate at T={temperature}", pooled(at_one))


def test_generate_repeats_a_seed_and_two_seeds_differ():
    model = sharp_tiny_llama()
    prefix = torch.randint(2, 97, (4, 8), generator=torch.Generator().manual_seed(1))
    tr = trace.capture(model, prefix[:, :-1], torch.ones_like(prefix[:, :-1]))
    kv = list(zip(tr.keys, tr.values))

    def run(seed, temperature=1.0):
        return generate(model, cache.assemble(model, kv), torch.ones_like(prefix[:, :-1]), prefix[:, -1:], 12,
                        temperature=temperature, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1)), "seeds 0 and 1 generated the same tokens"
    assert torch.equal(run(0, 0.0), run(1, 0.0)), "greedy decoding depends on the seed"
