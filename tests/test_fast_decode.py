"""fast_decode's step equals transformers' forward over one new token per row of a left-padded batch (fp32),
for Llama and Qwen2 (attention biases), and models it does not cover fall back to transformers."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from scd.online import fast_decode
from scd.online.cache import assemble, cache_arg, cache_of
from scd.online.decode import Batch
from tests.conftest import left_padded_batch, tiny_llama


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).eval()


def _reference(model, keys, values, mask, pos, tokens):
    """transformers' own forward of the step, on a cache holding the same tensors."""
    c = assemble(model, list(zip(keys, values)))
    out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=pos[:, None], use_cache=True,
                **cache_arg(model, c))
    return out.logits[:, -1], [layer.keys for layer in c.layers], [layer.values for layer in c.layers]


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_a_step_equals_transformers_on_a_left_padded_batch(make):
    model = make()
    ids, mask = left_padded_batch()                                   # (3, 12), rows of 12, 7 and 9 tokens
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    use_cache=True)
    keys = [layer.keys for layer in cache_of(out).layers]
    values = [layer.values for layer in cache_of(out).layers]
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    pos, tokens = mask.sum(1), torch.tensor([5, 17, 42])
    fast = fast_decode.step_for(model)
    assert fast is not None
    logits, k, v = fast(keys, values, step_mask, pos, tokens)
    with torch.no_grad():
        ref, rk, rv = _reference(model, keys, values, step_mask, pos, tokens)
    err = (logits - ref).abs().max().item()
    assert err < 1e-5, f"logits differ from transformers' by {err:.2e}"
    for layer, (a, b) in enumerate(zip(k + v, rk + rv)):
        kv_err = (a - b).abs().max().item()
        assert a.shape == b.shape and kv_err < 1e-5, f"layer {layer % len(k)}: K/V differ by {kv_err:.2e}"


def test_the_batch_steps_through_it_and_a_model_it_does_not_cover_through_transformers():
    llama = tiny_llama()
    dynamic = LlamaForCausalLM(LlamaConfig(**{**llama.config.to_dict(), "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}})).eval()
    assert fast_decode.supported(llama) and not fast_decode.supported(dynamic)
    assert fast_decode.step_for(dynamic) is None
    for model in (llama, dynamic):                    # both paths give transformers' next tokens
        ids = torch.tensor([[3, 9, 27, 4]])
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        batch = Batch([layer.keys for layer in cache_of(out).layers],
                      [layer.values for layer in cache_of(out).layers], torch.ones_like(ids), torch.tensor([4]))
        with torch.no_grad():
            got = batch.step(model, torch.tensor([11]))
            want = model(input_ids=torch.tensor([[3, 9, 27, 4, 11]])).logits[:, -1]
        err = (got - want).abs().max().item()
        assert err < 1e-5, f"{model.config.rope_parameters['rope_type']}: the step's logits differ by {err:.2e}"
        assert batch.keys[0].shape[2] == 5 and batch.pos.tolist() == [5]


def test_a_peft_model_is_not_covered():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert not fast_decode.supported(model)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_the_static_cache_step_equals_transformers_over_rows_of_different_lengths(make):
    """StaticStep (the GPU's captured step, run eagerly here): rows of 12, 7 and 9 tokens in one buffer of fixed
    capacity, stepped three times, give transformers' logits for each row's whole sequence."""
    model = make()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 97, (1, n), generator=g) for n in (12, 7, 9)]
    st = fast_decode.StaticStep(model, batch=3, capacity=20)
    with torch.no_grad():
        for i, ids in enumerate(rows):
            out = model(input_ids=ids, use_cache=True)
            st.load(i, [layer.keys for layer in cache_of(out).layers],
                    [layer.values for layer in cache_of(out).layers])
        for step in range(3):
            tokens = torch.tensor([5 + step, 17, 42 - step])
            got = st.step(tokens).clone()
            rows = [torch.cat([ids, t.view(1, 1)], 1) for ids, t in zip(rows, tokens)]
            want = torch.cat([model(input_ids=ids).logits[:, -1] for ids in rows])
            err = (got - want).abs().max().item()
            assert err < 1e-5, f"step {step}: logits differ from transformers' by {err:.2e}"
    assert st.pos.tolist() == [15, 10, 12]
    with pytest.raises(ValueError, match="does not fit a capacity of 20"):
        st.load(0, [torch.zeros(1, 2, 20, 8)], [torch.zeros(1, 2, 20, 8)])


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_a_suffix_on_a_cache_equals_transformers_forward(make):
    """extend (a request's suffix over its prefix cache, as the engines run it) against transformers' forward of
    the whole sequence: the last logits and every layer's keys and values."""
    model = make()
    g = torch.Generator().manual_seed(2)
    prefix, suffix = torch.randint(2, 97, (1, 10), generator=g), torch.randint(2, 97, (1, 5), generator=g)
    with torch.no_grad():
        out = model(input_ids=prefix, use_cache=True)
        whole = model(input_ids=torch.cat([prefix, suffix], 1), use_cache=True)
    fast = fast_decode.step_for(model)
    logits, keys, values = fast.extend([layer.keys for layer in cache_of(out).layers],
                                       [layer.values for layer in cache_of(out).layers], suffix)
    err = (logits - whole.logits[:, -1]).abs().max().item()
    assert err < 1e-5, f"the suffix's last logits differ from transformers' by {err:.2e}"
    for layer, (a, b) in enumerate(zip(keys + values, [lay.keys for lay in cache_of(whole).layers]
                                       + [lay.values for lay in cache_of(whole).layers])):
        kv_err = (a - b).abs().max().item()
        assert a.shape == b.shape and kv_err < 1e-5, f"layer {layer % len(keys)}: K/V differ by {kv_err:.2e}"


def test_a_model_stays_trainable_after_its_step_is_built_in_inference_mode():
    """FastStep fuses the projections' weights (the parameters become views of them); built inside inference
    mode, as a serving engine does, the model still trains (calibration fine-tunes models it also decodes)."""
    model = tiny_llama()
    with torch.inference_mode():
        assert fast_decode.step_for(model) is not None
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    grad = model.model.layers[0].self_attn.k_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_a_model_built_in_inference_mode_steps_outside_it_after_its_step_is_built():
    """The other way round: a model made inside inference mode (tools.bench_size builds timing families so),
    its step built there, then run by transformers outside it (the engines' fallback paths)."""
    with torch.inference_mode():
        model = tiny_llama()
        assert fast_decode.step_for(model) is not None
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[3, 4, 5]]))
    assert out.logits.shape == (1, 3, 97)
