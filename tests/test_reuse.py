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
