import inspect

import torch

from scd.online import cache, decode, rope, trace
from scd.online.rebuild import exact_layer0
from scd.online.tables import ConsumerTables, layer0_input
from tests.conftest import left_padded_batch, tiny_llama


def test_derope_of_rope_is_identity():
    model = tiny_llama()
    pos = torch.arange(50).repeat(2, 1)
    cos, sin = rope.cos_sin(model, pos)
    k = torch.randn(2, 2, 50, 8)
    err = (rope.remove_rope(rope.apply_rope(k, cos, sin), cos, sin) - k).abs().max().item()
    assert err < 1e-5, f"deRoPE(RoPE(k)) != k, max err {err:.2e}"


def test_exact_layer0_matches_the_models_own_layer0():
    model = tiny_llama()
    ids, mask = left_padded_batch()
    tr = trace.capture(model, ids, mask)
    cos, sin = rope.cos_sin(model, tr.positions)
    k, v = exact_layer0(model, ids, cos, sin, 8)
    err = max((k - tr.keys[0]).abs().max().item(), (v - tr.values[0]).abs().max().item())
    assert err < 1e-5, f"layer-0 regeneration error {err:.2e}"


def test_consumer_tables_look_up_what_the_model_computes():
    model = tiny_llama()
    ids, mask = left_padded_batch()
    tr = trace.capture(model, ids, mask)
    for kept in (True, False):                               # vocabulary tables kept, or computed on the fly
        tables = ConsumerTables(model, 8, max_vocab_elements=1 << 30 if kept else 0)
        cos, sin = tables.rope(tr.positions, torch.float32)
        ref_cos, ref_sin = rope.cos_sin(model, tr.positions)
        k, v = tables.layer0(ids)                        # (B, T, n_kv * d), K before RoPE
        k = rope.apply_rope(k.view(*ids.shape, -1, 8).transpose(1, 2), cos, sin)
        v = v.view(*ids.shape, -1, 8).transpose(1, 2)
        errs = {"cos": (cos - ref_cos).abs().max().item(), "sin": (sin - ref_sin).abs().max().item(),
                "x0": (tables.x0(ids) - layer0_input(model, ids)).abs().max().item(),
                "k0": (k - tr.keys[0]).abs().max().item(), "v0": (v - tr.values[0]).abs().max().item()}
        assert max(errs.values()) < 1e-5, f"tables kept={kept}: {errs}"
        far = torch.arange(3000)[None]                      # past the first table: it grows
        err = (tables.rope(far, torch.float32)[0] - rope.cos_sin(model, far)[0]).abs().max().item()
        assert err < 1e-4, f"cos at positions up to 3000 differs by {err:.2e}"


def test_generate_from_cache_matches_generate_from_scratch_greedy():
    model = tiny_llama()
    ids, mask = left_padded_batch()
    prefix, last = ids[:, :-1], ids[:, -1:]
    tr = trace.capture(model, prefix, mask[:, :-1])
    got = decode.generate(model, cache.assemble(model, list(zip(tr.keys, tr.values))), mask[:, :-1], last, 6)
    # reference: plain autoregressive loop re-running the whole sequence each step
    seq, m = ids.clone(), mask.clone()
    ref = []
    with torch.no_grad():
        for _ in range(6):
            lg = model(input_ids=seq, attention_mask=m, position_ids=rope.positions_from_mask(m)).logits[:, -1]
            nxt = lg.argmax(-1)
            ref.append(nxt)
            seq, m = torch.cat([seq, nxt[:, None]], 1), torch.cat([m, torch.ones(3, 1, dtype=m.dtype)], 1)
    assert torch.equal(got, torch.stack(ref, 1)), f"cached greedy {got.tolist()} != reference {torch.stack(ref, 1).tolist()}"


