"""One code for a family: shared-encoder fits against several consumers at once (scd.fitting.family)."""
import pytest
import torch

from scd.fitting import family
from scd.fitting.gram import JointGram


def _rows(seed: int, n_members: int, n: int = 3000, d: int = 10):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, generator=g) * torch.linspace(0.2, 3, d)
    shared = torch.randn(d, d, generator=g)
    bs = [a @ (shared + 0.3 * torch.randn(d, d, generator=g)) + 0.05 * torch.randn(n, d, generator=g) + j
          for j in range(n_members)]
    return a, bs


@pytest.mark.parametrize("regression", [False, True])
def test_a_one_member_family_is_the_pair_fit_and_select_gives_each_members_pair_gram(regression):
    a, (b0, b1) = _rows(0, 2)
    fam, pair0, pair1 = JointGram(10, 20), JointGram(10, 10), JointGram(10, 10)
    fam.update(a, torch.cat([b0, b1], 1))
    pair0.update(a, b0)
    pair1.update(a, b1)
    for j, pair in enumerate((pair0, pair1)):
        sub = fam.select([family.member_blocks(10, 2)[j]])
        err = max((sub.g - pair.g).abs().max().item(), (sub.s - pair.s).abs().max().item())
        assert sub.n == pair.n and err < 1e-6 * pair.g.abs().max().item(), f"member {j}'s Gram differs by {err:.2e}"
    one = JointGram(10, 10)
    one.update(a, b0)
    (alone,) = family.fit_family(one, 1, 4, 1e-4, regression)
    direct = pair0.fit_regression(4, 1e-4) if regression else pair0.fit(4, 1e-4)
    err = (alone.decode(alone.encode(a)) - direct.decode(direct.encode(a))).abs().max().item()
    assert err < 1e-4, f"a family of one decodes differently from its pair fit by {err:.2e}"


@pytest.mark.parametrize("regression", [False, True])
def test_family_members_share_one_encoder_and_cost_little_against_their_own_pair_fits(regression):
    a, bs = _rows(1, 3)
    gram = JointGram(10, 30)
    gram.update(a, torch.cat(bs, 1))
    members = family.fit_family(gram, 3, 6, 1e-4, regression)
    z = members[0].encode(a)
    assert all(m.enc is members[0].enc and m.mu_a is members[0].mu_a for m in members)   # one code for all
    for j, (m, b) in enumerate(zip(members, bs)):
        own = family.fit_pair(gram, 3, j, 6, 1e-4, regression)
        fam_err = ((m.decode(z) - b).norm() / b.norm()).item()
        own_err = ((own.decode(own.encode(a)) - b).norm() / b.norm()).item()
        # the shared code serves all three at once, not far from each member's own fit; reduced-rank regression
        # is the best rank-r predictor of B_j from A, so there the own fit is never worse
        assert fam_err < 2 * own_err + 0.05, (j, fam_err, own_err)
        if regression:
            assert own_err <= fam_err * (1 + 1e-4), (j, fam_err, own_err)
    with pytest.raises(ValueError, match="equal member blocks"):
        family.fit_family(gram, 4, 6, 1e-4, regression)
