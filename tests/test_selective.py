"""Selective token recompute (scd.online.selective): every position selected is the consumer's own prefill,
the last k are a tail, the others stay as given; CacheBlend's deviation rule finds the positions a cache got
wrong; the structural rule takes the last tokens and separators; the cost model's ends."""
import math

import pytest
import torch

from scd.evaluation import methods
from scd.fitting.selector import fit_selector
from scd.online import selective
from scd.online.selective import run_tail
from scd.online.trace import capture
from tests.conftest import REPO, left_padded_batch, perturbed, tiny_llama


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
    by_rule, n = selective.repair(b, raw, ids, mask, "last", 4 / 7)              # 4 of the shortest row's 7
    assert n.shape[1] == 4 and _err(by_rule, tail, mask) < 1e-4, "the last rule is that tail"
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


def test_chunks_recompute_what_one_pass_does_and_read_the_same_attention():
    """Chunks of 2 (each over the columns up to its last, the earlier chunks' own K, V in place) give the
    K, V and the attention received of one pass over every column, left padding and all."""
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(12, 9, 11))
    raw = _kv(a, ids, mask)
    sel = torch.tensor([[1, 4, 5, 8, 10, 11], [3, 6, 7, 9, 10, 11], [2, 3, 6, 7, 9, 11]])
    seen_one, seen_chunks = torch.zeros(ids.shape), torch.zeros(ids.shape)
    one = selective.recompute_tokens(b, raw, ids, mask, sel, attended=seen_one, chunk=64)
    chunks = selective.recompute_tokens(b, raw, ids, mask, sel, attended=seen_chunks, chunk=2)
    assert _err(chunks, one) < 1e-5, f"chunked recompute differs from one pass by {_err(chunks, one):.2e}"
    err = (seen_chunks - seen_one).abs().max().item()
    assert err < 1e-5, f"attention received differs by {err:.2e}"
    assert _err(raw, one) > 1e-2 and _err(raw, _kv(a, ids, mask)) == 0, "the given cache is left as it was"


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
    assert n.tolist() == [[3, 8, 13]] and _err(fixed, own) < 1e-4, f"repaired at the positions it chose: {_err(fixed, own):.2e} off"


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
    selective.recompute_tokens(b, _kv(b, ids, mask), ids, mask, torch.arange(t - w, t).expand(2, -1), attended=got)
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"attention received differs from the eager forward's by {err:.2e}"
    assert abs(got.sum().item() - 2 * w * 3 * 4) < 1e-3, "each query's weights sum to one, per layer and head"


def test_the_attention_rule_keeps_its_window_and_takes_the_positions_the_window_reads():
    """A position whose K the window's queries all align with is selected; the window is, and the count."""
    b = tiny_llama(1)
    ids, mask = left_padded_batch(lengths=(40,))
    own = _kv(b, ids, mask)
    w = selective.WINDOW
    sel = selective.attention(b, own, ids, mask, 20 / 40)
    assert sel.shape == (1, 20) and sel[0, -w:].tolist() == list(range(40 - w, 40)), sel
    loud = [(k.clone(), v) for k, v in own]
    for k, _ in loud:                                       # position 5's key scaled up: every query reads it
        k[..., 5, :] *= 40
    assert 5 in selective.attention(b, loud, ids, mask, (w + 1) / 40)[0].tolist()
    repaired, n = selective.repair(b, loud, ids, mask, "attention", (w + 1) / 40)
    assert n.shape[1] == w + 1 and _err(repaired, own, columns=[5]) < _err(loud, own, columns=[5]) / 10, \
        "the selected position is the consumer's own again"


