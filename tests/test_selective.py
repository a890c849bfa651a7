"""Selective token recompute (scd.online.selective): every position selected is the consumer's own prefill,
the last k are a tail, the others stay as given; CacheBlend's deviation rule finds the positions a cache got
wrong; the structural rule takes the last tokens and separators; the cost model's ends."""
import torch

from scd.online import selective
from scd.online.rebuild import run_tail
from scd.online.trace import capture
from tests.conftest import left_padded_batch, perturbed, tiny_llama


def _kv(model, ids, mask):
    tr = capture(model, ids, mask, want_xnorm=False)
    return list(zip(tr.keys, tr.values))


def _err(kv, want, mask=None, columns=slice(None)) -> float:
    """Largest |difference| over every layer's K and V at `columns` (padded columns left out with `mask`)."""
    worst = 0.0
    for (gk, gv), (wk, wv) in zip(kv, want):
        for g, w in ((gk, wk), (gv, wv)):
            d = (g - w).abs()[..., columns, :]
            if mask is not None:
                d = d * mask[:, None, columns, None]
            worst = max(worst, d.max().item())
    return worst


def _all(mask) -> torch.Tensor:
    """Every column of a batch whose rows are all unpadded."""
    return torch.arange(mask.shape[1]).expand(mask.shape[0], -1).contiguous()


def test_every_position_recomputed_over_another_models_cache_is_the_consumers_own_prefill():
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(12, 12))
    raw, own = _kv(a, ids, mask), _kv(b, ids, mask)
    assert _err(raw, own) > 1e-2, "the two models' caches must differ for this test to mean anything"
    got = selective.recompute_tokens(b, raw, ids, mask, _all(mask))
    assert _err(got, own) < 1e-4, f"all positions recomputed differ from the own prefill by {_err(got, own):.2e}"


def test_the_last_positions_recomputed_are_a_tail_and_the_others_stay_as_given_left_padding_and_all():
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(12, 7, 9))
    raw = _kv(a, ids, mask)
    t = ids.shape[1]
    sel = torch.arange(t - 4, t).expand(3, -1).contiguous()
    got = selective.recompute_tokens(b, raw, ids, mask, sel)
    tail = run_tail(b, raw, ids, mask, 4)
    assert _err(got, tail, mask) < 1e-4, f"the last 4 recomputed differ from a tail of 4 by {_err(got, tail, mask):.2e}"
    assert _err(got, raw, columns=slice(None, t - 4)) == 0, "positions not selected must stay as given"


def test_scattered_positions_are_the_consumers_own_where_every_earlier_position_is_too():
    """Positions 0..5 selected: attention from them sees only themselves, so they equal the own prefill's;
    a later scattered set changes those positions only."""
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(12,))
    raw, own = _kv(a, ids, mask), _kv(b, ids, mask)
    sel = torch.tensor([[0, 1, 2, 3, 4, 5]])
    got = selective.recompute_tokens(b, raw, ids, mask, sel)
    assert _err(got, own, columns=slice(0, 6)) < 1e-4, f"a prefix's first positions: {_err(got, own, columns=slice(0, 6)):.2e}"
    sel = torch.tensor([[2, 5, 9]])
    got = selective.recompute_tokens(b, raw, ids, mask, sel)
    rest = [c for c in range(12) if c not in (2, 5, 9)]
    assert _err(got, raw, columns=rest) == 0
    assert _err(got, raw, columns=[2, 5, 9]) > 1e-2, "the selected positions must be the consumer's"
    assert _err(got, own, columns=[2]) > 0 and _err(got, own, columns=[2]) < _err(raw, own, columns=[2]), \
        "a selected position attending over another model's cache moves toward the consumer's own"


def test_the_deviation_rule_finds_the_positions_a_cache_got_wrong_and_gives_the_first_layer_exact():
    b = tiny_llama(1)
    ids, mask = left_padded_batch(lengths=(16,))
    own = _kv(b, ids, mask)
    wrong = [(k.clone(), v.clone()) for k, v in own]
    for c in (3, 8, 13):                                   # the first layer's K and V off at three positions
        wrong[0][0][..., c, :] += 0.5
        wrong[0][1][..., c, :] -= 0.5
    sel, first = selective.deviation(b, wrong, ids, mask, 3 / 16)
    assert sel.tolist() == [[3, 8, 13]], sel
    assert _err(first, own[:1]) < 1e-4, "the rule's first layer is the consumer's own over every position"
    fixed, n = selective.repair(b, wrong, ids, mask, "deviation", 3 / 16)
    assert n == 3 and _err(fixed, own) < 1e-4, f"repaired at the positions it chose: {_err(fixed, own):.2e} off"


def test_the_structural_rule_takes_the_last_tokens_then_separators_and_never_padding():
    from scd.online.model_files import load_tokenizer
    from tests.conftest import DEMO
    tok = load_tokenizer(DEMO / "base")
    ids = tok.encode("Ilse keeps bees.\nTilda lives in Orrin Vale, near the river and the old mill")
    t = len(ids)
    pad = 3
    ids_t = torch.tensor([[0] * pad + ids])
    mask = torch.tensor([[0] * pad + [1] * t])
    pieces = [tok.convert_tokens_to_string([p]) for p in tok.convert_ids_to_tokens(ids)]
    separators = [pad + c for c, p in enumerate(pieces) if selective.SEPARATOR.search(p) and c < t - 4]
    assert separators, pieces
    sel = selective.structural(ids_t, mask, tok, (4 + len(separators)) / t, last=4)
    want = sorted(separators + list(range(pad + t - 4, pad + t)))
    assert sel.tolist() == [want], (sel.tolist(), want, pieces)
    everything = selective.structural(ids_t, mask, tok, 1.0)
    assert everything.tolist() == [list(range(pad, pad + t))], "every real position, no padding"


def test_the_cost_is_zero_with_nothing_selected_a_prefill_with_every_layer_and_grows_with_the_selection():
    from transformers import LlamaConfig
    config = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152)      # SmolLM2-135M's shape
    assert selective.cost(config, 2048, 0) == 0
    assert abs(selective.cost(config, 2048, 0, first_layers=30) - 1) < 1e-9
    shares = [selective.cost(config, 2048, s) for s in (64, 256, 512, 1024)]
    assert shares == sorted(shares) and 0 < shares[0] < 64 / 2048 * 1.5, shares
