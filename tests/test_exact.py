"""Exact mode (no Ray): codes draft, the specialist's own prefill verifies. Greedy answers are the oracle's token
for token; the speculative-sampling rule keeps the oracle's distribution."""
import pytest
import torch

from actors.messages import GenParams
from engines.prefix_cache import PrefixCodeCache
from engines.specialist import SpecialistEngine
from scd.online.decode import sampling_probs, verify
from tests.test_engines import PREFIX, setup  # noqa: F401  (the module fixture: producer, specialists, tokenizer)

EOS = 1


def _oracle(eng: SpecialistEngine, prefix, suffix, params) -> str:
    return SpecialistEngine("oracle", eng.model, eng.tok).complete(prefix, suffix, None, "oracle", params)[0]


def test_verify_greedy_accepts_the_targets_argmax_and_corrects_the_first_miss():
    target = torch.full((4, 6), -5.0)
    for i, best in enumerate([2, 3, 4, 5]):
        target[i, best] = 5.0
    p = GenParams(max_tokens=10)
    assert verify([2, 3, 4], None, target, p, EOS) == (3, 5), "all drafts right: the bonus token follows"
    assert verify([2, 0, 4], None, target, p, EOS) == (1, 3), "a late miss: corrected at its position"
    assert verify([0, 3, 4], None, target, p, EOS) == (0, 2), "an early miss: nothing of the draft is kept"
    assert verify([], None, target[:1], p, EOS) == (0, 2), "no drafts: the target's own first token"
    assert verify([2, 3, 4], None, target, GenParams(max_tokens=3), EOS) == (3, None), "max_tokens reached"
    eos_first = target.clone()
    eos_first[0, EOS] = 9.0
    assert verify([2], None, eos_first, GenParams(max_tokens=10, min_tokens=1), EOS) == (1, 3), \
        "eos is masked for the target as for the draft while min_tokens are not reached"


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_speculative_sampling_keeps_the_targets_distribution(temperature, top_p):
    """A tiny vocabulary, a draft distribution q far from the target's p: the first emitted token (an accepted
    draft, or the residual's draw) is distributed as p over 20000 trials, and so is the next one after an
    accepted draft."""
    g = torch.Generator().manual_seed(0)
    target = torch.tensor([[2.0, 1.0, 0.2, -1.0, 0.5], [0.0, 1.5, -0.5, 1.0, 0.3]])
    draft = torch.tensor([[-1.0, 0.5, 2.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 2.0]])
    params = GenParams(max_tokens=8, temperature=temperature, top_p=top_p)
    p = [sampling_probs(target[i][None], temperature, top_p)[0] for i in range(2)]
    q = [sampling_probs(draft[i][None], temperature, top_p)[0] for i in range(2)]
    n, first, second = 20000, torch.zeros(5), torch.zeros(5)
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        accepted, nxt = verify([x], [q[0]], target, params, None, g)
        first[x if accepted else nxt] += 1
        if accepted:
            second[nxt] += 1
    tv = 0.5 * (first / n - p[0]).abs().sum().item()
    assert tv < 0.02, f"first token: total variation {tv:.4f} from the target's distribution {p[0].tolist()}"
    tv2 = 0.5 * (second / second.sum() - p[1]).abs().sum().item()
    assert tv2 < 0.03, f"token after an accepted draft: total variation {tv2:.4f} ({int(second.sum())} samples)"


@pytest.mark.parametrize("min_drafts", [0, 1, 6, 24])
def test_greedy_exact_answers_are_the_oracles_token_for_token(setup, min_drafts):  # noqa: F811
    """Every specialist, prefixes of 4, 12 and 30 tokens, drafts verified at once or after 1, 6 or 24 tokens,
    eos allowed or masked: the answer is the specialist's own greedy answer (the tiny tokenizer has a word
    per token, so equal text is equal tokens). A consumer served another pair's codes drafts badly from the
    start: its drafts are rejected early, and its answer is still its own."""
    producer, specialists, _ = setup
    prefixes = [PREFIX[:4], PREFIX, (PREFIX * 3)[:30]]
    served = []
    cases = [(n, specialists[n], f"a:{n}") for n in ("b", "c")]
    cases.append(("c, b's codes", SpecialistEngine("b", specialists["c"].model, specialists["c"].tok,
                                                   specialists["b"].art, "v1"), "a:b"))
    for name, eng, pair in cases:
        eng.min_drafts = min_drafts
        eng.exact_cache = PrefixCodeCache(0)            # keep no prefix: every request here drafts
        for prefix in prefixes:
            payload = producer.encode(prefix, [pair]).per_pair[pair].payload
            for params in (GenParams(max_tokens=24, ignore_eos=True), GenParams(max_tokens=24)):
                text, info, finish = eng.complete(prefix, [11, 13], payload, None, params, exact=True)
                want = _oracle(eng, prefix, [11, 13], params)
                assert text == want, f"{name}, prefix of {len(prefix)}, min_drafts {min_drafts}: {info.exact}"
                assert info.mode == "scd" and info.exact is not None, info
                assert {"exact_prefill", "verify"} <= set(info.timings), info.timings
                ex = info.exact
                assert 0 <= ex["accepted"] <= ex["drafted"] and ex["drafted"] >= min(min_drafts, 1), ex
                served.append((name, ex["drafted"], ex["accepted"]))
        eng.min_drafts = 0
    if min_drafts >= 6:
        assert any(d > a for _, d, a in served), f"no draft was ever rejected: {served}"
        assert any(a >= 3 for n, _, a in served if n != "c, b's codes"), f"no draft of 3 accepted: {served}"


