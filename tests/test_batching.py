"""Continuous batching of decode steps: requests of different lengths decoded in one batch, joining while
others run and leaving at different steps, give the tokens each one gets decoded alone."""
import threading
import time

import torch

from engines.batching import BatchDecoder
from scd.online import cache, decode
from scd.online.decode import GenParams, Row
from scd.online.trace import capture
from tests.conftest import tiny_llama


def _alone(model, prefix: list[int], suffix: list[int], n: int) -> list[int]:
    """Greedy tokens without any cache: the whole sequence run again for every token (an independent
    reference for the decode loop)."""
    seq = list(prefix) + list(suffix)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prefix) + len(suffix):]


def _row(model, prefix, suffix, max_tokens, got: list, done: threading.Event) -> Row:
    ids = torch.tensor([prefix])
    c = cache.cache_of(model(input_ids=ids, use_cache=True))
    logits, _ = cache.extend(model, c, torch.ones_like(ids), torch.tensor([suffix]))

    def on_token(t, _logprobs):
        got.append(t)
        return True
    return Row([layer.keys for layer in c.layers], [layer.values for layer in c.layers], logits[0, -1],
               GenParams(max_tokens=max_tokens), on_token, lambda finish, n: done.set())


def _wait(cond, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the decode loop made no progress"
        time.sleep(0.01)


@torch.no_grad()
def test_rows_of_different_lengths_joining_and_leaving_decode_as_they_would_alone():
    model = tiny_llama(0)
    g = torch.Generator().manual_seed(3)
    reqs = [(torch.randint(2, 97, (n,), generator=g).tolist(), torch.randint(2, 97, (s,), generator=g).tolist(), k)
            for n, s, k in ((5, 2, 12), (23, 1, 4), (11, 3, 9), (40, 2, 6))]
    dec = BatchDecoder(model, eos_id=None, max_batch=8)
    got = [[] for _ in reqs]
    done = [threading.Event() for _ in reqs]
    rows = [_row(model, p, s, k, got[i], done[i]) for i, (p, s, k) in enumerate(reqs)]
    with dec.cond:                                   # the first three are admitted together
        for r in rows[:3]:
            dec.submit(r)
    _wait(lambda: dec.decoder.steps >= 2)
    dec.submit(rows[3])                              # the longest joins a running batch: it is re-padded
    for d in done:
        assert d.wait(120), "a request never finished"
    for i, (p, s, k) in enumerate(reqs):
        want = _alone(model, p, s, k)
        assert got[i] == want, f"request {i} (prefix {len(p)}): batched {got[i]} alone {want}"
    assert dec.decoder.rows_stepped > dec.decoder.steps, f"{dec.decoder.rows_stepped} rows in {dec.decoder.steps} steps: nothing was batched"
    assert dec.decoder.batch.rows == [] and dec.decoder.batch.mask is None


def test_a_row_that_stops_early_leaves_and_the_batch_trims_its_padding():
    model = tiny_llama(1)
    dec = BatchDecoder(model, eos_id=None, max_batch=2)
    long_p, short_p = list(range(2, 42)), [7, 8, 9]
    got_l, got_s, dl, ds = [], [], threading.Event(), threading.Event()
    stopper = _row(model, long_p, [3], 2, got_l, dl)             # the long row leaves after 2 tokens
    runner = _row(model, short_p, [4], 10, got_s, ds)
    widths = []
    original = runner.on_token
    runner.on_token = lambda t, lp: (widths.append(dec.decoder.batch.mask.shape[1]), original(t, lp))[1]
    with dec.cond:
        dec.submit(stopper)
        dec.submit(runner)
    assert dl.wait(120) and ds.wait(120)
    assert got_s == _alone(model, short_p, [4], 10) and got_l == _alone(model, long_p, [3], 2)
    assert widths[0] == len(long_p) + 1 and widths[-1] < len(long_p), \
        f"cache width per step {widths}: the long row's padding columns stayed after it left"


def test_concurrent_requests_through_the_engine_answer_what_each_answers_alone():
    """Requests streamed from several threads at once (their decode steps batched) get the same text, finish
    reason and token count as when each runs alone; a request whose reader stops early leaves its row."""
    from concurrent.futures import ThreadPoolExecutor

    from engines.specialist import SpecialistEngine
    from tests.test_models import _tokenizer
    eng = SpecialistEngine("b", tiny_llama(2), _tokenizer(97), max_batch=3)
    g = torch.Generator().manual_seed(5)
    reqs = [(torch.randint(2, 97, (n,), generator=g).tolist(), [int(torch.randint(2, 97, (1,), generator=g))],
             GenParams(max_tokens=k, seed=i, temperature=0.7 if i % 2 else 0.0))
            for i, (n, k) in enumerate([(6, 9), (30, 4), (14, 12), (3, 7), (21, 5)])]
    alone = [eng.complete(p, s, None, "oracle", q) for p, s, q in reqs]
    with ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: eng.complete(r[0], r[1], None, "oracle", r[2]), reqs))
    for i, ((t1, i1, f1), (t2, i2, f2)) in enumerate(zip(alone, together)):
        assert (t1, f1, i1.tokens) == (t2, f2, i2.tokens), f"request {i}: alone {t1!r} ({f1}), batched {t2!r} ({f2})"
    stream = eng.stream(reqs[2][0], reqs[2][1], None, "oracle", reqs[2][2])
    next(stream)
    stream.close()                                  # the reader goes away after one piece
    _wait(lambda: not eng.decoder.decoder.batch.rows)


