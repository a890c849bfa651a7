"""The cross-layer probe's rebuild: a model's own K and V are linear in its x_norm, so its full-rank code
rebuilds the model's own cache (RoPE and layouts included); a lower rank can only do worse."""
import torch

from tools.probe_cross_layer import CrossLayer, consumer_rows, producer_rows
from scd.online.artifacts import code_groups
from scd.fitting.gram import JointGram
from scd.online.models import ModelSpec
from scd.online.trace import capture
from tests.conftest import random_samples, tiny_llama


def _err(kv, trace):
    return max(max((k - tk).abs().max().item(), (v - tv).abs().max().item())
               for (k, v), tk, tv in zip(kv, trace.keys, trace.values))


def test_a_models_own_cache_is_rebuilt_from_its_full_rank_cross_layer_code():
    model = tiny_llama(0)
    spec = ModelSpec.from_config(model.config)
    assert code_groups(4, 0) == [[1, 2, 3]] and code_groups(4, 2) == [[1, 2], [3]]
    kv_width = 2 * spec.num_kv_heads * spec.head_dim
    for size in (0, 1):                     # one code for layers 1 and 2, or one per layer
        layer_groups = code_groups(spec.num_layers, size)
        grams = [JointGram(len(g) * spec.hidden_size, len(g) * kv_width) for g in layer_groups]
        for s in range(0, 48, 16):
            ids = torch.stack([x.prefix for x in random_samples(48, 1)[s:s + 16]])
            mask = torch.ones_like(ids)
            tr = capture(model, ids, mask)
            for g, gram in zip(layer_groups, grams):
                gram.update(producer_rows(tr, mask.bool(), g), consumer_rows(tr, mask.bool(), g))
        ids = torch.stack([x.prefix for x in random_samples(2, 9)])
        mask = torch.ones_like(ids)
        tr = capture(model, ids, mask)
        at = lambda r: _err(CrossLayer([(g, gram.fit_regression(min(r, gram.d_b), 1e-8))  # noqa: E731
                                        for g, gram in zip(layer_groups, grams)], spec).build(model, ids, mask, tr).kv, tr)
        full, low = at(10 ** 6), at(4)
        assert full < 1e-3, f"groups of {size}: the full-rank code rebuilt the model's own cache with error {full:.2e}"
        assert low > 5 * full, f"groups of {size}: rank 4 ({low:.2e}) should lose to the full rank ({full:.2e})"


def test_a_window_reads_each_tokens_previous_positions_within_its_own_sequence():
    """producer_rows with window 3: a row is [x_t | x_t-1 | x_t-2] of the same sequence, zeros before its
    start (left padding included), rows only for the kept positions."""
    from scd.fitting.traces import pad
    model = tiny_llama(0)
    prefixes = [x.prefix for x in random_samples(2, 3)]
    ids, mask = pad([prefixes[0][:7], prefixes[1][:4]], 0)          # the second row is left-padded by 3
    tr = capture(model, ids, mask)
    keep = mask.bool()
    one, three = producer_rows(tr, keep, [1, 2]), producer_rows(tr, keep, [1, 2], window=3)
    f = one.shape[1]
    assert three.shape == (11, 3 * f) and torch.equal(three[:, :f], one)
    starts = {0, 7}                                                  # each sequence's first kept row
    for i in range(11):
        for w in (1, 2):
            lagged = three[i, w * f:(w + 1) * f]
            same_seq = all(s not in starts for s in range(i - w + 1, i + 1)) if i - w >= 0 else False
            want = one[i - w] if same_seq else torch.zeros(f)
            assert torch.equal(lagged, want), f"row {i}, lag {w}: wrong features"