def test_the_attention_rule_at_a_share_within_its_window_is_a_tail_of_the_window_run_once():
    """A share of at most the window selects the window itself: repaired as a tail of it (one pass, no scoring),
    equal to the attention rule's own selection recomputed, and counted as that tail."""
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(40, 33))
    raw = _kv(a, ids, mask)
    w = selective.WINDOW
    got, sel = selective.repair(b, raw, ids, mask, "attention", 4 / 33)
    chosen = selective.attention(b, raw, ids, mask, 4 / 33)
    assert sel.tolist() == chosen.tolist() and sel.shape[1] == w, (sel, chosen)
    want = selective.recompute_tokens(b, raw, ids, mask, chosen)
    assert _err(got, want, mask) < 1e-4, f"the tail differs from the rule's selection recomputed by {_err(got, want, mask):.2e}"
    m = methods.Selective(methods.RawKV(), "attention", 4 / 40)
    once, tail_cost = m.counted(b.config, 40), selective.cost(b.config, 40, w)
    assert once == pytest.approx(tail_cost), f"the window counted {once:.3f} of a prefill, a tail of {w} {tail_cost:.3f}"


def test_the_suffix_rule_takes_the_positions_the_requests_tokens_read_most_and_needs_them():
    """A position whose K the request's queries all align with is selected, wherever it lies; the repair is
    recompute_tokens at the top of reads_of; without the request's tokens the rule refuses."""
    b = tiny_llama(1)
    ids, mask = left_padded_batch(lengths=(40,))
    own = _kv(b, ids, mask)
    reader = torch.tensor([[11, 12, 13]])
    loud = [(k.clone(), v) for k, v in own]
    for k, _ in loud:                                       # position 5's key scaled up: every query reads it
        k[..., 5, :] *= 40
    repaired, sel = selective.repair(b, loud, ids, mask, "suffix", 4 / 40, reader=reader)
    want = selective.top(selective.reads_of(b, loud, mask, reader), mask, 4)
    assert sel.tolist() == want.tolist() and 5 in sel[0].tolist(), (sel, want)
    assert _err(repaired, selective.recompute_tokens(b, loud, ids, mask, want)) == 0
    assert _err(repaired, own, columns=[5]) < _err(loud, own, columns=[5]) / 10, "position 5 is the consumer's own"
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
    assert _err(kv, want) < 1e-6 and "tail_ms" in phases, _err(kv, want)
    other, _ = rebuild(b, art, codes, reader=torch.tensor([[50, 3, 77, 21, 9]]))
    assert _err(other, kv) > 0, "another request reads other positions"
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
    assert _err(got, want) == 0
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
    own = _kv(b, ids, mask)
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
    assert _err(kv, want) < 1e-6 and "tail_ms" in phases, _err(kv, want)
    assert _err(kv, run_tail(b, base, ids, mask, 20)) > 1e-3, "scattered positions, not a tail of the same count"


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


def test_reads_of_a_continuation_are_what_it_attends_to_in_the_consumers_eager_forward():
    """selective.reads_of (a learned selector's target, the probe's oracle): the attention a continuation pays
    each prefix position, read over the consumer's own cache, equals its eager forward's weights over the
    prefix and the continuation together."""
    b = tiny_llama(1)
    b.config._attn_implementation = "eager"
    ids, mask = left_padded_batch(lengths=(14, 10))
    ids, mask = ids[1:], mask[1:]                                   # one row, left-padded, as a sample is
    t, cont = ids.shape[1], torch.tensor([5, 9, 11])
    whole = torch.cat([mask, torch.ones(1, 3, dtype=mask.dtype)], 1)
    full = b(input_ids=torch.cat([ids, cont[None]], 1), attention_mask=whole, output_attentions=True)
    want = sum(a[:, :, t:, :t].sum((1, 2)) for a in full.attentions) * mask
    got = selective.reads_of(b, _kv(b, ids, mask), mask, cont[None])
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"the continuation's reads differ from the eager forward's by {err:.2e}"
    assert got[mask == 0].abs().max().item() == 0.0, "padding is never read"


