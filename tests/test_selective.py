"""Selective token recompute (scd.online.selective): every position selected is the consumer's own prefill,
the last k are a tail, the others stay as given; CacheBlend's deviation rule finds the positions a cache got
wrong; the attention, suffix and structural rules; the cost model's ends; artifacts and specialists that serve a
rule. The learned rule's selector: tests/test_selector.py."""
import pytest
import torch

from scd.evaluation import methods
from scd.online import selective
from scd.online.selective import run_tail
from scd.online.trace import capture
from tests.conftest import cache_of, largest_diff, left_padded_batch, perturbed, tiny_llama


def _all(mask) -> torch.Tensor:
    """Every column of a batch whose rows are all unpadded."""
    return torch.arange(mask.shape[1]).expand(mask.shape[0], -1).contiguous()


def test_every_position_recomputed_over_another_models_cache_is_the_consumers_own_prefill():
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(12, 12))
    raw, own = cache_of(a, ids, mask), cache_of(b, ids, mask)
    assert largest_diff(raw, own) > 1e-2, "the two models' caches must differ for this test to mean anything"
    got = selective.recompute_tokens(b, raw, ids, mask, _all(mask))
    assert largest_diff(got, own) < 1e-4, f"all positions recomputed differ from the own prefill by {largest_diff(got, own):.2e}"
    every, sel = selective.repair(b, raw, ids, mask, "last", 1.0)          # a tail of all: the first one too
    assert sel.shape[1] == 12 and largest_diff(every, own) < 1e-4, \
        f"the last rule at a share of 1 differs from the own prefill by {largest_diff(every, own):.2e}"


def test_the_last_positions_recomputed_are_a_tail_and_the_others_stay_as_given_left_padding_and_all():
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(12, 7, 9))
    raw = cache_of(a, ids, mask)
    t = ids.shape[1]
    sel = torch.arange(t - 4, t).expand(3, -1).contiguous()
    got = selective.recompute_tokens(b, raw, ids, mask, sel)
    tail = run_tail(b, raw, ids, mask, 4)
    assert largest_diff(got, tail, mask) < 1e-4, f"the last 4 recomputed differ from a tail of 4 by {largest_diff(got, tail, mask):.2e}"
    by_rule, n = selective.repair(b, raw, ids, mask, "last", 4 / 7)              # 4 of the shortest row's 7
    assert n.shape[1] == 4 and largest_diff(by_rule, tail, mask) < 1e-4, "the last rule is that tail"
    assert largest_diff(got, raw, columns=slice(None, t - 4)) == 0, "positions not selected must stay as given"


def test_scattered_positions_are_the_consumers_own_where_every_earlier_position_is_too():
    """Positions 0..5 selected: attention from them sees only themselves, so they equal the own prefill's;
    a later scattered set changes those positions only."""
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(12,))
    raw, own = cache_of(a, ids, mask), cache_of(b, ids, mask)
    sel = torch.tensor([[0, 1, 2, 3, 4, 5]])
    got = selective.recompute_tokens(b, raw, ids, mask, sel)
    assert largest_diff(got, own, columns=slice(0, 6)) < 1e-4, f"a prefix's first positions: {largest_diff(got, own, columns=slice(0, 6)):.2e}"
    sel = torch.tensor([[2, 5, 9]])
    got = selective.recompute_tokens(b, raw, ids, mask, sel)
    rest = [c for c in range(12) if c not in (2, 5, 9)]
    assert largest_diff(got, raw, columns=rest) == 0
    assert largest_diff(got, raw, columns=[2, 5, 9]) > 1e-2, "the selected positions must be the consumer's"
    assert largest_diff(got, own, columns=[2]) > 0 and largest_diff(got, own, columns=[2]) < largest_diff(raw, own, columns=[2]), \
        "a selected position attending over another model's cache moves toward the consumer's own"


