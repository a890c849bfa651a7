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