def test_sampling_is_seeded_and_tiny_top_p_is_greedy():
    model = tiny_llama()
    ids, mask = left_padded_batch()
    tr = trace.capture(model, ids[:, :-1], mask[:, :-1])
    kv = list(zip(tr.keys, tr.values))
    run = lambda **kw: decode.generate(model, cache.assemble(model, kv), mask[:, :-1], ids[:, -1:], 8, **kw)  # noqa: E731
    greedy = run()
    assert torch.equal(run(temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(0)), greedy)
    s1 = run(temperature=1.5, generator=torch.Generator().manual_seed(7))
    s2 = run(temperature=1.5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(s1, s2) and s1.shape == (3, 8)


def test_eos_stops_rows_and_pads_them():
    """Each row ends at its own first eos (kept) and is padded with eos; the others run on to max_new_tokens.
    The eos token is taken from the rows' own greedy continuation: once as the first token of row 0, once in
    the middle of row 1."""
    model = tiny_llama()
    ids, mask = left_padded_batch()
    tr = trace.capture(model, ids[:, :-1], mask[:, :-1])
    kv = list(zip(tr.keys, tr.values))
    n = 5
    free = decode.generate(model, cache.assemble(model, kv), mask[:, :-1], ids[:, -1:], n).tolist()   # no eos
    for eos in (free[0][0], free[1][2]):
        want = []
        for row in free:
            end = row.index(eos) + 1 if eos in row else n
            want.append(row[:end] + [eos] * (n - end))
        assert any(eos not in row for row in free) and any(eos in row for row in free), (eos, free)
        out = decode.generate(model, cache.assemble(model, kv), mask[:, :-1], ids[:, -1:], n, eos_id=eos)
        assert out.tolist() == want, f"eos {eos}: got {out.tolist()}, want {want} (without eos: {free})"


def test_xnorm_errors_are_zero_for_the_oracle_and_start_after_a_corrupted_layer():
    from scd.evaluation.diagnostics import xnorm_errors
    model = tiny_llama()
    ids, mask = left_padded_batch()
    tr = trace.capture(model, ids, mask)
    kv = list(zip(tr.keys, tr.values))
    cont = torch.randint(2, 97, (3, 4), generator=torch.Generator().manual_seed(1))
    assert max(xnorm_errors(model, kv, kv, mask, cont)) < 1e-5
    bad = list(kv)
    bad[1] = (kv[1][0] + 1.0, kv[1][1])
    errs = xnorm_errors(model, bad, kv, mask, cont)
    assert errs[0] < 1e-5 and errs[1] < 1e-5 and errs[2] > 1e-3, errs   # layer 1's cache first affects layer 2's input


def test_consumer_tables_follow_the_model_to_another_dtype():
    from scd.online.tables import consumer_tables
    model = tiny_llama()
    ids = torch.randint(2, 97, (1, 6))
    first = consumer_tables(model, 8)
    assert consumer_tables(model, 8) is first                      # made once
    model.to(torch.float64)
    moved = consumer_tables(model, 8)
    assert moved is not first and moved.x0(ids).dtype == torch.float64


def test_the_cache_goes_by_the_name_the_installed_transformers_takes():
    """transformers 5.24 renamed past_key_values to cache (the old name warns, and goes in 5.40): tracing,
    decoding on a cache and recomputing layers must use the name the model's forward takes."""
    import warnings

    from scd.evaluation.methods import DroidSpeak

    model = tiny_llama()
    ids, mask = left_padded_batch()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        tr = trace.capture(model, ids[:, :-1], mask[:, :-1], want_hidden=True)
        decode.generate(model, cache.assemble(model, list(zip(tr.keys, tr.values))), mask[:, :-1], ids[:, -1:], 3)
        block = DroidSpeak(n_layers=1, start=1).recompute(model, tr.hidden[1], mask[:, :-1], tr.positions)
    err = max((block[0][0] - tr.keys[1]).abs().max().item(), (block[0][1] - tr.values[1]).abs().max().item())
    assert err < 1e-5, f"layer 1 recomputed from its own input differs from the trace by {err:.2e}"

    class OldStyle(torch.nn.Module):                          # a model of transformers before 5.24
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            pass

    assert cache.cache_arg(OldStyle(), "c") == {"past_key_values": "c"}
    assert list(cache.cache_arg(model, "c")) == [next(n for n in ("cache", "past_key_values")
                                                       if n in inspect.signature(type(model).forward).parameters)]


def test_an_assembled_cache_holds_the_given_tensors_and_leaves_them_as_they_were():
    model = tiny_llama()
    ids, mask = left_padded_batch()
    tr = trace.capture(model, ids[:, :-2], mask[:, :-2])
    kv = list(zip(tr.keys, tr.values))
    before = [(k.clone(), v.clone()) for k, v in kv]
    c = cache.assemble(model, kv)
    assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(c.layers, kv)), \
        "assemble copied the tensors it was given"
    cache.extend(model, c, mask[:, :-2], ids[:, -2:], mask[:, -2:])
    err = max(max((k - k0).abs().max().item(), (v - v0).abs().max().item()) for (k, v), (k0, v0) in zip(kv, before))
    assert err == 0, f"extending an assembled cache changed the tensors it was assembled from by {err:.2e}"
    assert c.layers[0].keys.shape[-2] == ids.shape[1], "the extended cache does not hold the two new positions"


def test_filling_a_cache_without_logits_fills_it_as_the_full_forward_does():
    model = tiny_llama()
    ids, mask = left_padded_batch()
    tr = trace.capture(model, ids[:, :-3], mask[:, :-3])
    filled = []
    for logits in (True, False):
        c = cache.assemble(model, list(zip(tr.keys, tr.values)))
        out, full = cache.extend(model, c, mask[:, :-3], ids[:, -3:], mask[:, -3:], logits=logits)
        assert (out is None) == (not logits) and full.shape == mask.shape
        filled.append([(layer.keys, layer.values) for layer in c.layers])
    err = max(max((a[0] - b[0]).abs().max().item(), (a[1] - b[1]).abs().max().item()) for a, b in zip(*filled))
    assert err < 1e-6, f"the cache filled without the head differs from the full forward's by {err:.2e}"


def test_a_trace_holds_no_autograd_graph_whatever_the_callers_grad_mode():
    """trace.capture runs under no_grad: a caller in grad mode with trainable weights (a calibration stage after
    a resumed fine-tuning) gets plain tensors. A trace that kept its forward's graph held every layer's
    activations with it (the block stage's aligner fit grew by 0.5 GB a prefix on smollm2)."""
    model = tiny_llama(0, layers=2).requires_grad_(True)
    ids = torch.randint(0, 97, (1, 9))
    assert torch.is_grad_enabled()
    tr = trace.capture(model, ids, want_hidden=True)
    held = {"keys": tr.keys, "values": tr.values, "content": tr.content, "xnorm": tr.xnorm, "hidden": tr.hidden}
    carrying = [f"{name}[{i}]" for name, ts in held.items() for i, t in enumerate(ts) if t.requires_grad]
    assert not carrying, f"trace tensors carrying a graph: {carrying}"


def test_id_row_is_the_row_torch_tensor_makes():
    for ids in ([5, 151_000, 2**40], (3, 1, 2), list(range(4000)), []):
        want = torch.tensor([list(ids)], dtype=torch.long)
        got = cache.id_row(ids)
        assert got.dtype == torch.long and got.shape == want.shape and torch.equal(got, want), (ids[:5], got.shape)