def test_chunks_recompute_what_one_pass_does_and_read_the_same_attention():
    """Chunks of 2 (each over the columns up to its last, the earlier chunks' own K, V in place) give the
    K, V and the attention received of one pass over every column, left padding and all."""
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(12, 9, 11))
    raw = cache_of(a, ids, mask)
    sel = torch.tensor([[1, 4, 5, 8, 10, 11], [3, 6, 7, 9, 10, 11], [2, 3, 6, 7, 9, 11]])
    seen_one, seen_chunks = torch.zeros(ids.shape), torch.zeros(ids.shape)
    one = selective.recompute_tokens(b, raw, ids, mask, sel, attended=seen_one, chunk=64)
    chunks = selective.recompute_tokens(b, raw, ids, mask, sel, attended=seen_chunks, chunk=2)
    assert largest_diff(chunks, one) < 1e-5, f"chunked recompute differs from one pass by {largest_diff(chunks, one):.2e}"
    err = (seen_chunks - seen_one).abs().max().item()
    assert err < 1e-5, f"attention received differs by {err:.2e}"
    assert largest_diff(raw, one) > 1e-2 and largest_diff(raw, cache_of(a, ids, mask)) == 0, "the given cache is left as it was"


def test_the_deviation_rule_finds_the_positions_a_cache_got_wrong_and_gives_the_first_layer_exact():
    b = tiny_llama(1)
    ids, mask = left_padded_batch(lengths=(16,))
    own = cache_of(b, ids, mask)
    wrong = [(k.clone(), v.clone()) for k, v in own]
    for c in (3, 8, 13):                                   # the first layer's K and V off at three positions
        wrong[0][0][..., c, :] += 0.5
        wrong[0][1][..., c, :] -= 0.5
    sel, first = selective.deviation(b, wrong, ids, mask, 3 / 16)
    assert sel.tolist() == [[3, 8, 13]], sel
    assert largest_diff(first, own[:1]) < 1e-4, "the rule's first layer is the consumer's own over every position"
    fixed, n = selective.repair(b, wrong, ids, mask, "deviation", 3 / 16)
    assert n.tolist() == [[3, 8, 13]] and largest_diff(fixed, own) < 1e-4, f"repaired at the positions it chose: {largest_diff(fixed, own):.2e} off"


def test_the_windows_attention_over_the_consumers_own_cache_is_its_own_forwards_attention_weights():
    """`attended` sums the last positions' softmax attention over layers and heads: over the consumer's own
    cache it equals what its eager forward over the whole prefix reports for those queries."""
    b = tiny_llama(1)
    b.config._attn_implementation = "eager"
    ids, mask = left_padded_batch(lengths=(14, 10))
    t, w = ids.shape[1], 4
    out = b(input_ids=ids, attention_mask=mask, output_attentions=True)
    want = sum(a[:, :, t - w:, :].sum((1, 2)) for a in out.attentions) * mask            # (B, T)
    got = torch.zeros(2, t)
    selective.recompute_tokens(b, cache_of(b, ids, mask), ids, mask, torch.arange(t - w, t).expand(2, -1), attended=got)
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"attention received differs from the eager forward's by {err:.2e}"
    assert abs(got.sum().item() - 2 * w * 3 * 4) < 1e-3, "each query's weights sum to one, per layer and head"


def test_the_attention_rule_keeps_its_window_and_takes_the_positions_the_window_reads():
    """A position whose K the window's queries all align with is selected; the window is, and the count."""
    b = tiny_llama(1)
    ids, mask = left_padded_batch(lengths=(40,))
    own = cache_of(b, ids, mask)
    w = selective.WINDOW
    sel = selective.attention(b, own, ids, mask, 20 / 40)
    assert sel.shape == (1, 20) and sel[0, -w:].tolist() == list(range(40 - w, 40)), sel
    loud = [(k.clone(), v) for k, v in own]
    for k, _ in loud:                                       # position 5's key scaled up: every query reads it
        k[..., 5, :] *= 40
    assert 5 in selective.attention(b, loud, ids, mask, (w + 1) / 40)[0].tolist()
    repaired, n = selective.repair(b, loud, ids, mask, "attention", (w + 1) / 40)
    assert n.shape[1] == w + 1 and largest_diff(repaired, own, columns=[5]) < largest_diff(loud, own, columns=[5]) / 10, \
        "the selected position is the consumer's own again"


