"""What a consumer shares with its producer, found from its structure (scd.fitting.structure): a LoRA on the
top layers, a fine-tune of every layer, an aLoRA; each checked against both models run on the same tokens."""
import json

import pytest
import torch

from scd.fitting.structure import SharedStructure, find, from_weights, verify
from tests.conftest import left_padded_batch, perturbed, tiny_llama


def _lora(base, layers, out=None, alora=None):
    """base + a LoRA on q/k/v/o and the MLP of `layers` (None: every layer), merged; saved to `out` if given."""
    from peft import LoraConfig, get_peft_model
    copy = tiny_llama(0, layers=base.config.num_hidden_layers)
    kw = {"alora_invocation_tokens": alora, "task_type": "CAUSAL_LM"} if alora else {}
    peft = get_peft_model(copy, LoraConfig(r=4, lora_alpha=8, layers_to_transform=layers, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"], **kw))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:                               # LoRA starts as the identity: move it
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(hash(n) % 1000))
    if out is not None:
        peft.save_pretrained(str(out))
    return peft.merge_and_unload().eval() if not alora else peft.eval()


def test_a_lora_on_the_top_layers_shares_everything_below_them_exactly():
    base = tiny_llama(0, layers=6)
    top = _lora(base, [4, 5])
    s = from_weights(base, top)
    assert (s.first_adapted, s.num_layers, s.source) == (4, 6, "weights"), s
    assert s.recompute_fraction == pytest.approx(2 / 6)
    ids, mask = left_padded_batch()
    err = verify(base, top, s, ids, mask)
    assert err == 0.0, f"layers 0-3 and the residual entering 4 should be the producer's bit for bit: {err:.2e}"
    wrong = SharedStructure(5, 6, "weights")                 # one layer too many: layer 4's K/V differ
    assert verify(base, top, wrong, ids, mask) > 1e-3, "verify must see an adapted layer claimed as shared"
    assert "layers 0-3 of 6" in s.describe() and "0.33 of a prefill" in s.describe()


def test_a_fine_tune_of_every_layer_shares_nothing_and_a_middle_lora_shares_what_is_below_it():
    base = tiny_llama(0, layers=6)
    assert from_weights(base, perturbed(base, 0.1)).first_adapted == 0
    mid = _lora(base, [2, 3])
    assert from_weights(base, mid).first_adapted == 2
    assert from_weights(base, tiny_llama(0, layers=6)).first_adapted == 6          # the same weights: all shared


def test_an_activated_lora_is_found_from_its_config_and_its_prefix_before_the_invocation_is_the_bases(tmp_path):
    base = tiny_llama(0, layers=4)
    invoke = [7, 8, 9]
    alora = _lora(base, None, out=tmp_path / "alora", alora=invoke)
    assert json.loads((tmp_path / "alora" / "adapter_config.json").read_text())["alora_invocation_tokens"] == invoke
    merged_view = alora.base_model.model                    # the adapter's modules in place (aLoRA cannot merge)
    s = find(base, merged_view, tmp_path / "alora")
    assert s.invocation_tokens == tuple(invoke) and s.recompute_fraction == 0.0, s
    ids, mask = left_padded_batch()
    ids = torch.where(torch.isin(ids, torch.tensor(invoke)), torch.full_like(ids, 11), ids)  # no invocation in it
    with torch.no_grad():
        err = verify(base, alora, s, ids, mask)
    assert err < 1e-5, f"an aLoRA's prefix before its invocation should be the base's cache: {err:.2e}"
    invoked = ids.clone()
    invoked[:, -6:-3] = torch.tensor(invoke)                # the invocation inside the prefix: the adapter acts
    with torch.no_grad():
        live = verify(base, alora, s, invoked, mask)
    assert live > 1e-3, f"the aLoRA must change the cache after its invocation, or this test proves nothing: {live}"


def test_the_exact_plan_rebuilds_the_oracles_cache_up_to_the_wires_rounding():
    """The exact plan of a LoRA of the top layers, through the wire format: bf16 is the oracle's cache to bf16
    rounding (its KL far below raw KV reuse's), int8 costs little more KL in about half the bytes; the
    consumer runs only layers s..L-1."""
    from scd.evaluation.evaluate import Evaluator, Sample
    from scd.evaluation.methods import RawKV, exact
    from scd.online.models import ModelSpec
    base = tiny_llama(0, layers=6)
    top = _lora(base, [4, 5])
    spec = ModelSpec.from_config(base.config)
    g = torch.Generator().manual_seed(5)
    samples = [Sample(torch.randint(2, 97, (24,), generator=g), torch.randint(2, 97, (8,), generator=g))
               for _ in range(3)]
    ev = Evaluator(base, top)
    refs = [ev.reference(s) for s in samples]
    bf16, int8 = exact("a:b", spec, 4), exact("a:b", spec, 4, "int8")
    assert bf16.art.plan == ["exact", "shared", "shared", "shared", "entry", "recompute"]
    assert bf16.art.consumer_layers == 2 and bf16.art.blocks == [(4, 6)]
    kl = {m.name: sum(ev.kl(s, m, r) for s, r in zip(samples, refs)) / len(samples) for m in (RawKV(), bf16, int8)}
    assert kl["exact"] < 1e-4 and kl["exact"] < 0.01 * kl["raw_kv"], kl
    assert kl["exact_int8"] < 0.1 * kl["raw_kv"], kl
    ids, mask, ptrace, oracle, _ = refs[0]
    built = bf16.build(top, ids, mask, ptrace)
    err = max(float((a - b).abs().max()) for (a, b), (c, d) in zip(built.kv, oracle.kv) for a, b in ((a, c), (b, d)))
    assert err < 0.05, f"the exact plan's cache is the oracle's up to bf16 rounding; max |difference| {err:.3e}"
    t = ids.shape[1]
    codes = 3 * 2 * ptrace.keys[0].numel() * 2 + ptrace.hidden[4].numel() * 2     # bf16 K, V of 1-3 + residual
    assert codes + 5 * t <= built.payload_bytes <= codes + 5 * t + 1024, (built.payload_bytes, codes)
    assert int8.build(top, ids, mask, ptrace).payload_bytes < 0.75 * built.payload_bytes
    with pytest.raises(ValueError, match="shared layers"):
        exact("a:b", spec, 0)


def test_an_exact_plans_payload_round_trips_the_producers_own_tensors():
    """Shared K and V and the entry residual cross the codec as they are (fp16 here: bit for bit after the
    cast); a plan whose recompute follows no entry is refused."""
    from scd.online import codec
    from scd.online.artifacts import PairArtifacts, exact_plan
    from scd.online.models import ModelSpec
    from scd.online.rebuild import encode
    from scd.online.trace import capture
    base = tiny_llama(0, layers=4)
    spec = ModelSpec.from_config(base.config)
    art = PairArtifacts.exact("a:b", spec, exact_plan(4, 2), "fp16")
    ids, mask = left_padded_batch()
    tr = capture(base, ids, mask, want_hidden=True)
    payload = codec.encode(encode(art, tr, ids), "a:b", "v1", codec.artifact_dims(art), "fp16")
    got = codec.decode(payload, "a:b", "v1", art.plan, codec.level_dims(art))
    assert torch.equal(got.layers[1]["k"], tr.keys[1].half()) and torch.equal(got.layers[1]["v"], tr.values[1].half())
    assert torch.equal(got.layers[2]["z_e"].reshape(tr.hidden[2].shape), tr.hidden[2].half())
    assert set(got.layers) == {1, 2}, "layer 0 is regenerated from tokens and layer 3 recomputed: nothing sent"
    with pytest.raises(ValueError, match="not run by the consumer"):
        PairArtifacts.exact("a:b", spec, ["exact", "shared", "recompute", "recompute"])
    with pytest.raises(ValueError, match="without want_hidden|want_hidden"):
        encode(art, capture(base, ids, mask), ids)
