"""Every supported architecture on tiny random configs (no downloads): llama, llama3 RoPE scaling, mistral,
qwen2 (q/k/v biases) and qwen3 (per-head q_norm/k_norm before RoPE).

For each: a cache assembled from the oracle's de-RoPE'd keys gives the oracle's logits (left padding
included), layer-0 K/V and Patch-style K/V regeneration from x_norm match the model's own cache, the fused
Patch path equals the direct one, and an identical pair at full rank rebuilds its own KV through Reuse."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from scd.fitting.calibrate import Calibration
from scd.online import cache, rope, trace
from scd.online.models import ModelSpec
from scd.online.patch import Aligner, FusedPatches, regenerate_kv
from scd.online.rebuild import encode, rebuild
from scd.online.tables import ConsumerTables, layer0_input
from tests.conftest import fit_settings, left_padded_batch

D = 8   # head dim
ARCHS = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                               "rope_theta": 500000.0}}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


def tiny(arch: str, seed: int = 0):
    """A tiny random model of `arch`; every weight (biases and norm gains included) moved off its init,
    so a bias or a norm that a code path forgot shows up as an error."""
    model_type, over = ARCHS[arch]
    cfg = AutoConfig.for_model(model_type, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=D, max_position_embeddings=256,
                               pad_token_id=0, eos_token_id=1, bos_token_id=1, **over)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _batch():
    return left_padded_batch(lengths=(40, 23, 31))          # past llama3's original 16 positions


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_spec_names_the_architecture_and_its_rope_variant(arch):
    spec = ModelSpec.from_config(tiny(arch).config)
    assert spec.model_type == ARCHS[arch][0] and spec.head_dim == D
    assert bool(spec.rope_scaling) == (arch == "llama3-rope"), spec.rope_scaling
    if arch == "llama3-rope":
        plain = ModelSpec.from_config(tiny("llama").config)
        assert spec.fingerprint() != plain.fingerprint(), "a RoPE variant must change the config fingerprint"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_oracle_kv_cache_gives_the_oracle_logits(arch):
    model = tiny(arch)
    ids, mask = _batch()
    cont = torch.randint(2, 97, (ids.shape[0], 5), generator=torch.Generator().manual_seed(9))
    full_ids, full_mask = torch.cat([ids, cont], 1), torch.cat([mask, torch.ones_like(cont)], 1)
    with torch.no_grad():
        ref = model(input_ids=full_ids, attention_mask=full_mask,
                    position_ids=rope.positions_from_mask(full_mask)).logits[:, ids.shape[1]:]
    tr = trace.capture(model, ids, mask)
    cos, sin = rope.cos_sin(model, tr.positions)
    kv = [(rope.apply_rope(c, cos, sin), v) for c, v in zip(tr.content, tr.values)]
    logits, _ = cache.extend(model, cache.assemble(model, kv), mask, cont)
    err = (logits - ref).abs().max().item()
    assert err < 1e-4, f"{arch}: logits from the re-RoPE'd oracle cache differ from a full forward by {err:.2e}"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_kv_regenerated_from_x_norm_and_layer0_tables_match_the_cache(arch):
    model = tiny(arch)
    ids, mask = _batch()
    tr = trace.capture(model, ids, mask)
    cos, sin = rope.cos_sin(model, tr.positions)
    keep = mask.bool()[:, None, :, None]
    for l, layer in enumerate(model.model.layers):
        k, v = regenerate_kv(layer, tr.xnorm[l], cos, sin, D)
        err = max(((k - tr.keys[l]) * keep).abs().max().item(), ((v - tr.values[l]) * keep).abs().max().item())
        assert err < 1e-5, f"{arch} layer {l}: K/V regenerated from x_norm differ from the cache by {err:.2e}"
    for kept in (True, False):
        tables = ConsumerTables(model, D, max_vocab_elements=1 << 30 if kept else 0)
        k0, v0 = tables.layer0(ids)
        k0 = rope.apply_rope(k0.view(*ids.shape, -1, D).transpose(1, 2), cos, sin)
        v0 = v0.view(*ids.shape, -1, D).transpose(1, 2)
        err = max(((k0 - tr.keys[0]) * keep).abs().max().item(), ((v0 - tr.values[0]) * keep).abs().max().item())
        assert err < 1e-5, f"{arch}: layer-0 tables (kept={kept}) differ from the cache by {err:.2e}"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fused_patches_equal_the_direct_path(arch):
    model = tiny(arch)
    layers = [model.model.layers[1], model.model.layers[2]]
    ids, mask = _batch()
    cos, sin = rope.cos_sin(model, rope.positions_from_mask(mask))
    x0 = layer0_input(model, ids)
    torch.manual_seed(1)
    aligners = [Aligner(6, 32, 16, context=3, token_dim=4, window_dim=2).eval() for _ in layers]
    for g in aligners:
        torch.nn.init.normal_(g.out.weight, std=0.2)
    zs = [torch.randn(*ids.shape, 6) for _ in layers]
    with torch.no_grad():
        refs = [regenerate_kv(layer, g(z, mask, x0), cos, sin, D) for g, layer, z in zip(aligners, layers, zs)]
        ks, vs = FusedPatches(aligners, layers)(zs, mask, ids, x0)
    keep = mask.bool()[:, None, :, None]
    for i, (ref_k, ref_v) in enumerate(refs):
        k = rope.apply_rope(ks[i].view(*ids.shape, -1, D).transpose(1, 2), cos, sin)
        v = vs[i].view(*ids.shape, -1, D).transpose(1, 2)
        err = max(((k - ref_k) * keep).abs().max().item(), ((v - ref_v) * keep).abs().max().item())
        assert err < 1e-4, f"{arch}: fused patch layer {i} differs from the direct path by {err:.2e}"


def _rebuild_error(model, art, ids, mask) -> float:
    """Largest |rebuilt - cached| over every layer's K and V at real (unpadded) positions."""
    tr = trace.capture(model, ids, mask)
    kv, _ = rebuild(model, art, encode(art, tr, ids))
    keep = mask.bool()[:, None, :, None]
    return max(max(((k - tk) * keep).abs().max().item(), ((v - tv) * keep).abs().max().item())
               for (k, v), tk, tv in zip(kv, tr.keys, tr.values))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_identical_pair_at_full_rank_rebuilds_its_own_kv(arch, tmp_path):
    model = tiny(arch)
    spec = ModelSpec.from_config(model.config)
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(2, 97, (int(n),), generator=g) for n in torch.randint(20, 48, (24,), generator=g)]
    cal = Calibration(model, model, spec, "a:a", prefixes, tmp_path, fit_settings(r_k=D, r_v=D, ridge=1e-9, batch=8),
                      progress=False, log=lambda s: None)
    cal.traces()
    art = cal.artifacts_for(cal.base_plan)
    ids, mask = _batch()
    err = _rebuild_error(model, art, ids, mask)
    assert err < 1e-4, f"{arch}: full-rank Reuse of an identical pair, max KV error {err:.2e}"


@pytest.mark.parametrize("arch", sorted(a for a in ARCHS if a != "qwen3"))
def test_identical_pair_at_full_rank_rebuilds_its_own_kv_from_hidden_states(arch, tmp_path):
    """K and V are affine in x_norm (qwen3's k_norm is not: that architecture is covered by the per-head
    Reuse test above), so regression from x_norm at the full K/V width reproduces the cache."""
    model = tiny(arch)
    spec = ModelSpec.from_config(model.config)
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(2, 97, (int(n),), generator=g) for n in torch.randint(20, 48, (24,), generator=g)]
    cfg = fit_settings(reuse_source="hidden", r_x=2 * 2 * D, ridge=1e-9, batch=8)
    cal = Calibration(model, model, spec, "a:a", prefixes, tmp_path, cfg, progress=False, log=lambda s: None)
    cal.traces()
    art = cal.artifacts_for(cal.base_plan)
    assert art.plan[1:] == ["hidden"] * 2 and art.r_x == 32
    ids, mask = _batch()
    err = _rebuild_error(model, art, ids, mask)
    assert err < 1e-3, f"{arch}: full-rank hidden-state Reuse of an identical pair, max KV error {err:.2e}"
