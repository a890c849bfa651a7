"""The cross-layer probe's rebuild: a model's own K and V are linear in its x_norm, so its full-rank code
rebuilds the model's own cache (RoPE and layouts included); a lower rank can only do worse."""
import torch

from jobs.probe_cross_layer import CrossLayer, consumer_rows, producer_rows
from scd.fitting.gram import JointGram
from scd.online.models import ModelSpec
from scd.online.trace import capture
from tests.conftest import tiny_llama
from tests.test_pipeline_tiny import _samples


def _err(kv, trace):
    return max(max((k - tk).abs().max().item(), (v - tv).abs().max().item())
               for (k, v), tk, tv in zip(kv, trace.keys, trace.values))


def test_a_models_own_cache_is_rebuilt_from_its_full_rank_cross_layer_code():
    model = tiny_llama(0)
    spec = ModelSpec.from_config(model.config)
    width = (spec.num_layers - 1) * 2 * spec.num_kv_heads * spec.head_dim
    gram = JointGram((spec.num_layers - 1) * spec.hidden_size, width)
    for s in range(0, 48, 16):
        ids = torch.stack([x.prefix for x in _samples(48, 1)[s:s + 16]])
        mask = torch.ones_like(ids)
        tr = capture(model, ids, mask)
        gram.update(producer_rows(tr, mask.bool()), consumer_rows(tr, mask.bool()))
    ids = torch.stack([x.prefix for x in _samples(2, 9)])
    mask = torch.ones_like(ids)
    tr = capture(model, ids, mask)
    full = _err(CrossLayer(gram.fit_regression(width, 1e-8), spec).build(model, ids, mask, tr).kv, tr)
    low = _err(CrossLayer(gram.fit_regression(4, 1e-8), spec).build(model, ids, mask, tr).kv, tr)
    assert full < 1e-3, f"full-rank cross-layer code rebuilt the model's own cache with error {full:.2e}"
    assert low > 5 * full, f"rank 4 ({low:.2e}) should lose to the full rank ({full:.2e})"