def test_the_attention_rule_at_a_share_within_its_window_is_a_tail_of_the_window_run_once():
    """A share of at most the window selects the window itself: repaired as a tail of it (one pass, no scoring),
    equal to the attention rule's own selection recomputed, and counted as that tail."""
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(40, 33))
    raw = cache_of(a, ids, mask)
    w = selective.WINDOW
    got, sel = selective.repair(b, raw, ids, mask, "attention", 4 / 33)
    chosen = selective.attention(b, raw, ids, mask, 4 / 33)
    assert sel.tolist() == chosen.tolist() and sel.shape[1] == w, (sel, chosen)
    want = selective.recompute_tokens(b, raw, ids, mask, chosen)
    assert largest_diff(got, want, mask) < 1e-4, f"the tail differs from the rule's selection recomputed by {largest_diff(got, want, mask):.2e}"
    m = methods.Selective(methods.RawKV(), "attention", 4 / 40)
    once, tail_cost = m.counted(b.config, 40), selective.cost(b.config, 40, w)
    assert once == pytest.approx(tail_cost), f"the window counted {once:.3f} of a prefill, a tail of {w} {tail_cost:.3f}"


def test_the_suffix_rule_takes_the_positions_the_requests_tokens_read_most_and_needs_them():
    """A position whose K the request's queries all align with is selected, wherever it lies; the repair is
    recompute_tokens at the top of reads_of; without the request's tokens the rule refuses."""
    b = tiny_llama(1)
    ids, mask = left_padded_batch(lengths=(40,))
    own = cache_of(b, ids, mask)
    reader = torch.tensor([[11, 12, 13]])
    loud = [(k.clone(), v) for k, v in own]
    for k, _ in loud:                                       # position 5's key scaled up: every query reads it
        k[..., 5, :] *= 40
    repaired, sel = selective.repair(b, loud, ids, mask, "suffix", 4 / 40, reader=reader)
    want = selective.top(selective.reads_of(b, loud, mask, reader), mask, 4)
    assert sel.tolist() == want.tolist() and 5 in sel[0].tolist(), (sel, want)
    assert largest_diff(repaired, selective.recompute_tokens(b, loud, ids, mask, want)) == 0
    assert largest_diff(repaired, own, columns=[5]) < largest_diff(loud, own, columns=[5]) / 10, "position 5 is the consumer's own"
    with pytest.raises(ValueError, match="request's tokens"):
        selective.repair(b, loud, ids, mask, "suffix", 4 / 40)