@pytest.mark.parametrize("cache", ["own", "given"])
def test_the_probe_with_every_position_recomputed_is_the_own_prefill_whichever_tokens_chose_them(cache, demo_store,
                                                                                                 tmp_path):
    """tools.probe_selective on the demo family's QA pair, over raw KV and over its published codes: at a share
    of 1 the oracle's (its reads over either cache), the suffix's, the learned selector's and the tail's repairs
    are the consumer's own prefill (KL 0), raw KV and the codes are not, each row carries its F1, and the curves
    are drawn. The suffix's positions chosen in 2 steps (the last running them all again) are the own
    prefill too, at more compute."""
    from tools.probe_selective import main
    argv = ["--config", str(REPO / "ray_config.yaml"), "--pair", "base:qa", "--tokens", "96", "--samples", "1",
            "--rules", "last,learned", "--fractions", "1", "--entries", "", "--suffix", "4", "--oracle",
            "--oracle-cache", cache, "--learned-samples", "2", "--learned-tokens", "64,96",
            "--artifact", "base:qa", "--store", str(demo_store), "--plot", str(tmp_path / "curves.png"),
            "--suffix-rounds", "2"]
    rows = {r["method"]: r for r in main(argv)}
    repaired = {f"{b}+{r}@1" for b in ("raw_kv", "codes") for r in ("last", "learned", "oracle", "suffix")}
    stepped = {"raw_kv+suffixx2@1", "codes+suffixx2@1"}
    assert set(rows) == {"raw_kv", "codes"} | repaired | stepped, rows
    assert rows["raw_kv"]["kl"] > 1e-2 and rows["codes"]["kl"] > 1e-4, (rows["raw_kv"], rows["codes"])
    assert (tmp_path / "curves.png").stat().st_size > 0
    for name in repaired:
        assert rows[name]["kl"] < 1e-6, f"{name}: KL {rows[name]['kl']:.2e} with every position recomputed"
        assert rows[name]["f1"] == rows[name]["oracle_f1"], rows[name]
    assert rows["raw_kv+suffix@1"]["compute"] > rows["raw_kv+oracle@1"]["compute"] >= 1.0, rows
    for b in ("raw_kv", "codes"):
        two, one = rows[f"{b}+suffixx2@1"], rows[f"{b}+suffix@1"]
        assert two["compute"] > one["compute"] and two["kl"] < 1e-6, (two, one)


def test_a_selector_fitted_to_a_planted_score_ranks_as_it_does_and_picks_its_penalty_on_held_back_prefixes():
    """scd.fitting.selector.fit_selector: targets that are a linear score of the features (plus a little noise) are ranked as that
    score ranks them on prefixes it was not fitted on, and the penalty it reports is one it tried."""
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(12, generator=g)
    xs = [torch.randn(60, 12, generator=g) for _ in range(10)]
    ys = [x @ w_true + 0.01 * torch.randn(60, generator=g) for x in xs]
    w, fitted = fit_selector(xs[:8], ys[:8], penalties=(0.01, 1.0))
    assert fitted["penalty"] in (0.01, 1.0) and set(fitted["overlap"]) == {0.01, 1.0}, fitted
    for x, y in zip(xs[8:], ys[8:]):
        k = 12
        got = set((x @ w).topk(k).indices.tolist()) & set(y.topk(k).indices.tolist())
        assert len(got) >= k - 1, f"{len(got)} of the {k} highest-scored positions found"
    with pytest.raises(ValueError, match="at least 2 prefixes"):
        fit_selector(xs[:1], ys[:1])


