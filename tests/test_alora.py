"""An activated LoRA (aLoRA, adapted from its invocation tokens on): loaded, it computes what PEFT's own aLoRA
computes, and a prefix without the invocation is the base's cache, served whole from the producer's."""
import pytest
import torch

from actors.messages import GenParams
from engines.producer import ProducerEngine
from engines.specialist import SpecialistEngine
from scd.fitting import exact
from tests.conftest import DEMO


@pytest.fixture(scope="module")
def alora(tmp_path_factory):
    """An activated LoRA of the demo base on q/k/v/o of every layer, switched on by tokens [7, 8]; saved as a
    PEFT folder, and the PEFT model itself (the reference for what the adapter computes)."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    out = tmp_path_factory.mktemp("alora") / "alora"
    base = AutoModelForCausalLM.from_pretrained(DEMO / "base", dtype=torch.float32).eval()   # as load() does
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                           alora_invocation_tokens=[7, 8], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2, generator=torch.Generator().manual_seed(len(n)))
    peft.save_pretrained(str(out))
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(DEMO / "base")
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out, peft.eval()


def _ids(n, seed, invoke_at=None):
    ids = torch.randint(20, 200, (1, n), generator=torch.Generator().manual_seed(seed))
    if invoke_at is not None:
        ids[0, invoke_at:invoke_at + 2] = torch.tensor([7, 8])
    return ids


def test_an_activated_lora_runs_its_base_before_the_invocation_and_the_adapter_from_it(alora):
    """Loaded, an aLoRA computes what PEFT's own aLoRA computes: the K and V of a prompt that invokes it, and
    the logits of a continuation on a prefix without the invocation."""
    from scd.online import cache
    from scd.online.models import load
    from scd.online.trace import capture
    folder, peft = alora
    model, _, _ = load(folder)
    ids = _ids(30, 1, invoke_at=20)
    with torch.no_grad():
        ref = peft(input_ids=ids, use_cache=True)
    ours = capture(model, ids, want_xnorm=False)
    ref_cache = cache.cache_of(ref)
    err = max(float((a - b.keys).abs().max()) for a, b in zip(ours.keys, ref_cache.layers))
    assert err < 1e-4, f"K of a prompt invoking the aLoRA at 20 differs from PEFT's by {err:.2e}"
    prefix, suffix = ids[:, :16], ids[:, 16:]                # the invocation lies in the suffix
    c = cache.assemble(model, list(zip(*(lambda t: (t.keys, t.values))(capture(model, prefix, want_xnorm=False)))))
    logits, _ = cache.extend(model, c, torch.ones_like(prefix), suffix)
    gap = float((logits - ref.logits[:, 16:]).abs().max())
    assert gap < 1e-3, f"a suffix that invokes the aLoRA on a shared prefix: logits differ from PEFT's by {gap:.2e}"
    base_only = capture(model, prefix, want_xnorm=False)     # no invocation: the base's cache, bit for bit
    from transformers import AutoModelForCausalLM
    plain = capture(AutoModelForCausalLM.from_pretrained(DEMO / "base", dtype=torch.float32).eval(), prefix,
                    want_xnorm=False)
    assert all(torch.equal(a, b) for a, b in zip(base_only.keys, plain.keys))


def test_an_activated_loras_whole_prefix_is_served_from_the_producers_cache(alora):
    from scd.fitting.structure import find
    from scd.online.models import load
    folder, _ = alora
    model, tok, spec = load(folder)
    base, _, _ = load(DEMO / "base")
    found = find(base, model)
    assert found.invocation_tokens == (7, 8) and found.exact_plan and found.recompute_fraction == 0.0, found
    art = exact.artifact("base:alora", spec, spec.num_layers, "bf16", whole_prefix=True)
    assert art.plan == ["shared"] * spec.num_layers and art.consumer_layers == 0
    producer = ProducerEngine(base, tok, {"base:alora": (art, "v1")}, cache_bytes=1 << 22)
    served, oracle = SpecialistEngine("alora", model, tok, art, "v1"), SpecialistEngine("alora", model, tok)
    params = GenParams(max_tokens=10)
    for seed in range(4):
        prefix = _ids(24 + 8 * seed, seed)[0].tolist()
        suffix = _ids(6, 100 + seed, invoke_at=4)[0].tolist()       # the question, then the invocation
        payload = producer.encode(prefix, ["base:alora"]).per_pair["base:alora"].payload
        text, info, _ = served.complete(prefix, suffix, payload, None, params)
        assert info.mode == "scd" and "recompute" not in info.timings, info
        assert text == oracle.complete(prefix, suffix, None, "oracle", params)[0], f"seed {seed}"
    invoked = _ids(24, 9, invoke_at=10)[0].tolist()                # the invocation inside the prefix
    payload = producer.encode(invoked, ["base:alora"]).per_pair["base:alora"].payload
    _, info, _ = served.complete(invoked, [30, 31], payload, None, params)
    assert info.mode == "fallback" and info.reason == "invocation_in_prefix", info
