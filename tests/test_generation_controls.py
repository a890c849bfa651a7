"""What OpenAI and vLLM clients ask of the decode loop beyond sampling: min_tokens and ignore_eos (the
end-of-sequence token masked), and each generated token's logprobs. Checked on a tiny model against an
independent reference: the whole sequence run again for every token, no cache."""
import torch

from scd.online import cache
from scd.online.decode import Decoder, GenParams, Row
from tests.conftest import tiny_llama

PREFIX, SUFFIX = [5, 17, 33, 8, 61, 12], [40]


@torch.no_grad()
def _reference(model, n: int, banned: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (never `banned`) and the full log-softmax of the logits each was picked from."""
    seq, lps = PREFIX + SUFFIX, []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
        lps.append(torch.log_softmax(logits, -1))
        if banned is not None:
            logits[banned] = float("-inf")
        seq.append(int(logits.argmax()))
    return seq[len(PREFIX) + len(SUFFIX):], lps


@torch.no_grad()
def _decode(model, eos_id: int | None, params: GenParams) -> tuple[list[int], list, str]:
    """(tokens, their TokenLogprobs, finish reason) from the serving engines' decode loop."""
    ids = torch.tensor([PREFIX])
    c = cache.cache_of(model(input_ids=ids, use_cache=True))
    logits, _ = cache.extend(model, c, torch.ones_like(ids), torch.tensor([SUFFIX]))
    got, lps, done = [], [], []
    row = Row([layer.keys for layer in c.layers], [layer.values for layer in c.layers], logits[0, -1], params,
              lambda t, lp: got.append(t) or lps.append(lp) or True, lambda finish, n: done.append(finish))
    dec = Decoder(model, eos_id, max_batch=2)
    dec.waiting.append(row)
    while dec.busy():
        dec.admit()
        dec.step()
    return got, lps, done[0]


def test_eos_ends_the_answer_unless_min_tokens_or_ignore_eos_mask_it():
    model = tiny_llama(0)
    first = _reference(model, 1)[0][0]
    eos = first                                        # the model's very first greedy token is made the eos
    got, _, finish = _decode(model, eos, GenParams(max_tokens=6))
    assert got == [] and finish == "stop", f"eos {eos} should end the answer at once: got {got}, {finish}"

    want, _ = _reference(model, 6, banned=eos)
    got, _, finish = _decode(model, eos, GenParams(max_tokens=6, ignore_eos=True))
    assert got == want and finish == "length", f"ignore_eos: got {got}, want {want} (eos {eos})"

    got, _, finish = _decode(model, eos, GenParams(max_tokens=6, min_tokens=3))
    assert got[:3] == want[:3], f"min_tokens=3: the first 3 tokens are picked with eos masked: {got} vs {want}"
    assert eos not in got[:3] and len(got) >= 3, got


def test_logprobs_are_the_models_own_log_softmax_with_the_top_alternatives():
    model = tiny_llama(0)
    want, ref = _reference(model, 5)
    got, lps, _ = _decode(model, None, GenParams(max_tokens=5, logprobs=3))
    assert got == want
    for t, lp, r in zip(got, lps, ref):
        err = abs(lp.logprob - float(r[t]))
        assert err < 1e-4, f"logprob of token {t}: {lp.logprob} vs reference {float(r[t])} (error {err:.2e})"
        top = r.topk(3)
        assert [i for i, _ in lp.top] == top.indices.tolist(), (lp.top, top)
        assert max(abs(v - w) for (_, v), w in zip(lp.top, top.values.tolist())) < 1e-4
        assert lp.top[0][1] >= lp.logprob - 1e-6          # greedy: the chosen token is the most likely one


def test_logprobs_do_not_see_temperature_and_are_absent_unless_asked():
    model = tiny_llama(0)
    _, lps, _ = _decode(model, None, GenParams(max_tokens=3))
    assert lps == [None, None, None]
    got, lps, _ = _decode(model, None, GenParams(max_tokens=1, logprobs=0, temperature=2.0, seed=0))
    ref = _reference(model, 1)[1][0]
    assert abs(lps[0].logprob - float(ref[got[0]])) < 1e-4 and lps[0].top == (), lps