def test_an_artifact_with_the_suffix_rule_rebuilds_by_the_requests_reads_and_is_served(tmp_path):
    """tail_rule "suffix" round-trips in the manifest; rebuild repairs the plan's cache at the positions the
    reader reads most (another reader, other positions), and refuses without one; a specialist serving it
    reads the request's suffix: its row's prefix cache is that rebuild's."""
    from actors.messages import GenParams
    from engines.producer import ProducerEngine
    from engines.specialist import SpecialistEngine
    from scd.online import codec
    from scd.online.artifacts import PairArtifacts
    from scd.online.models import ModelSpec
    from scd.online.rebuild import encode, rebuild
    from tests.test_models import _tokenizer
    a = tiny_llama(0, layers=4)
    b = perturbed(tiny_llama(0, layers=4), 0.3, seed=1)
    plain = PairArtifacts.exact("a:b", ModelSpec.from_config(a.config), ["exact", "shared", "shared", "shared"], "bf16")
    plain.with_tail(10, 40, "suffix").save(tmp_path / "art")
    art = PairArtifacts.load(tmp_path / "art")
    assert (art.tail_tokens, art.tail_of, art.tail_rule) == (10, 40, "suffix")
    ids = torch.randint(2, 97, (1, 80), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    codes = codec.as_received(encode(art, capture(a, ids, mask), ids), "bf16")
    base, _ = rebuild(b, plain, codes)
    reader = torch.tensor([[11, 12]])
    kv, phases = rebuild(b, art, codes, reader=reader)
    want, sel = selective.repair(b, base, ids, mask, "suffix", 20 / 80, reader=reader)   # 10 of 40: 20 of 80
    assert largest_diff(kv, want) < 1e-6 and "tail_ms" in phases, largest_diff(kv, want)
    other, _ = rebuild(b, art, codes, reader=torch.tensor([[50, 3, 77, 21, 9]]))
    assert largest_diff(other, kv) > 0, "another request reads other positions"
    with pytest.raises(ValueError, match="request's tokens"):
        rebuild(b, art, codes)
    prefix = ids[0].tolist()
    payload = ProducerEngine(a, _tokenizer(97), {"a:b": (art, "v1")}, cache_bytes=1 << 20).encode(
        prefix, ["a:b"]).per_pair["a:b"].payload
    engine = SpecialistEngine("b", b, _tokenizer(97), art, "v1")
    row, info, _ = engine._row(prefix, [11, 12], payload, None, GenParams(max_tokens=4), {})
    assert info.mode == "scd" and "tail" in info.timings, info
    err = max((row.keys[l][..., :80, :] - k).abs().max().item() for l, (k, _) in enumerate(want))
    assert err < 1e-5, f"the served row's keys differ from the rebuild repaired by its suffix's reads by {err:.2e}"


def test_the_evaluator_gives_a_method_that_reads_the_request_the_samples_question_and_refuses_a_text_window():
    """built_for: a QA sample's question is the request's suffix a suffix-rule repair reads (the same cache as
    repair by hand); a text window has none, and the method is refused in a line, not run without it."""
    from scd.evaluation.evaluate import Evaluator, Sample
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    g = torch.Generator().manual_seed(5)
    prefix, question = torch.randint(2, 97, (30,), generator=g), torch.randint(2, 97, (4,), generator=g)
    m = methods.Selective(methods.RawKV(), "suffix", 0.2)
    assert m.reads_request and not methods.Selective(methods.RawKV(), "last", 0.2).reads_request
    ids, mask = prefix[None], torch.ones(1, 30, dtype=torch.long)
    tr = capture(a, ids, mask)
    got = methods.built_for(m, b, ids, mask, tr, question[None]).kv
    want, _ = selective.repair(b, methods.RawKV().build(b, ids, mask, tr).kv, ids, mask, "suffix", 0.2,
                               reader=question[None])
    assert largest_diff(got, want) == 0
    ev = Evaluator(a, b)
    qa = Sample(prefix, torch.cat([question, question]), question=question)
    assert ev.kl(qa, m) >= 0 and m.counted(b.config, 30) > methods.Selective(methods.RawKV(), "last", 0.2).counted(
        b.config, 30), "the question's first pass is counted"
    with pytest.raises(ValueError, match="without a question"):
        ev.kl(Sample(prefix, question), m)


def test_the_attention_and_suffix_rules_read_their_own_forward_while_other_requests_run_the_same_model():
    """An engine runs several requests through one model at once: another thread's forwards pass the same
    modules while a rule reads its queries (and a trace its x_norm), and are not taken for this one's."""
    import threading
    b = tiny_llama(1)
    ids, mask = left_padded_batch(lengths=(40,))
    own = cache_of(b, ids, mask)
    reader = torch.tensor([[11, 12, 13]])
    want_att = selective.attention(b, own, ids, mask, 0.5)
    want_read = selective.reads_of(b, own, mask, reader)
    want_x = capture(b, ids, mask).xnorm
    other, _ = left_padded_batch(lengths=(23,), seed=9)
    stop = threading.Event()

    def busy():
        with torch.no_grad():
            while not stop.is_set():
                b(input_ids=other)
    t = threading.Thread(target=busy)
    t.start()
    try:
        for _ in range(15):
            assert selective.attention(b, own, ids, mask, 0.5).tolist() == want_att.tolist()
            assert torch.allclose(selective.reads_of(b, own, mask, reader), want_read, atol=1e-5)
            got = capture(b, ids, mask).xnorm
            assert len(got) == len(want_x) and all(torch.equal(g, w) for g, w in zip(got, want_x))
    finally:
        stop.set()
        t.join()


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
    assert selective.cost(config, 2048, 64, window=64) == 2 * shares[0], "the attention rule's window runs twice"
    every = selective.cost(config, 2048, 2048, columns=list(range(2048)), chunk=1)
    assert abs(every - 1) < 0.01, f"every position, one at a time, is a prefill: {every:.4f}"
    early, late = (selective.cost(config, 2048, 512, columns=list(c), chunk=128) for c in (range(512), range(1536, 2048)))
    assert early < late < shares[2], f"chunks count the columns up to their last: {(early, late, shares[2])}"


def test_an_artifact_with_the_attention_rule_keeps_it_through_a_save_and_rebuilds_by_it(tmp_path):
    """tail_rule "attention" round-trips in the manifest and rebuild runs selective.attention's positions over
    the cache the plan rebuilt, not the last ones."""
    import pytest

    from scd.online import codec
    from scd.online.artifacts import PairArtifacts
    from scd.online.models import ModelSpec
    from scd.online.rebuild import encode, rebuild
    a = tiny_llama(0, layers=4)
    b = perturbed(tiny_llama(0, layers=4), 0.3, seed=1)
    spec = ModelSpec.from_config(a.config)
    plain = PairArtifacts.exact("a:b", spec, ["exact", "shared", "shared", "shared"], "bf16")
    plain.with_tail(10, 40, "attention").save(tmp_path / "art")
    art = PairArtifacts.load(tmp_path / "art")
    assert (art.tail_tokens, art.tail_of, art.tail_rule) == (10, 40, "attention")
    assert "tail_rule" not in plain.with_tail(10, 40).description()
    assert plain.with_tail(0, 0, "attention").tail_rule == "last", "no tail, no rule"
    with pytest.raises(ValueError, match="tail_rule must be one of"):
        plain.with_tail(4, 0, "scattered")
    ids = torch.randint(2, 97, (1, 80), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    codes = codec.as_received(encode(art, capture(a, ids, mask), ids), "bf16")
    kv, phases = rebuild(b, art, codes)
    base, _ = rebuild(b, plain, codes)
    sel = selective.attention(b, base, ids, mask, 20 / 80)                    # 10 of 40: 20 of these 80
    want = selective.recompute_tokens(b, base, ids, mask, sel)
    assert largest_diff(kv, want) < 1e-6 and "tail_ms" in phases, largest_diff(kv, want)
    assert largest_diff(kv, run_tail(b, base, ids, mask, 20)) > 1e-3, "scattered positions, not a tail of the same count"


@pytest.mark.parametrize("rule", ["attention", "learned"])
def test_a_selective_plan_is_served_by_a_specialist(rule):
    import dataclasses

    from actors.messages import GenParams
    from engines.producer import ProducerEngine
    from engines.specialist import SpecialistEngine
    from scd.online.artifacts import PairArtifacts
    from scd.online.models import ModelSpec
    from tests.test_models import _tokenizer
    a = tiny_llama(0, layers=4)
    b = perturbed(tiny_llama(0, layers=4), 0.3, seed=1)
    art = PairArtifacts.exact("a:b", ModelSpec.from_config(a.config), ["exact", "shared", "shared", "shared"], "bf16")
    width = a.config.num_key_value_heads * (a.config.hidden_size // a.config.num_attention_heads)
    art = dataclasses.replace(art, selector=torch.linspace(-1, 1, 2 * width + selective.POSITION_FEATURES),
                              selector_layers=[1, 3]).with_tail(8, 0, rule)
    ids = list(range(5, 45))
    payload = ProducerEngine(a, _tokenizer(97), {"a:b": (art, "v1")}, cache_bytes=1 << 20).encode(
        ids, ["a:b"]).per_pair["a:b"].payload
    _, info, _ = SpecialistEngine("b", b, _tokenizer(97), art, "v1").complete(ids, [11], payload, None,
                                                                                GenParams(max_tokens=4))
    assert info.mode == "scd" and "tail" in info.timings and info.tokens == 4, info
