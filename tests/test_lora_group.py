"""A LoRA group (scd.online.lora_group): adapters held unmerged on one base, rows of different adapters in one
batch, equal to each adapter merged into its own copy of the base (fp32, CPU)."""
import json

import pytest
import torch
from transformers import LlamaForCausalLM

from scd.online.lora_group import AdapterError, LoraGroup, read_adapter
from tests.conftest import tiny_llama

ADAPTERS = {                      # name -> LoRA settings: ranks, targets and scalings differ on purpose
    "attn": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
    "all": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]},
    "mlp_rs": {"r": 8, "lora_alpha": 4, "use_rslora": True, "target_modules": ["gate_proj", "up_proj", "down_proj"],
               "layers_to_transform": [1, 2]},
}


def make_adapter(base_dir, out_dir, seed: int, **lora) -> LlamaForCausalLM:
    """Save a PEFT LoRA adapter of the base with random (not identity) factors; return it merged."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    peft = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir), LoraConfig(**lora))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.normal_(std=0.3)
    peft.save_pretrained(str(out_dir))
    return peft.merge_and_unload().eval()


@pytest.fixture(scope="module")
def group_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-group")
    tiny_llama(layers=3).save_pretrained(root / "base")
    merged = {name: make_adapter(root / "base", root / name, seed, **cfg)
              for seed, (name, cfg) in enumerate(ADAPTERS.items(), start=1)}
    base = LlamaForCausalLM.from_pretrained(root / "base").eval()
    group = LoraGroup(base, [read_adapter(name, root / name, base) for name in ADAPTERS])
    return root, base, group, merged


def test_a_mixed_batch_equals_each_adapter_merged(group_setup):
    """Four rows (the base and three adapters) share a prefix's base cache... each row's prefix is its own
    model's here: the suffix and three decode steps of the mixed batch against each merged model's forward."""
    root, base, group, merged = group_setup
    models = {"": base, **merged}
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, 97, (1, 9), generator=g)
    names = ["all", "", "attn", "mlp_rs"]
    idx = torch.tensor([group.index(n) for n in names])
    keys, values, seqs = [], [], []
    with torch.no_grad():
        for n in names:                       # each row's prefix cache: its own model's (exact for the check)
            out = models[n](input_ids=prefix, use_cache=True)
            keys.append([layer.keys for layer in out.past_key_values.layers])
            values.append([layer.values for layer in out.past_key_values.layers])
    layers = len(keys[0])
    k = [torch.cat([keys[r][li] for r in range(len(names))]) for li in range(layers)]
    v = [torch.cat([values[r][li] for r in range(len(names))]) for li in range(layers)]
    seqs = [prefix.clone() for _ in names]
    mask = torch.ones(len(names), prefix.shape[1], dtype=torch.long)
    pos = torch.full((len(names),), prefix.shape[1])
    for step in range(3):
        tokens = torch.tensor([5 + step, 17, 42, 60 - step])
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits, k, v = group.step(k, v, mask, pos, tokens, idx)
        pos = pos + 1
        seqs = [torch.cat([s, t.view(1, 1)], 1) for s, t in zip(seqs, tokens)]
        with torch.no_grad():
            for r, n in enumerate(names):
                want = models[n](input_ids=seqs[r]).logits[0, -1]
                err = (logits[r] - want).abs().max().item()
                assert err < 1e-4, f"step {step}, row of adapter {n or 'base'!r}: logits differ by {err:.2e}"


def test_a_suffix_with_an_adapter_on_the_bases_cache_equals_the_merged_model_on_the_same_cache(group_setup):
    """extend: the suffix of one row, its adapter on, over a cache it did not compute (the base's prefix)."""
    root, base, group, merged = group_setup
    prefix, suffix = torch.tensor([[3, 9, 27, 4, 50, 61]]), torch.tensor([[11, 12, 13]])
    with torch.no_grad():
        out = base(input_ids=prefix, use_cache=True)
    keys = [layer.keys for layer in out.past_key_values.layers]
    values = [layer.values for layer in out.past_key_values.layers]
    for name, model in merged.items():
        logits, _, _ = group.extend(keys, values, suffix, group.index(name))
        from scd.online import fast_decode
        want, _, _ = fast_decode.step_for(model).extend(keys, values, suffix)
        err = (logits - want).abs().max().item()
        assert err < 1e-4, f"{name}: the suffix's logits differ from the merged model's by {err:.2e}"


def test_adapters_a_group_cannot_hold_are_refused_in_one_line(group_setup, tmp_path):
    root, base, group, merged = group_setup
    with pytest.raises(AdapterError, match="not a PEFT adapter folder"):
        read_adapter("x", tmp_path, base)
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (dora / f).write_bytes((root / "all" / f).read_bytes())
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter("d", dora, base)
    wider = tiny_llama(layers=3)
    wider_dir = tmp_path / "wider"
    from transformers import LlamaConfig
    LlamaForCausalLM(LlamaConfig(**{**wider.config.to_dict(), "intermediate_size": 48})).save_pretrained(wider_dir)
    make_adapter(wider_dir, tmp_path / "wide_adapter", 7, r=2, lora_alpha=2, target_modules=["up_proj"])
    with pytest.raises(AdapterError, match=r"up_proj has factors .* the base's up_proj is 64 x 32"):
        read_adapter("w", tmp_path / "wide_adapter", base)
    with pytest.raises(AdapterError, match="names repeat"):
        LoraGroup(base, [read_adapter("a", root / "attn", base), read_adapter("a", root / "all", base)])


def test_the_prefix_once_on_the_base_gives_each_adapter_its_merged_models_own_prefill(group_setup):
    """prefill: the base's layers once; mlp_rs (layers 1-2 adapted) runs layers 1.. from the base's residual and
    references the base's layer-0 cache; attn and all (layer 0 adapted) prefill themselves."""
    root, base, group, merged = group_setup
    prefix = torch.tensor([[3, 9, 27, 4, 50, 61, 7, 8]])
    got = group.prefill(prefix, list(ADAPTERS))
    assert group.prefill_share(list(ADAPTERS)) == {"attn": 1.0, "all": 1.0, "mlp_rs": 2 / 3}
    for name, model in {"": base, **merged}.items():
        with torch.no_grad():
            want = model(input_ids=prefix, use_cache=True)
        logits, keys, values = got[name]
        err = (logits - want.logits[:, -1]).abs().max().item()
        assert err < 1e-4, f"{name or 'base'}: the prefix's last logits differ by {err:.2e}"
        for layer, (a, b) in enumerate(zip(keys + values, [lay.keys for lay in want.past_key_values.layers]
                                           + [lay.values for lay in want.past_key_values.layers])):
            kv_err = (a - b).abs().max().item()
            assert kv_err < 1e-4, f"{name or 'base'}, layer {layer % len(keys)}: K/V differ by {kv_err:.2e}"
    assert got["mlp_rs"][1][0] is got[""][1][0] and got["mlp_rs"][2][0] is got[""][2][0]
    assert got["mlp_rs"][1][1] is not got[""][1][1]


def test_the_group_benchmark_runs_on_a_config_of_adapters(tmp_path):
    """tools.bench_lora_group on a small pair (tests/byom_pair: a 2-layer Llama and a LoRA on every layer), the
    adapter served as two specialists, one of them by a plan's shape (codes below a block entered at layer 1):
    every greedy answer is the merged model's, and the report is complete."""
    import yaml

    from tests.byom_pair import build
    from tools.bench_lora_group import main as bench
    pair = build(tmp_path)
    cfg = tmp_path / "group.yaml"
    cfg.write_text(yaml.safe_dump({"producer": {"name": "base", "path": str(pair["base"])}, "specialists": [
        {"name": "qa", "path": str(pair["adapter"])}, {"name": "code", "path": str(pair["adapter"])}]}))
    r = bench(["--config", str(cfg), "--prompts", "2", "--prompt-tokens", "16", "--tokens", "3", "--cache", "16",
               "--steps", "2", "--rounds", "1", "--fanout-tokens", "32", "--plan-shapes", "code=1"])
    assert r["adapters"] == ["qa", "code"] and r["left_out"] == [] and list(r["plans"]) == ["code"]
    assert all(v["equal"] == v["prompts"] == 2 for v in r["greedy"].values()), r["greedy"]
    assert r["fanout"]["share"] == {"qa": 1.0, "code": 0.5} and r["decode"]["mixed"] > 0, r["fanout"]
    assert r["fanout"]["modes"] == {"qa": "fallback", "code": "scd"}, r["fanout"]
    assert r["memory"]["merged_bytes"] == 2 * r["memory"]["base_bytes"]
    assert torch.is_grad_enabled()                     # the benchmark leaves the process as it found it


def test_an_activated_lora_in_a_group_runs_the_base_before_its_invocation_and_its_factors_from_it(tmp_path):
    """An aLoRA (invocation [7, 8]) in a group: a prefix without the invocation is the base's cache itself; a
    suffix that invokes it runs the base's weights before the invocation and the adapter's from it, and decode
    steps run the adapter: equal to the base's and the merged adapter's forwards split the same way."""
    from peft import LoraConfig, get_peft_model

    from scd.online import fast_decode
    tiny_llama(layers=3).save_pretrained(tmp_path / "base")
    torch.manual_seed(5)
    peft = get_peft_model(LlamaForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], alora_invocation_tokens=[7, 8]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.normal_(std=0.3)
    peft.save_pretrained(str(tmp_path / "alora"))
    base = LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    on = make_adapter(tmp_path / "base", tmp_path / "as_lora", 5, r=4, lora_alpha=8,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    group = LoraGroup(base, [read_adapter("alora", tmp_path / "alora", base)])
    assert group.invocation[group.index("alora")] == (7, 8)

    prefix = torch.tensor([[3, 9, 27, 4, 50, 61]])
    got = group.prefill(prefix, ["alora"])
    assert got["alora"][1][0] is got[""][1][0] and group.prefill_share(["alora"]) == {"alora": 0.0}

    suffix = torch.tensor([[11, 7, 8, 13, 14]])                    # invoked at its second token
    _, bk, bv = got[""]
    logits, keys, values = group.extend(bk, bv, suffix, group.index("alora"))
    fb, fo = fast_decode.step_for(base), fast_decode.step_for(on)
    _, wk, wv = fb.extend(bk, bv, suffix[:, :1])
    want, wk, wv = fo.extend(wk, wv, suffix[:, 1:])
    err = (logits - want).abs().max().item()
    assert err < 1e-4, f"the invoking suffix's logits differ by {err:.2e}"
    t = keys[0].shape[2]
    step, _, _ = group.step(keys, values, torch.ones(1, t + 1, dtype=torch.long), torch.tensor([t]),
                            torch.tensor([20]), torch.tensor([group.index("alora")]))
    want_step, _, _ = fo(wk, wv, torch.ones(1, t + 1, dtype=torch.long), torch.tensor([t]), torch.tensor([20]))
    err = (step - want_step).abs().max().item()
    assert err < 1e-4, f"a decode step after the invocation differs by {err:.2e}"
    plain, _, _ = group.extend(bk, bv, torch.tensor([[11, 12]]), group.index("alora"))   # no invocation: the base
    base_logits, _, _ = fb.extend(bk, bv, torch.tensor([[11, 12]]))
    assert (plain - base_logits).abs().max().item() < 1e-5