def test_a_selector_fitted_to_reads_over_the_given_cache_is_the_own_caches_where_they_are_one():
    """scd.fitting.selector.fit_over: the target's reads over the consumer's own cache or over the given one
    give the same selector when the given cache is the consumer's own, and another when it is not."""
    from types import SimpleNamespace

    from scd.fitting.selector import fit_over
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    g = torch.Generator().manual_seed(4)
    windows = [SimpleNamespace(prefix=torch.randint(2, 97, (24,), generator=g),
                               cont=torch.randint(2, 97, (selective.READ_TOKENS,), generator=g)) for _ in range(5)]

    def cache_of(model):
        return lambda ids, mask: (lambda t: list(zip(t.keys, t.values)))(capture(model, ids, mask, want_xnorm=False))
    layers = selective.selector_layers(a.config.num_hidden_layers)
    own, _ = fit_over(a, windows, cache_of(a), layers, target_cache="own")
    same, _ = fit_over(a, windows, cache_of(a), layers, target_cache="given")
    err = ((own - same).norm() / own.norm()).item()
    assert err < 1e-4, f"reads over the own cache passed as the given one: relative difference {err:.2e}"
    mine, _ = fit_over(a, windows, cache_of(b), layers, target_cache="own")
    other, _ = fit_over(a, windows, cache_of(b), layers, target_cache="given")
    rel = ((mine - other).norm() / mine.norm()).item()
    assert rel > 1e-2, f"reads over another model's cache gave the own cache's selector (relative difference {rel:.2e})"
    with pytest.raises(ValueError, match="target_cache"):
        fit_over(a, windows, cache_of(a), layers, target_cache="theirs")


def test_selector_features_read_each_layers_v_its_distance_from_the_end_and_the_first_real_position():
    """selector_features on a left-padded batch: unit-norm V rows of the chosen layers, one distance bucket
    per position (0 at the last, log2 beyond), the log2 distance itself, and the first-position flag on each
    row's first real token."""
    b = tiny_llama(0, layers=4)
    ids, mask = left_padded_batch(lengths=(14, 10))
    kv = _kv(b, ids, mask)
    f = selective.selector_features(kv, mask, [1, 3])
    nv = kv[0][1].shape[1] * kv[0][1].shape[-1]
    t = ids.shape[1]
    assert f.shape == (2, t, 2 * nv + selective.POSITION_FEATURES), f.shape
    v1 = kv[1][1][1].transpose(0, 1).reshape(t, -1)[4:]                    # row 1's real positions
    err = (f[1, 4:, :nv] - v1 / v1.norm(dim=-1, keepdim=True)).abs().max().item()
    assert err < 1e-5, f"layer 1's V differs by {err:.2e}"
    near = f[0, :, 2 * nv:2 * nv + selective.NEAR].argmax(-1).tolist()
    assert near[-1] == 0 and near[-2] == 1 and near[-4] == 2 and near[-5] == 2 and near[0] == 3, near
    far = f[0, :, 2 * nv + selective.NEAR]
    assert far[-1] == 0 and abs(far[0].item() - math.log2(t)) < 1e-6, far
    first = f[:, :, -2]
    assert first[0].nonzero().flatten().tolist() == [0] and first[1].nonzero().flatten().tolist() == [4], first


