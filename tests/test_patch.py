"""The Patch aligner: its causal window and its token features, on synthetic targets it must (not) fit."""
import torch

from scd.fitting.aligners import train_aligner
from scd.online.patch import Aligner, FusedPatches, regenerate_kv, window_index
from scd.online.rope import apply_rope, cos_sin, positions_from_mask
from scd.online.tables import layer0_input
from tests.conftest import left_padded_batch, tiny_llama


def _rows(lengths, r, seed=0):
    """Calibration-style rows: whole sequences one after another, with their positions."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return torch.randn(len(pos), r, generator=g), pos


def test_window_index_points_at_the_previous_rows_of_the_same_sequence():
    _, pos = _rows([5, 3, 7], 4)
    idx, inside = window_index(pos, 3)
    assert idx[6].tolist() == [6, 5, 4] and inside[6, :, 0].tolist() == [True, True, False]   # 2nd token of seq 2
    assert idx[5].tolist()[0] == 5 and inside[5, :, 0].tolist() == [True, False, False]       # its first token
    assert inside[4, :, 0].tolist() == [True, True, True]                                        # seq 1, 5th token


def test_aligner_on_a_left_padded_batch_ignores_the_padding():
    torch.manual_seed(0)
    g = Aligner(4, 16, 8, context=3, token_dim=4, window_dim=2)
    torch.nn.init.normal_(g.out.weight)                     # make the MLP path count
    z, x0 = torch.randn(2, 6, 4), torch.randn(2, 6, 16)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        batch = g(z, mask, x0)
        alone = g(z[:1, 2:], mask[:1, 2:], x0[:1, 2:])
    err = (batch[0, 2:] - alone[0]).abs().max().item()
    assert err < 1e-6, f"padded row differs from the unpadded row by {err:.2e}"


def _previous_token_task(n_seqs=60, t=24, vocab=8, hidden=16, r=4, seed=0):
    """Target = a fixed random vector of the *previous* token; the codes are noise. Only token features
    read through a window of 2 can fit it."""
    g = torch.Generator().manual_seed(seed)
    emb, out = torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    ids = torch.randint(vocab, (n_seqs, t), generator=g)
    prev = torch.cat([torch.zeros(n_seqs, 1, dtype=torch.long), ids[:, :-1]], dim=1)
    target = out[prev] * (torch.arange(t) > 0)[None, :, None]
    pos = torch.arange(t).repeat(n_seqs)
    z = torch.randn(n_seqs * t, r, generator=g)
    return z, pos, emb[ids].reshape(-1, hidden), target.reshape(-1, hidden)


def test_token_features_through_the_window_recover_the_previous_token():
    z, pos, x0, target = _previous_token_task()
    init_dec, init_mu = torch.zeros(z.shape[1], target.shape[1]), target.mean(0)
    kw = dict(width=64, epochs=150, lr=5e-3, patience=20)
    with_tokens = train_aligner(z, target, init_dec, init_mu, pos, context=2, x0=x0, token_dim=8, **kw)
    without = train_aligner(z, target, init_dec, init_mu, pos, context=2, **kw)
    per_token = train_aligner(z, target, init_dec, init_mu, pos, context=1, x0=x0, token_dim=8, **kw)
    best = lambda fit: min(fit.val_loss)  # noqa: E731  (relative MSE on the held-out rows)
    assert best(with_tokens) < 0.05, f"window 2 + token features: relative val MSE {best(with_tokens):.3f}"
    assert best(without) > 0.5, f"codes alone should not fit it: relative val MSE {best(without):.3f}"
    assert best(per_token) > 0.5, f"no window, no previous token: relative val MSE {best(per_token):.3f}"

    # the trained aligner on a (B, T) batch gives what training saw on the rows
    g = with_tokens.aligner
    b, t = 3, 24
    out = g(z[:b * t].view(b, t, -1), torch.ones(b, t), x0[:b * t].view(b, t, -1))
    idx, inside = window_index(pos[:b * t], 2)
    rows = g.train_rows(z, x0, idx, inside)
    err = (out.reshape(b * t, -1) - rows).abs().max().item()
    assert err < 1e-5, f"batched forward vs row-gathered training features differ by {err:.2e}"


def test_loss_measured_after_a_projection_ignores_what_the_projection_drops():
    z, pos, x0, target = _previous_token_task(n_seqs=30)
    keep = torch.zeros(target.shape[1], 4)
    keep[:4, :4] = torch.eye(4)                     # only the first 4 output dims count
    noisy = target.clone()
    noisy[:, 4:] = torch.randn_like(noisy[:, 4:]) * 10   # unfittable noise in the dropped dims
    init_dec, init_mu = torch.zeros(z.shape[1], target.shape[1]), torch.zeros(target.shape[1])
    fit = train_aligner(z, noisy, init_dec, init_mu, pos, context=2, x0=x0, token_dim=8, width=64, epochs=150,
                        lr=5e-3, patience=20, target_proj=keep)
    assert min(fit.val_loss) < 0.05, f"projected loss should see only the fittable dims: {min(fit.val_loss):.3f}"


def test_aligner_with_token_features_refuses_to_run_without_them():
    g = Aligner(4, 16, 8, context=2, token_dim=4)
    try:
        g(torch.zeros(1, 3, 4), torch.ones(1, 3))
    except ValueError as e:
        assert "x0" in str(e)
    else:
        raise AssertionError("an aligner with token features ran without x0")


def test_fused_patches_equal_each_aligner_then_its_layers_own_projections():
    model = tiny_llama(0)
    layers = [model.model.layers[1], model.model.layers[2]]
    ids, mask = left_padded_batch()
    cos, sin = cos_sin(model, positions_from_mask(mask))
    x0 = layer0_input(model, ids)
    table = layer0_input(model, torch.arange(model.model.embed_tokens.weight.shape[0]))
    for bias in (False, True):                              # Qwen2-style K/V projection biases too
        if bias:
            for proj in (layers[0].self_attn.k_proj, layers[0].self_attn.v_proj):
                proj.bias = torch.nn.Parameter(torch.randn(proj.out_features) * 0.3)
        torch.manual_seed(1)
        aligners = [Aligner(6, model.config.hidden_size, 16, context=3, token_dim=4, window_dim=2).eval()
                    for _ in layers]
        for g in aligners:
            torch.nn.init.normal_(g.out.weight, std=0.2)
            torch.nn.init.normal_(g.out.bias, std=0.2)
        zs = [torch.randn(*ids.shape, 6) for _ in layers]
        with torch.no_grad():
            refs = [regenerate_kv(layer, g(z, mask, x0), cos, sin, 8) for g, layer, z in zip(aligners, layers, zs)]
            for name, fused, x in (("table", FusedPatches(aligners, layers, table), None),
                                   ("no table", FusedPatches(aligners, layers), x0),
                                   ("one layer", FusedPatches(aligners[1:], layers[1:], table), None)):
                ks, vs = fused(zs[-fused.n:], mask, ids, x)
                for i, (ref_k, ref_v) in enumerate(refs[-fused.n:]):
                    k = apply_rope(ks[i].view(*ids.shape, -1, 8).transpose(1, 2), cos, sin)
                    v = vs[i].view(*ids.shape, -1, 8).transpose(1, 2)
                    keep = mask.bool()[:, None, :, None].expand_as(k)   # padding rows are never attended
                    err = max((k - ref_k)[keep].abs().max().item(), (v - ref_v)[keep].abs().max().item())
                    assert err < 1e-5, f"fused ({name}, bias={bias}) layer {i} differs from the direct path by {err:.2e}"
