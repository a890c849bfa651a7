"""The decode loop over preallocated caches (StaticBatch, a GPU engine's; run eagerly here) answers as the
left-padded batch does: the same tokens and logprobs for rows of different lengths that join between steps and
leave at different times, through every step shape; and a row that does not fit is refused alone. The loop's
greedy rows pick in one pass."""
import pytest
import torch

from scd.online.api import GenParams
from scd.online.cache import cache_of
from scd.online.decode import Decoder, Row, StaticBatch
from tests.conftest import tiny_llama


def _rows(model, lengths: list[int], max_tokens: list[int]) -> list[tuple[Row, list]]:
    """Rows continuing prefixes of these lengths (random token ids), greedy, with logprobs; each with the list
    its (token, logprob) pairs and finish go to."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n, m in zip(lengths, max_tokens):
        ids = torch.randint(2, 97, (1, n), generator=g).to(model.device)
        with torch.no_grad():
            o = model(input_ids=ids, use_cache=True)
        got: list = []
        layers = cache_of(o).layers
        row = Row([layer.keys for layer in layers], [layer.values for layer in layers], o.logits[0, -1],
                  GenParams(max_tokens=m, ignore_eos=True, logprobs=0),
                  on_token=lambda t, lp, got=got: got.append((t, lp.logprob)) is None,
                  on_done=lambda finish, k, got=got: got.append(finish))
        out.append((row, got))
    return out


def _run(dec: Decoder, model, lengths, max_tokens, late: dict[int, int]) -> list[list]:
    """Rows submitted at once, except row i of `late` (i: step), which joins before that step; stepped to the end."""
    rows = _rows(model, lengths, max_tokens)
    step = 0
    while True:
        for i, (row, _) in enumerate(rows):
            if late.get(i, 0) == step:
                dec.waiting.append(row)
        if not dec.busy() and step > max(late.values(), default=0):
            break
        dec.admit()
        dec.step()
        step += 1
    return [got for _, got in rows]


@pytest.mark.parametrize("min_length", [8, 256])
def test_static_caches_decode_the_tokens_and_logprobs_of_the_left_padded_batch(monkeypatch, min_length):
    """Four rows of 5-40 tokens, one joining at step 3, leaving after 4-20 tokens: the static decoder (slots moved
    down as rows leave, step shapes from (1, 8) up to (4, 64) with MIN_LENGTH 8) against the dynamic one."""
    monkeypatch.setattr(StaticBatch, "MIN_LENGTH", min_length)
    model = tiny_llama(layers=2)
    args = ([5, 40, 12, 23], [20, 4, 9, 14], {2: 3})
    want = _run(Decoder(model, eos_id=1, max_batch=4), model, *args)
    static = Decoder(model, eos_id=1, max_batch=4, static_capacity=80)
    got = _run(static, model, *args)
    for i, (w, g) in enumerate(zip(want, got)):
        assert [t for t, _ in w[:-1]] == [t for t, _ in g[:-1]] and w[-1] == g[-1] == "length", (i, w, g)
        err = max(abs(a - b) for (_, a), (_, b) in zip(w[:-1], g[:-1]))
        assert err < 1e-4, f"row {i}: logprobs differ from the left-padded batch's by {err:.2e}"
    assert static.batch.rows == [] and static.batch.lengths == [], static.batch.lengths
    shapes = static.batch.st.graphs                     # eager on a CPU: no graph captured
    assert shapes == {}, shapes


def test_a_row_that_does_not_fit_the_static_caches_ends_in_an_error_and_the_others_decode():
    model = tiny_llama(layers=2)
    dec = Decoder(model, eos_id=1, max_batch=2, static_capacity=30)
    (small, got_small), (big, got_big) = _rows(model, [6, 20], [5, 12])        # 20 + 12 > 30 positions
    dec.waiting.extend([small, big])
    dec.admit()
    assert got_big == [] or "does not fit the static cache's 30 positions" in got_big[-1], got_big
    assert got_big and got_big[-1].startswith("error:"), got_big
    while dec.busy():
        dec.admit()
        dec.step()
    assert len(got_small) == 6 and got_small[-1] == "length", got_small


def test_a_step_shape_is_the_rows_and_the_longest_length_rounded_up_to_powers_of_two(monkeypatch):
    """Which (rows, positions) a step runs: 3 rows -> 4, the longest 9 cached tokens + 1 -> 16 (MIN_LENGTH 8),
    never over the capacity; the slot past the rows attends to its own token alone."""
    monkeypatch.setattr(StaticBatch, "MIN_LENGTH", 8)
    model = tiny_llama(layers=2)
    b = StaticBatch(model, max_batch=4, capacity=24, graphs=False)
    seen = []
    real = b.st.step
    monkeypatch.setattr(b.st, "step", lambda tokens, n, length: seen.append((n, length)) or real(tokens, n, length))
    for row, _ in _rows(model, [4, 9, 2], [3, 3, 3]):
        b.join(row)
    b.step(model, torch.tensor([5, 6, 7]))
    assert seen == [(4, 16)] and b.lengths == [5, 10, 3], (seen, b.lengths)
    spare = (int(b.st.filled[3].sum()), int(b.st.pos[3]))
    assert spare == (1, 1), f"the spare slot holds {spare[0]} positions, next at {spare[1]}: more than its own token"
    for _ in range(10):                            # the longest grows to 20 + 1 > 16: the capacity, 24
        b.step(model, torch.tensor([5, 6, 7]))
    assert seen[-1] == (4, 24), seen[-1]
    spare = (int(b.st.filled[3].sum()), int(b.st.pos[3]))
    assert spare == (1, 1), f"after 11 steps the spare slot holds {spare[0]} positions, next at {spare[1]}"


def test_a_graph_that_cannot_be_captured_leaves_the_static_caches_stepping_eagerly(monkeypatch, caplog):
    model = tiny_llama(layers=2)
    args = ([5, 12], [6, 3], {})
    want = _run(Decoder(model, eos_id=1, max_batch=2), model, *args)
    dec = Decoder(model, eos_id=1, max_batch=2, static_capacity=40, graphs=True)
    tries = []

    def refuse(n, length):
        tries.append((n, length))
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(dec.batch.st, "capture", refuse)
    with caplog.at_level("WARNING"):
        got = _run(dec, model, *args)
    assert [[t for t, _ in r[:-1]] for r in got] == [[t for t, _ in r[:-1]] for r in want], (got, want)
    assert len(tries) == 1 and not dec.batch.graphs, tries            # tried once, then eager for good
    assert "could not be captured (operation not permitted" in caplog.text, caplog.text


def test_the_greedy_rows_of_a_step_pick_in_one_pass_what_each_picks_alone():
    """Decoder._greedy: every greedy row's token from one argmax over the stacked logits equals pick() of its
    own logits with its eos rule (masked with ignore_eos or before min_tokens); fed and sampled rows are left
    to the per-row path."""
    from scd.online.decode import mask_eos, pick
    eos = 1
    g = torch.Generator().manual_seed(5)
    settings = [GenParams(), GenParams(ignore_eos=True), GenParams(min_tokens=3), GenParams(min_tokens=1),
                GenParams(temperature=0.7), GenParams()]
    rows = []
    for i, p in enumerate(settings):
        logits = torch.randn(97, generator=g)
        logits[eos] = logits.max() + 1.0                 # eos the most likely: the rule decides every greedy row
        rows.append(Row([], [], logits, p, n_out=2, feed=7 if i == 5 else None))
    got = Decoder(tiny_llama(layers=1), eos_id=eos)._greedy(rows)
    want = {i: int(pick(mask_eos(r.logits, r.params, r.n_out, eos), 0.0, 1.0, None)[0])
            for i, r in enumerate(rows) if i < 4}
    assert got == want, (got, want)
    assert [got[i] == eos for i in range(4)] == [True, False, False, True], got      # min_tokens 3 > 2 tokens out