def test_an_artifact_with_a_learned_selector_keeps_it_through_a_save_and_rebuilds_by_its_positions(tmp_path):
    """tail_rule "learned": the selector's weights and layers round-trip (safetensors and the manifest), an
    artifact asking for the rule without a selector is refused, and rebuild recomputes the positions the
    selector scores highest over the cache the plan rebuilt; every position selected is the own prefill."""
    from scd.online import codec
    from scd.online.artifacts import PairArtifacts
    from scd.online.models import ModelSpec
    from scd.online.rebuild import encode, rebuild
    a = tiny_llama(0, layers=4)
    b = perturbed(tiny_llama(0, layers=4), 0.3, seed=1)
    spec = ModelSpec.from_config(a.config)
    plain = PairArtifacts.exact("a:b", spec, ["exact", "shared", "shared", "shared"], "bf16")
    with pytest.raises(ValueError, match="needs a fitted selector"):
        plain.with_tail(10, 40, "learned")
    layers = [0, 2]
    n = len(layers) * a.config.num_key_value_heads * (a.config.hidden_size // a.config.num_attention_heads)
    w = torch.randn(n + selective.POSITION_FEATURES, generator=torch.Generator().manual_seed(4))
    import dataclasses
    with_sel = dataclasses.replace(plain, selector=w, selector_layers=layers)
    with_sel.with_tail(10, 40, "learned").save(tmp_path / "art")
    art = PairArtifacts.load(tmp_path / "art")
    assert art.tail_rule == "learned" and art.selector_layers == layers and torch.equal(art.selector, w)
    ids = torch.randint(2, 97, (1, 80), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    codes = codec.as_received(encode(art, capture(a, ids, mask), ids), "bf16")
    kv, _ = rebuild(b, art, codes)
    base, _ = rebuild(b, plain, codes)
    sel = selective.learned(base, mask, 20 / 80, (w, layers))
    assert sel.shape == (1, 20)
    want = selective.recompute_tokens(b, base, ids, mask, sel)
    assert _err(kv, want) < 1e-6, _err(kv, want)
    every, _ = rebuild(b, with_sel.with_tail(80, 80, "learned"), codes)
    assert _err(every, _kv(b, ids, mask)) < 1e-4, f"every position selected: {_err(every, _kv(b, ids, mask)):.2e}"


def test_a_selector_is_fitted_on_the_fine_tuning_length_and_the_serving_length_where_the_data_holds_both():
    """jobs.plans.selector_windows: half the windows at the serving length, interleaved with the fine-tuning
    samples, where the consumer's texts are that long; the fine-tuning samples alone where its documents are
    shorter (the demo's notes) or the serving length is not longer."""
    from cluster.calibration_settings import CalibrationSettings
    from jobs.plans import selector_windows
    from scd.data import samples
    from scd.online.models import load
    tok = load(str(REPO / "demo_models" / "base"))[1]
    c = CalibrationSettings(prefix_tokens=96, selector_samples=8)
    code = samples.tune_samples("code", tok, 8, 96, 32)
    assert [s.prefix.shape[-1] for s in selector_windows("code", tok, c, code, 256)] == [96, 256] * 4
    assert selector_windows("code", tok, c, code, 96) == code
    notes = samples.tune_samples("qa", tok, 8, 96, 32)
    assert selector_windows("qa", tok, c, notes, 256) == notes


def test_no_selector_is_fitted_on_fewer_than_two_windows_and_the_job_says_so():
    from jobs.plans import with_selector
    lines, art = [], object()
    assert with_selector(None, art, ["one window"], lines.append) is art
    assert lines == ["selector: not fitted (1 fine-tuning sample; it needs 2 or more)"], lines


def test_the_selector_target_adds_the_log_of_each_positions_error_relative_to_the_prefixs_mean():
    """selective.selector_target with `error`: a position rebuilt with twice the mean error scores log 2 above
    its reads' target, one at half of it log 2 below; padding stays as the reads put it; no error anywhere
    (the given cache is the own one) leaves the reads' target as it is."""
    read = torch.tensor([[0.0, 1.0, 2.0, 3.0, 2.0]])
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    error = torch.tensor([[9.0, 2.0, 1.0, 0.5, 0.5]])                  # mean over the real positions: 1.0
    plain = selective.selector_target(read, mask)
    weighted = selective.selector_target(read, mask, error)
    expect = plain + torch.log(torch.tensor([[1.0, 2.0, 1.0, 0.5, 0.5]])) * mask
    assert torch.allclose(weighted, expect, atol=1e-6), f"weighted {weighted} against {expect}"
    same = selective.selector_target(read, mask, torch.zeros_like(error))
    assert torch.equal(same, plain), f"{same} against {plain}"


def test_the_rebuild_error_is_each_positions_relative_squared_error_summed_over_layers():
    """selective.rebuild_error: zero for the own cache; at each position, per layer, the squared distance of K
    and V over heads and channels over the own K and V's squared norm there, summed over layers."""
    g = torch.Generator().manual_seed(1)
    own = [(torch.randn(2, 3, 7, 4, generator=g), torch.randn(2, 3, 7, 4, generator=g)) for _ in range(2)]
    kv = [(k + 0.1 * torch.randn(k.shape, generator=g), v * 1.5) for k, v in own]
    assert selective.rebuild_error(own, own).abs().max() == 0
    got = selective.rebuild_error(kv, own)
    expect = torch.zeros(2, 7)
    for (k, v), (ko, vo) in zip(kv, own):
        for b in range(2):
            for t in range(7):
                num = (k[b, :, t] - ko[b, :, t]).pow(2).sum() + (v[b, :, t] - vo[b, :, t]).pow(2).sum()
                expect[b, t] += num / (ko[b, :, t].pow(2).sum() + vo[b, :, t].pow(2).sum())
    err = (got - expect).abs().max().item()
    assert got.shape == (2, 7) and err < 1e-5, f"rebuild_error off by {err:.2e}"


def test_a_selector_fitted_over_a_rebuilt_cache_weights_its_targets_by_the_rebuild_error(monkeypatch):
    """scd.fitting.selector.fit_over: with error_weighted each window's target is the reads over the consumer's
    own cache weighted by the given cache's error against it (selector_target with rebuild_error); by default
    the reads alone."""
    from types import SimpleNamespace

    from scd.fitting import selector
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    g = torch.Generator().manual_seed(5)
    windows = [SimpleNamespace(prefix=torch.randint(2, 97, (20,), generator=g),
                               cont=torch.randint(2, 97, (selective.READ_TOKENS,), generator=g)) for _ in range(3)]
    cache = lambda model: lambda ids, mask: (lambda t: list(zip(t.keys, t.values)))(   # noqa: E731
        capture(model, ids, mask, want_xnorm=False))
    seen = []
    monkeypatch.setattr(selector, "fit_selector", lambda xs, ys: seen.append(ys) or (None, {}))
    layers = selective.selector_layers(a.config.num_hidden_layers)
    selector.fit_over(a, windows, cache(b), layers, error_weighted=True)
    selector.fit_over(a, windows, cache(b), layers)
    weighted, plain = seen
    for s, w, p in zip(windows, weighted, plain):
        ids = s.prefix[None]
        mask = torch.ones_like(ids)
        own, given = cache(a)(ids, mask), cache(b)(ids, mask)
        read = selective.reads_of(a, own, mask, s.cont[None, :selective.READ_TOKENS])
        want = selective.selector_target(read, mask, selective.rebuild_error(given, own))[0]
        assert (w - want).abs().max() < 1e-4, f"weighted target off by {(w - want).abs().max():.2e}"
        assert (p - selective.selector_target(read, mask)[0]).abs().max() < 1e-4
        assert (w - p).abs().max() > 1e-2, "another model's cache: the error changes the target"


def test_learned_points_measured_under_another_selector_are_measured_again():
    """jobs.plans.resumable: a checkpointed learned-rule point stands only under the selector it was measured
    with (a refitted selector picks other positions); the codes', the attention rule's and tails of a share
    stand; a tail timed as a count (without tail_of) does not."""
    from jobs.plans import resumable
    pts = [{"entry": 8}, {"entry": 8, "tail": 10, "tail_of": 96, "rule": "attention"},
           {"entry": 8, "tail": 10, "tail_of": 96, "rule": "learned", "selector": "aa"},
           {"entry": 8, "tail": 20, "tail_of": 96, "rule": "learned", "selector": "bb"},
           {"entry": 8, "tail": 16, "rule": "last"}]
    assert resumable(pts, "aa") == pts[:3]
    assert resumable(pts, "bb") == pts[:2] + [pts[3]]
    assert resumable(pts, None) == pts[:2]
