import torch

from scd.fitting.gram import JointGram


def test_identical_pair_full_rank_reproduces_rows():
    torch.manual_seed(0)
    a = torch.randn(4000, 16) @ torch.randn(16, 16) + 3.0
    g = JointGram(16, 16)
    for chunk in a.split(1000):
        g.update(chunk, chunk)
    codec = g.fit(rank=16, ridge=1e-9)
    err = (codec.decode(codec.encode(a)) - a).abs().max().item()
    assert err < 1e-4, f"full-rank Reuse of an identical pair: max |B_hat - B| = {err:.2e}"


def test_low_rank_error_falls_with_rank_and_linear_map_is_recovered():
    torch.manual_seed(1)
    a = torch.randn(5000, 8) @ torch.diag(torch.tensor([5., 4, 3, 2, 1, .1, .1, .1]))
    m = torch.randn(8, 8)
    b = a @ m
    g = JointGram(8, 8)
    g.update(a, b)
    codecs = [g.fit(r, ridge=1e-9) for r in (1, 3, 5, 8)]
    errs = [((c.decode(c.encode(a)) - b).pow(2).mean() / b.pow(2).mean()).item() for c in codecs]
    assert all(x >= y - 1e-9 for x, y in zip(errs, errs[1:])), f"relative error not monotone in rank: {errs}"
    assert errs[-1] < 1e-6, f"full rank should recover an exact linear map, rel err {errs[-1]:.2e}"


def test_hidden_regression_codes_are_whitened_and_decode_to_the_rank_r_prediction():
    """fit_regression's codes have unit variance per column on the fitted rows (so one scale per quantised row
    suits every column), and decoding them gives the rank-r reduced-rank regression's prediction."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, 12, generator=g) * torch.linspace(0.1, 5, 12)
    b = a @ torch.randn(12, 8, generator=g) + 0.1 * torch.randn(4000, 8, generator=g) + 3.0
    gram = JointGram(12, 8)
    gram.update(a, b)
    c = gram.fit_regression(rank=4, ridge=0.0)
    z = c.encode(a)
    err = (z.var(0, unbiased=False) - 1).abs().max().item()
    assert err < 1e-3, f"code column variances differ from 1 by {err:.2e}"
    w = torch.linalg.lstsq(a - a.mean(0), b - b.mean(0)).solution                # full-rank OLS
    pred = (a - a.mean(0)) @ w
    top = torch.linalg.eigh(pred.T @ pred)[1][:, -4:]                              # its top-4 directions
    want = pred @ top @ top.T + b.mean(0)
    got = c.decode(z)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-3, f"decoded codes differ from the rank-4 prediction by {rel:.2e} (relative)"


def _token_rows(n=6000, d_a=6, d_b=5, vocab=10, seed=3):
    """Rows whose B is a linear map of A plus a per-token offset that A cannot express (A is token-blind)."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, vocab, (n,), generator=g)
    a = torch.randn(n, d_a, generator=g) + 2.0
    b = a @ torch.randn(d_a, d_b, generator=g) + 4 * torch.randn(vocab, d_b, generator=g)[tok] \
        + 0.05 * torch.randn(n, d_b, generator=g)
    return tok, a, b


def test_token_table_fit_equals_ridge_regression_with_one_hot_tokens():
    """At full rank the fit with a token table is the least-squares fit of B on [A, one-hot(token)] with the
    one-hot columns ridge-shrunk by `shrink`, solved directly from the rows."""
    from scd.fitting.gram import TokenStats
    tok, a, b = _token_rows()
    shrink = 3.0
    g, stats = JointGram(6, 5), TokenStats(torch.arange(10), 6, 5)
    for t, x, y in zip(tok.split(1500), a.split(1500), b.split(1500)):
        g.update(x, y)
        stats.update(t, x, y)
    codec = g.fit_regression(rank=5, ridge=0.0, tokens=stats, shrink=shrink)
    # direct: centred rows, features [A_c, onehot], penalty shrink on the one-hot block only
    ac, bc = (a - a.mean(0)).double(), (b - b.mean(0)).double()
    f = torch.cat([ac, torch.nn.functional.one_hot(tok, 10).double()], 1)
    pen = torch.diag(torch.cat([torch.zeros(6), torch.full((10,), shrink)])).double()
    coef = torch.linalg.solve(f.T @ f + pen, f.T @ bc)
    direct = f @ coef + b.mean(0).double()
    got = codec.decode(codec.encode(a), tok).double()
    err = ((got - direct).norm() / direct.norm()).item()
    assert err < 1e-5, f"token-table fit vs direct ridge regression: relative error {err:.2e}"
    plain = g.fit_regression(rank=5, ridge=0.0)
    e_table, e_plain = ((got - b) ** 2).mean().item(), ((plain.decode(plain.encode(a)) - b) ** 2).mean().item()
    assert e_table < 0.05 * e_plain, f"the table should explain the token offsets: MSE {e_table:.3g} vs {e_plain:.3g}"


