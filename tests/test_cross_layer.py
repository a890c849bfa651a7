"""Hidden-state codes shared by a group of adjacent layers (PairArtifacts.x_groups): encode, wire, rebuild.

The reference is exact algebra: a group code whose encoder and decoder are the block-diagonal stack of the
layers' own codecs carries the same numbers as the per-layer codes side by side, so the rebuilt cache must
be the per-layer artifact's."""
import dataclasses

import pytest
import torch

from scd.fitting.calibrate import Calibration
from scd.online import codec
from scd.online.models import ModelSpec
from scd.online.rebuild import encode, rebuild
from scd.online.reuse import LinearCodec
from scd.online.trace import capture
from tests.conftest import fit_settings, perturbed, random_samples, tiny_llama


def _block(codecs: list[LinearCodec], rank: int) -> LinearCodec:
    """One codec for the layers of a group: block-diagonal encoder and decoder, padded with zero columns to
    `rank` (every group's code has the artifact's one r_x)."""
    enc, dec = torch.block_diag(*[c.enc for c in codecs]), torch.block_diag(*[c.dec for c in codecs])
    pad = rank - enc.shape[1]
    return LinearCodec(torch.cat([c.mu_a for c in codecs]), torch.nn.functional.pad(enc, (0, pad)),
                       torch.cat([c.mu_b for c in codecs]), torch.nn.functional.pad(dec, (0, 0, 0, pad)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    a = tiny_llama(0, layers=4)
    b = perturbed(a, 0.3, seed=1)
    cfg = fit_settings(reuse_source="hidden", r_x=6, r_h=8, aligner_epochs=2, batch=16)
    cal = Calibration(a, b, ModelSpec.from_config(a.config), "a:b", [s.prefix for s in random_samples(24, 1)],
                      tmp_path_factory.mktemp("cal"), cfg, progress=False, log=lambda s: None)
    cal.traces()
    ids = random_samples(2, 2)[0].prefix[None]
    return a, b, cal, ids, capture(a, ids, torch.ones_like(ids))


def _grouped(art, groups):
    """art with its per-layer hidden codecs stacked block-diagonally into one codec per group."""
    rank = max(len(g) for g in groups) * art.r_x
    reuse_x = {g[0]: _block([art.reuse_x[l] for l in g], rank) for g in groups}
    return dataclasses.replace(art, reuse_x=reuse_x, r_x=rank, x_groups=groups, derived={})


def _through_wire(art, trace, ids):
    dims = codec.artifact_dims(art)
    payload = codec.encode(encode(art, trace, ids), art.pair, "v", dims, art.code_dtype)
    return payload, codec.decode(payload, art.pair, "v", art.plan, dims, art.x_codes)


@pytest.mark.parametrize("plan,x_codes", [(["exact", "hidden", "hidden", "hidden"], [1, 3]),
                                          (["exact", "patch", "hidden", "hidden"], [1, 3]),   # the head is Patched
                                          (["exact", "patch", "patch", "hidden"], [3])])      # nothing left to code
def test_a_group_code_rebuilds_what_its_layers_own_codes_rebuild(pair, plan, x_codes):
    a, b, cal, ids, trace = pair
    per_layer = cal.artifacts_for(plan)
    grouped = _grouped(per_layer, [[1, 2], [3]])
    assert grouped.x_codes == x_codes
    _, want = _through_wire(per_layer, trace, ids)
    payload, got = _through_wire(grouped, trace, ids)
    assert sorted(l for l, f in got.layers.items() if "z_x" in f) == x_codes
    kv_want, _ = rebuild(b, per_layer, want)
    kv_got, _ = rebuild(b, grouped, got)
    err = max((x - y).abs().max().item() for la, lb in zip(kv_got, kv_want) for x, y in zip(la, lb))
    assert err < 1e-3, f"grouped rebuild differs from the per-layer one by {err:.2e} ({plan})"


def test_a_payload_with_other_code_layers_is_refused(pair):
    a, b, cal, ids, trace = pair
    per_layer = cal.artifacts_for(["exact", "hidden", "hidden", "hidden"])
    grouped = _grouped(per_layer, [[1, 2], [3]])
    payload, _ = _through_wire(dataclasses.replace(grouped, x_groups=[[1], [2, 3]], reuse_x={
        1: _block([per_layer.reuse_x[1]], grouped.r_x), 2: grouped.reuse_x[1]}, derived={}), trace, ids)
    with pytest.raises(codec.PayloadError, match="x_codes"):
        codec.decode(payload, grouped.pair, "v", grouped.plan, codec.artifact_dims(grouped), grouped.x_codes)


@pytest.mark.parametrize("groups", [[[1, 2], [2, 3]], [[1, 3]]])
def test_groups_must_be_disjoint_runs_of_adjacent_layers(pair, groups):
    _, _, cal, _, _ = pair
    art = cal.artifacts_for(["exact", "hidden", "hidden", "hidden"])
    with pytest.raises(ValueError, match="disjoint runs"):
        dataclasses.replace(art, x_groups=groups, derived={})


def _calibration(tmp_path, x_group, r_x, layers=4, ridge=1e-4, token_table=0, bigram_table=0):
    a = tiny_llama(0, layers=layers)
    b = perturbed(a, 0.3, seed=1)
    cfg = fit_settings(reuse_source="hidden", r_x=r_x, x_group=x_group, batch=16, ridge=ridge, token_table=token_table,
                      bigram_table=bigram_table)
    cal = Calibration(a, b, ModelSpec.from_config(a.config), "a:b", [s.prefix for s in random_samples(24, 1)],
                      tmp_path / f"g{x_group}_t{token_table}_b{bigram_table}", cfg, progress=False, log=lambda s: None)
    cal.traces()
    return a, b, cal


def test_calibration_fits_one_code_per_group_and_counts_each_groups_code_once(tmp_path):
    """Layers 1..3 in groups of 2: codes at layers 1 and 3; the last group (one layer, K and V 32 wide) is
    fitted at its full rank and zero-padded to r_x 40; payloads and the budget count two codes."""
    a, b, cal = _calibration(tmp_path, 2, 40)
    art = cal.artifacts_for(cal.base_plan)
    assert art.x_groups == [[1, 2], [3]] and sorted(art.reuse_x) == [1, 3] and art.x_codes == [1, 3]
    assert art.reuse_x[1].enc.shape == (64, 40) and art.reuse_x[1].dec.shape == (40, 64)
    assert art.reuse_x[3].enc[:, 32:].abs().max() == 0                    # padding: no information there
    row = codec.code_bytes_per_row(40, "fp16")
    assert cal.payload_ratio({"r_x": 40}) == pytest.approx(2 * row / cal.spec.kv_bytes_per_token)
    assert codec.code_bytes(art, 10) == 5 * 10 + 2 * 10 * row                       # ids, mask, two codes
    ids = random_samples(1, 3)[0].prefix[None]
    _, codes = _through_wire(art, capture(a, ids, torch.ones_like(ids)), ids)
    kv, _ = rebuild(b, art, codes)
    assert len(kv) == 4 and all(k.shape == kv[0][0].shape for k, _ in kv)


def test_a_full_rank_code_for_all_layers_fits_at_least_as_well_as_one_code_per_layer(tmp_path):
    """At full rank the cross-layer map reads every layer's x_norm for every layer's K and V, a superset of the
    per-layer map's inputs: on the calibration rows it cannot fit worse (up to the ridge)."""
    def error(x_group, r_x):
        a, b, cal = _calibration(tmp_path, x_group, r_x, ridge=1e-8)
        return _calibration_error(a, b, cal.artifacts_for(cal.base_plan), [s.prefix for s in random_samples(24, 1)[:6]])
    per_layer, all_layers = error(1, 32), error(0, 96)
    assert all_layers <= per_layer * 1.01, f"cross-layer {all_layers:.4f} vs per-layer {per_layer:.4f}"


def test_the_serving_engines_carry_a_group_code_from_producer_to_answer(pair):
    """ProducerEngine encodes a grouped artifact's payload (every level), SpecialistEngine decodes and answers
    in scd mode; the answer is the one the block-diagonal per-layer artifact gives."""
    from actors.messages import GenParams
    from engines.producer import ProducerEngine
    from engines.specialist import SpecialistEngine
    from tests.test_models import _tokenizer
    a, b, cal, _, _ = pair
    tok = _tokenizer(97)
    per_layer = cal.artifacts_for(["exact", "hidden", "hidden", "patch"])
    grouped = _grouped(per_layer, [[1, 2], [3]])
    prefix = random_samples(1, 4)[0].prefix.tolist()
    answers = {}
    for name, art in (("per_layer", per_layer), ("grouped", grouped)):
        res = ProducerEngine(a, tok, {"a:b": (art, "v1")}, cache_bytes=1 << 20).encode(prefix, ["a:b"])
        out, info, _ = SpecialistEngine("b", b, tok, art, "v1").complete(prefix, [11], res.per_pair["a:b"].payload,
                                                                          None, GenParams(max_tokens=4))
        assert info.mode == "scd", info
        answers[name] = out
    assert answers["grouped"] == answers["per_layer"] and answers["grouped"], answers
    assert grouped.x_codes == [1]                       # layer 3 is Patched: its group sends no code


def test_patch_codes_count_against_the_budget_of_a_group_code(tmp_path):
    """With one code for all layers, a Patch code adds to the payload (the group's code is still sent): the
    budget check sees it. Without groups, a Patch code replaces its layer's code."""
    _, _, grouped = _calibration(tmp_path, 0, 24)
    base = grouped.plan_payload(grouped.base_plan)
    one = grouped.plan_payload(grouped.plan_with([2]))
    assert one > base, (one, base)
    grouped.cfg = grouped.cfg.model_copy(update={"payload_budget": (base + one) / 2})
    assert grouped.fits_budget([]) and not grouped.fits_budget([2])
    row = lambda r: codec.code_bytes_per_row(r, "fp16") / grouped.spec.kv_bytes_per_token  # noqa: E731
    assert one - base == pytest.approx(row(grouped.cfg.r_h))
    _, _, per_layer = _calibration(tmp_path, 1, 24)
    swap = per_layer.plan_payload(per_layer.plan_with([2])) - per_layer.plan_payload(per_layer.base_plan)
    assert swap == pytest.approx(row(per_layer.cfg.r_h) - row(24))


def _calibration_error(a, b, art, prefixes):
    """Squared error of the rebuilt K and V (layers >= 1) against the consumer's own, over prefixes."""
    total = 0.0
    for p in prefixes:
        ids = p[None]
        trace, own = capture(a, ids, torch.ones_like(ids)), capture(b, ids, torch.ones_like(ids))
        kv, _ = rebuild(b, art, codec.as_received(encode(art, trace, ids), "fp16"))
        total += sum(((k - ok) ** 2).sum().item() + ((v - ov) ** 2).sum().item()
                     for (k, v), ok, ov in zip(kv[1:], own.keys[1:], own.values[1:]))
    return total


def test_a_token_table_rebuilds_what_the_probe_decodes_and_fits_better_than_none(tmp_path):
    """A code for all layers with a token table: the serving rebuild (stacked decoders, one bias row per token)
    gives what tools.probe_cross_layer's independent decode of the same codec gives, and on the calibration
    prefixes it fits the consumer's K and V better than the same code without a table."""
    from tools.probe_cross_layer import CrossLayer
    a, b, cal = _calibration(tmp_path, 0, 24, token_table=40)
    art = cal.artifacts_for(cal.base_plan)
    codec_x = art.reuse_x[1]
    assert codec_x.table is not None and len(codec_x.table_ids) == 40 and codec_x.table.abs().max() > 0
    ids = random_samples(1, 3)[0].prefix[None]
    mask = torch.ones_like(ids)
    trace = capture(a, ids, mask)
    kv, _ = rebuild(b, art, codec.as_received(encode(art, trace, ids), "fp16"))
    probe = CrossLayer([([1, 2, 3], codec_x)], cal.spec).build(b, ids, mask, trace).kv
    err = max((x - y).abs().max().item() for got, want in zip(kv, probe) for x, y in zip(got, want))
    assert err < 1e-4, f"rebuild and the probe's decode of one tabled codec differ by {err:.2e}"
    prefixes = [s.prefix for s in random_samples(24, 1)][:6]
    _, _, plain = _calibration(tmp_path, 0, 24)
    with_table = _calibration_error(a, b, art, prefixes)
    without = _calibration_error(a, b, plain.artifacts_for(plain.base_plan), prefixes)
    assert with_table < without, f"K/V error with a token table {with_table:.4f}, without {without:.4f}"


def test_bigram_rows_land_on_their_keys_only_also_behind_left_padding():
    """A bigram row keyed by (sequence start, 5) is added at the first real token of a sequence that starts
    with token 5, behind left padding too, and not at a later 5 (key (9, 5)), nor at any other layer: in the
    probe's decode (batches of one) and in bigram_keys of a padded batch."""
    from tools.probe_cross_layer import CrossLayer
    from scd.fitting.traces import pad
    from scd.online.reuse import bigram_keys
    a, b = tiny_llama(0, layers=3), perturbed(tiny_llama(0, layers=3), 0.3, seed=1)
    spec = ModelSpec.from_config(a.config)
    d_a, d_b = 2 * a.config.hidden_size, 2 * 2 * spec.num_kv_heads * spec.head_dim
    g = torch.Generator().manual_seed(0)
    plain = LinearCodec(torch.zeros(d_a), torch.randn(d_a, 8, generator=g) * 0.1, torch.zeros(d_b),
                        torch.randn(8, d_b, generator=g) * 0.1, torch.zeros(1, d_b), torch.tensor([5]))
    row = torch.zeros(1, d_b)
    row[0, -1] = 1.0                                                       # the last V column of layer 2
    bumped = dataclasses.replace(plain, bigram=row, bigram_ids=bigram_keys(torch.tensor([5])))
    ids = torch.tensor([[5, 9, 5, 7]])
    mask = torch.ones_like(ids)
    trace = capture(a, ids, mask)
    kv = [CrossLayer([([1, 2], c)], spec).build(b, ids, mask, trace).kv for c in (plain, bumped)]
    diff = kv[1][2][1] - kv[0][2][1]                                       # (B, n_kv, T, d): layer 2's V
    want = torch.zeros_like(diff)
    want[0, -1, 0, -1] = 1.0
    err = (diff - want).abs().max().item()
    assert err < 1e-5, f"the (start, 5) row landed elsewhere: max error {err:.2e}"
    others = max((x - y).abs().max().item() for layer in (0, 1) for x, y in zip(kv[1][layer], kv[0][layer]))
    assert others < 1e-6, f"layers 0 and 1 moved by {others:.2e}"
    padded, pmask = pad([torch.tensor([5, 9, 5, 7]), torch.tensor([3, 3, 5, 9, 5, 7])], 0)
    keys = bigram_keys(padded, pmask)
    assert torch.equal(keys[0, 2:], bigram_keys(torch.tensor([5, 9, 5, 7]))), keys
    assert torch.equal(keys[1], bigram_keys(torch.tensor([3, 3, 5, 9, 5, 7]))), keys


def test_a_bigram_table_rebuilds_what_the_probe_decodes_also_in_a_padded_batch(tmp_path):
    """Calibration with token and bigram tables: the serving rebuild gives what the probe's independent decode
    of the same codec gives; a left-padded batch of two prefixes rebuilds each as it rebuilds alone (the
    keys of a padded row start at its first real token); and on the calibration prefixes it fits the
    consumer's K and V better than the token table alone."""
    from tools.probe_cross_layer import CrossLayer
    from scd.fitting.traces import pad
    a, b, cal = _calibration(tmp_path, 0, 24, token_table=40, bigram_table=200)
    art = cal.artifacts_for(cal.base_plan)
    codec_x = art.reuse_x[1]
    assert codec_x.bigram is not None and len(codec_x.bigram_ids) == 200 and codec_x.bigram.abs().max() > 0
    prefixes = [s.prefix for s in random_samples(24, 1)][:6]

    def rebuilt(seqs):
        ids, mask = pad(seqs, 0)
        kv, _ = rebuild(b, art, codec.as_received(encode(art, capture(a, ids, mask), ids), "fp16"))
        return ids, mask, kv
    ids, mask, kv = rebuilt(prefixes[:1])
    probe = CrossLayer([([1, 2, 3], codec_x)], cal.spec).build(b, ids, mask, capture(a, ids, mask)).kv
    err = max((x - y).abs().max().item() for got, want in zip(kv, probe) for x, y in zip(got, want))
    assert err < 1e-4, f"rebuild and the probe's decode of one codec with a bigram table differ by {err:.2e}"
    short, long_ = prefixes[1][:20], prefixes[2]
    _, pmask, both = rebuilt([short, long_])
    for i, seq in enumerate((short, long_)):
        _, _, alone = rebuilt([seq])
        keep = pmask[i].bool()
        err = max((got[i][:, keep] - want[0]).abs().max().item()
                  for layer, layer_alone in zip(both[1:], alone[1:]) for got, want in zip(layer, layer_alone))
        assert err < 1e-4, f"prefix {i} rebuilt in a padded batch differs from alone by {err:.2e}"
    _, _, tokens_only = _calibration(tmp_path, 0, 24, token_table=40)
    with_bigrams = _calibration_error(a, b, art, prefixes)
    without = _calibration_error(a, b, tokens_only.artifacts_for(tokens_only.base_plan), prefixes)
    assert with_bigrams < without, f"K/V error with a bigram table {with_bigrams:.4f}, token table alone {without:.4f}"


@pytest.mark.parametrize("entry, stop", [(1, 2), (2, 3)])
def test_a_block_below_the_top_takes_its_layers_from_the_consumer_and_the_rest_from_the_group_codes(pair, entry,
                                                                                                     stop):
    """blocks.block_artifact with a stop inside a group: the consumer runs layers entry..stop-1 from the aligned
    residual; every other layer, those of a group whose code travels at a layer now in the block too, rebuilds
    through the wire exactly as the codes alone do."""
    from scd.fitting import blocks
    from scd.online.rebuild import dense
    from scd.online.recompute import run_layers
    a, b, cal, ids, _ = pair
    grouped = _grouped(cal.artifacts_for(["exact", "hidden", "hidden", "hidden"]), [[1, 2], [3]])
    align = blocks.fit_aligners(a, b, [s.prefix for s in random_samples(8, 3)], [entry])[entry]
    art = blocks.block_artifact(grouped, entry, align, stop)
    assert art.blocks == [(entry, stop)] and art.plan[stop:] == grouped.plan[stop:], art.plan
    mask = torch.ones_like(ids)
    trace = capture(a, ids, mask, want_hidden=True)
    kv_codes, _ = rebuild(b, grouped, _through_wire(grouped, trace, ids)[1])
    received = _through_wire(art, trace, ids)[1]
    kv, _ = rebuild(b, art, received)
    for l in [l for l in range(4) if not entry <= l < stop]:
        err = max((x - y).abs().max().item() for x, y in zip(kv[l], kv_codes[l]))
        assert err < 1e-5, f"layer {l}, outside the block [{entry}, {stop}), differs from the codes' by {err:.2e}"
    x = dense(received.layers[entry]["z_e"]).reshape(trace.hidden[entry].shape)    # the residual as it arrived
    want = run_layers(b, x + align.decode(align.encode(x)), mask, trace.positions, entry, stop)
    err = max((g - w).abs().max().item() for l, (wk, wv) in zip(range(entry, stop), want)
              for g, w in ((kv[l][0], wk), (kv[l][1], wv)))
    assert err < 1e-4, f"the block [{entry}, {stop}) differs from the consumer's layers run from its entry by {err:.2e}"
    with pytest.raises(ValueError, match=r"a block \[2, 2\)"):
        blocks.block_artifact(grouped, 2, align, 2)