def test_exact_sampled_answers_and_stop_strings(setup):  # noqa: F811
    """Sampled exact requests run (their distribution is the rule's, tested above); a stop string and
    max_tokens end an exact answer as they end any other."""
    producer, specialists, _ = setup
    eng = specialists["b"]
    payload = producer.encode(PREFIX, ["a:b"]).per_pair["a:b"].payload
    eng.min_drafts, eng.exact_cache = 5, PrefixCodeCache(0)
    try:
        text, info, finish = eng.complete(PREFIX, [11], payload, None,
                                          GenParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
                                          exact=True)
        assert finish == "length" and len(text.split()) == 12 and info.exact["drafted"] >= 5, (text, info.exact)
        full = _oracle(eng, PREFIX, [11], GenParams(max_tokens=12, ignore_eos=True)).split()
        stop = next(w for i, w in enumerate(full) if i >= 2 and w not in full[:i])
        cut, info, finish = eng.complete(PREFIX, [11], payload, None,
                                         GenParams(max_tokens=12, ignore_eos=True, stop=[stop]), exact=True)
        assert finish == "stop" and cut.split() == full[:full.index(stop)], (cut, stop, full)
        short, _, finish = eng.complete(PREFIX, [11], payload, None, GenParams(max_tokens=3, ignore_eos=True),
                                        exact=True)
        assert finish == "length" and short.split() == full[:3]
    finally:
        eng.min_drafts = 0


def test_exact_without_codes_is_the_plain_fallback(setup):  # noqa: F811
    """No codes (the producer down, say): an exact request is served by the specialist's own prefill alone,
    which is already exact; nothing is drafted."""
    _, specialists, _ = setup
    eng = specialists["b"]
    params = GenParams(max_tokens=8)
    text, info, _ = eng.complete(PREFIX, [11], None, "producer_unavailable", params, exact=True)
    assert info.mode == "fallback" and info.exact is None and text == _oracle(eng, PREFIX, [11], params)


def test_the_next_exact_request_on_a_prefix_reuses_the_specialists_own_cache(setup):  # noqa: F811
    """The own K and V an exact request prefilled are kept (bounded in bytes): the next exact request on that
    prefix is answered from them, with no codes, no drafting and no prefill, and still equals the oracle; a
    budget smaller than one prefix keeps nothing."""
    producer, specialists, _ = setup
    spec = specialists["b"]
    eng = SpecialistEngine("b2", spec.model, spec.tok, spec.art, "v1")
    prefix = PREFIX[:9]
    payload = producer.encode(prefix, ["a:b"]).per_pair["a:b"].payload
    params = GenParams(max_tokens=10, ignore_eos=True)
    first, info1, _ = eng.complete(prefix, [11], payload, None, params, exact=True)
    again, info2, _ = eng.complete(prefix, [17], None, "producer_unavailable", params, exact=True)
    assert info1.exact["cached"] is False and info2.exact == {"drafted": 0, "accepted": 0, "takeover": 0,
                                                               "cached": True}, (info1.exact, info2.exact)
    assert "exact_prefill" not in info2.timings and "prefill" not in info2.timings, info2.timings
    assert first == _oracle(eng, prefix, [11], params) and again == _oracle(eng, prefix, [17], params)
    assert eng.exact_cache.stats.entries == 1 and eng.exact_cache.stats.hits == 1
    small = SpecialistEngine("b3", spec.model, spec.tok, spec.art, "v1", exact_cache_bytes=1000)
    small.complete(prefix, [11], payload, None, params, exact=True)
    assert small.exact_cache.stats.entries == 0, "a prefix larger than the budget is not kept"