def test_bigram_table_is_the_shrunk_mean_residual_after_code_and_token_row():
    """A (previous token, token) table fitted in closed form from its keys' sums (fit_regression with
    `bigrams`) equals, per key, the mean over its rows of what the code and the token's row leave, shrunk by
    n / (n + shrink), computed directly from the rows; a key outside it decodes as the token table alone; and
    on rows whose targets carry a bigram offset it lowers the error of the token table alone."""
    import pytest

    from scd.fitting.gram import TokenStats
    from scd.online.reuse import LinearCodec, bigram_keys, rows_of
    g = torch.Generator().manual_seed(3)
    vocab, n = 6, 3000
    tok = torch.randint(vocab, (n,), generator=g)                 # one sequence
    keys = bigram_keys(tok)
    offsets = 2 * torch.randn(vocab + 1, vocab, 4, generator=g)   # by (previous + 1, token)
    a = torch.randn(n, 5, generator=g)
    b = a @ torch.randn(5, 4, generator=g) + 3 * torch.randn(vocab, 4, generator=g)[tok] \
        + offsets[keys >> 32, tok] + 0.05 * torch.randn(n, 4, generator=g)
    gram, uni = JointGram(5, 4), TokenStats(torch.arange(vocab), 5, 4)
    bi = TokenStats.most_frequent([keys], 20, 5, 4)
    gram.update(a, b)
    uni.update(tok, a, b)
    bi.update(keys, a, b)
    shrink = 5.0
    plain = gram.fit_regression(rank=4, ridge=0.0, tokens=uni, shrink=1.0)
    codec = gram.fit_regression(rank=4, ridge=0.0, tokens=uni, shrink=1.0, bigrams=bi, bigram_shrink=shrink)
    resid = (b - plain.decode(plain.encode(a), tok)).double()
    at = rows_of(bi.ids, keys)
    for i in range(len(bi.ids)):
        sel = resid[at == i]
        want = sel.sum(0) / (len(sel) + shrink)
        err = (codec.bigram[i].double() - want).abs().max().item()
        assert err < 1e-4, f"bigram row {i} (key {int(bi.ids[i])}, {len(sel)} rows) differs by {err:.2e}"
    got = codec.decode(codec.encode(a), tok, keys)
    outside = at == len(bi.ids)
    assert outside.any()
    err = (got[outside] - plain.decode(plain.encode(a), tok)[outside]).abs().max().item()
    assert err < 1e-5, f"a key outside the bigram table should decode as the token table alone: {err:.2e}"
    e_bi, e_uni = ((got - b) ** 2).mean().item(), (resid ** 2).mean().item()
    assert e_bi < 0.8 * e_uni, f"the bigram rows should explain the bigram offsets: MSE {e_bi:.3g} vs {e_uni:.3g}"
    with pytest.raises(ValueError, match="bigram keys"):
        codec.decode(codec.encode(a), tok)
    back = LinearCodec.from_tensors(codec.tensors("c"), "c")
    assert torch.equal(back.bigram, codec.bigram) and torch.equal(back.bigram_ids, codec.bigram_ids)
    with pytest.raises(ValueError, match="bigram table"):
        LinearCodec(codec.mu_a, codec.enc, codec.mu_b, codec.dec, bigram=codec.bigram, bigram_ids=codec.bigram_ids)


def test_token_table_at_low_rank_unknown_tokens_and_levels():
    """A rank-r fit with a table: tokens outside the table decode to the code's map plus mu_b alone, a lower
    level decodes with the decoder's leading rows, the table survives tensors(), and bad tables are refused."""
    import pytest

    from scd.fitting.gram import TokenStats
    from scd.online.reuse import LinearCodec
    tok, a, b = _token_rows(d_a=8, d_b=8)
    g, stats = JointGram(8, 8), TokenStats(torch.arange(0, 10, 2), 8, 8)      # even tokens only
    g.update(a, b)
    stats.update(tok, a, b)
    assert int(stats.n.sum()) == int((tok % 2 == 0).sum()), "rows of tokens outside the table must be skipped"
    codec = g.fit_regression(rank=3, ridge=1e-6, tokens=stats, shrink=1.0)
    z = codec.encode(a)
    odd = tok % 2 == 1
    bare = z @ codec.dec + codec.mu_b
    assert torch.equal(codec.decode(z, tok)[odd], bare[odd]), "a token without a row must get mu_b alone"
    assert not torch.allclose(codec.decode(z, tok)[~odd], bare[~odd]), "a token with a row must get it"
    low = codec.decode(z[:, :2], tok)
    want = z[:, :2] @ codec.dec[:2] + codec.bias(tok)
    assert (low - want).abs().max().item() < 1e-5, "a level decodes with the decoder's leading rows"
    back = LinearCodec.from_tensors(codec.tensors("x"), "x")
    assert torch.equal(back.table, codec.table) and torch.equal(back.table_ids, codec.table_ids)
    with pytest.raises(ValueError, match="token ids"):
        codec.decode(z)
    with pytest.raises(ValueError, match="sorted"):
        LinearCodec(codec.mu_a, codec.enc, codec.mu_b, codec.dec, codec.table, codec.table_ids.flip(0))
    with pytest.raises(ValueError, match="both"):
        LinearCodec(codec.mu_a, codec.enc, codec.mu_b, codec.dec, codec.table, None)


def test_most_frequent_tokens_break_ties_by_id():
    from scd.fitting.gram import TokenStats
    seqs = [torch.tensor([5, 5, 7, 9, 9]), torch.tensor([7, 1, 3])]        # 5, 7, 9 twice; 1, 3 once
    assert TokenStats.most_frequent(seqs, 4, 2, 2).ids.tolist() == [1, 5, 7, 9]
    assert TokenStats.most_frequent(seqs, 99, 2, 2).ids.tolist() == [1, 3, 5, 7, 9]