@torch.no_grad()
def test_generate_runs_the_serving_decode_loop_over_a_left_padded_batch_and_pads_with_eos():
    """decode.generate (scd eval's) is the engines' loop: rows of a left-padded prefix cache decode as each
    would alone; a row that hits eos ends with it, padded with eos to the longest row."""
    model = tiny_llama(3)
    prefixes = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    width = max(map(len, prefixes))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prefixes])
    mask = (torch.arange(width)[None] >= torch.tensor([[width - len(p)] for p in prefixes])).long()
    tr = capture(model, ids, mask, want_xnorm=False)
    kv = cache.assemble(model, list(zip(tr.keys, tr.values)))
    got = decode.generate(model, kv, mask, torch.tensor([[3], [4]]), 6)
    want = [_alone(model, p, [s], 6) for p, s in zip(prefixes, (3, 4))]
    assert got.tolist() == want, f"generate {got.tolist()} alone {want}"
    eos = want[0][2]                                 # make row 0's third token the end of its text
    tr = capture(model, ids, mask, want_xnorm=False)
    got = decode.generate(model, cache.assemble(model, list(zip(tr.keys, tr.values))), mask,
                          torch.tensor([[3], [4]]), 6, eos_id=eos)
    row0 = want[0][:want[0].index(eos) + 1]
    assert got[0].tolist() == row0 + [eos] * (got.shape[1] - len(row0)), got.tolist()


def test_tokens_queued_behind_one_another_travel_as_one_piece_and_the_end_is_kept():
    """The engine actor's stream: tokens already queued when one is handed on go in the same Output (text,
    logprobs and the token count of the last), and an end event queued behind them is returned, not lost;
    with nothing queued the piece goes at once (no wait for the next token)."""
    import queue
    from actors.specialist_actor import _coalesced
    events = queue.Queue()
    for ev in [("token", " Hy", {"token": " Hy"}, 2), ("token", "the", None, 3), ("done", "info", "stop")]:
        events.put(ev)
    piece, nxt = _coalesced(("token", " in", {"token": " in"}, 1), events)
    assert (piece.text, piece.tokens, piece.logprobs) == (" in Hythe", 3, [{"token": " in"}, {"token": " Hy"}])
    assert nxt == ("done", "info", "stop")
    piece, nxt = _coalesced(("token", "!", None, 4), events)
    assert (piece.text, piece.tokens, piece.logprobs, nxt) == ("!", 4, [], None)
