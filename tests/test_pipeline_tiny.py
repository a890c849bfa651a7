"""End-to-end numeric pipeline on a tiny random pair: calibrate, then every method through the harness (the
calibration's stages: tests/test_calibration_stages.py)."""
import dataclasses

import pytest
import torch

from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator, Sample
from scd.fitting.calibrate import CalibConfig, Calibration, calibrate
from scd.fitting.scoring import PlanScorer
from scd.online.models import ModelSpec
from tests.conftest import fit_settings, perturbed, random_samples, tiny_llama


def test_calibrated_scd_beats_raw_kv_and_oracle_is_exact(tmp_path):
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(48, 1)]
    cfg = fit_settings(r_k=2, r_v=3, r_h=16, aligner_epochs=30, pool=2, batch=16)
    art = calibrate(a, b, spec, "a:b", prefixes, random_samples(6, 2), tmp_path, cfg, progress=False)
    assert art.plan[0] == "exact" and len(art.plan) == 3
    pol = art.info["policy"]
    curve, order, eff, k = pol["curve"], pol["order"], pol["efficiency"], pol["k_star"]
    # greedy over the pool: one more pool layer patched per step, each lowering the KL on this pair
    assert sorted(order) == pol["pool"] and len(curve) == len(order) + 1 and curve[0] == pol["base_kl"], pol
    assert all(x > y for x, y in zip(curve, curve[1:])), f"a patch did not lower the KL: {curve}"
    # k*: the most KL removed per unit of consumer work; the plan patches exactly the layers it chose
    assert eff == pytest.approx([(curve[0] - c) / (1 + cfg.patch_cost * i) for i, c in enumerate(curve)]), pol
    assert k == max(range(len(eff)), key=eff.__getitem__) > 0, pol
    patched = [layer for layer, kind in enumerate(art.plan) if kind == "patch"]
    assert pol["chosen"] == sorted(order[:k]) == patched, (pol, art.plan)

    ms = [methods.Oracle(), methods.RawKV(), methods.Int4KV(), methods.DroidSpeak(1, start=1),
          methods.reuse_only(art), methods.SCDMethod(art)]
    rows = {r["method"]: r for r in Evaluator(a, b, greedy_tokens=4).run(random_samples(6, 3), ms)}
    assert rows["oracle"]["kl"] < 1e-9 and rows["oracle"]["top1"] == 1.0, rows["oracle"]
    assert rows["scd"]["kl"] < rows["raw_kv"]["kl"], f"scd KL {rows['scd']['kl']:.4f} vs raw {rows['raw_kv']['kl']:.4f}"
    assert 0 < rows["scd"]["payload_ratio"] < rows["int4_kv"]["payload_ratio"] < 1.0 == rows["raw_kv"]["payload_ratio"]


def test_identical_pair_full_rank_scd_reproduces_kv(tmp_path):
    a = tiny_llama(0)
    spec = ModelSpec.from_config(a.config)
    cfg = fit_settings(r_k=8, r_v=8, r_h=32, ridge=1e-9, aligner_epochs=2, pool=1, batch=16)
    art = calibrate(a, a, spec, "a:a", [s.prefix for s in random_samples(32, 1)], random_samples(2, 2), tmp_path, cfg,
                    progress=False)
    s = random_samples(1, 5)[0]
    ids = s.prefix[None]
    from scd.online.trace import capture
    tr = capture(a, ids)
    built = methods.reuse_only(art).build(a, ids, torch.ones_like(ids), tr)
    err = max(max((k - tk).abs().max().item(), (v - tv).abs().max().item())
              for (k, v), tk, tv in zip(built.kv, tr.keys, tr.values))
    # fp16 on the wire bounds the error; compare the codes path without the codec for the 1e-4 claim
    from scd.online.rebuild import encode, rebuild
    kv, _ = rebuild(a, art.with_plan(["exact", "reuse", "reuse"]), encode(art.with_plan(["exact", "reuse", "reuse"]), tr, ids))
    exact = max(max((k - tk).abs().max().item(), (v - tv).abs().max().item()) for (k, v), tk, tv in zip(kv, tr.keys, tr.values))
    assert exact < 1e-4, f"full-rank Reuse of an identical pair: max KV error {exact:.2e}"
    assert err < 1e-2, f"through the fp16 codec: max KV error {err:.2e}"


def test_rebuild_of_a_left_padded_batch_matches_rebuilding_each_row(tmp_path):
    from scd.online.rebuild import prepare
    from tests.conftest import left_padded_batch
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    cfg = fit_settings(r_k=4, r_v=4, r_h=16, aligner_epochs=3, batch=16)
    cal = Calibration(a, b, spec, "a:b", [s.prefix for s in random_samples(24, 1)], tmp_path, cfg, progress=False)
    cal.traces()
    art = cal.artifacts_for(["exact", "patch", "reuse"])     # exercise every rebuild path
    prepare(b, art)                                          # derived tensors made up front, then reused
    assert {k[0] for k in art.derived if isinstance(k[0], str)} == {"patches"} and len(art.derived) == 2, art.derived
    ids, mask = left_padded_batch()
    _assert_batch_rebuild_equals_rows(a, b, art, ids, mask)


def _assert_batch_rebuild_equals_rows(a, b, art, ids, mask):
    """Rebuilding a left-padded batch gives each row what rebuilding it alone gives."""
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    kv_batch, _ = rebuild(b, art, encode(art, capture(a, ids, mask), ids))
    for i in range(ids.shape[0]):
        keep = mask[i].bool()
        row = ids[i, keep][None]
        kv_row, _ = rebuild(b, art, encode(art, capture(a, row), row))
        for l, ((kb, vb), (kr, vr)) in enumerate(zip(kv_batch, kv_row)):
            err = max((kb[i][:, keep] - kr[0]).abs().max().item(), (vb[i][:, keep] - vr[0]).abs().max().item())
            assert err < 1e-4, f"row {i} layer {l} ({art.plan[l]}): batched vs single rebuild differ by {err:.2e}"


def test_hidden_state_reuse_beats_per_head_reuse_at_equal_payload_on_a_perturbed_pair(tmp_path):
    """A fine-tune that moves k/v projections: per-head codecs of the producer's K cannot see the hidden
    state the consumer's new projections read; one code per token from x_norm can."""
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(48, 1)]
    val = random_samples(6, 2)
    kl = {}
    for source, ranks in (("kv", {"r_k": 2, "r_v": 2}), ("hidden", {"r_x": 8})):   # 8 B/token/layer each
        cal = Calibration(a, b, spec, "a:b", prefixes, tmp_path / source,
                          fit_settings(reuse_source=source, batch=16, **ranks), progress=False, log=lambda s: None)
        cal.traces()
        assert abs(cal.payload_ratio(ranks) - 2 * 2 * 4 * 2 / spec.kv_bytes_per_token) < 1e-12
        kl[source] = PlanScorer(a, b, val, cal.artifacts_for).kl(cal.base_plan)
    assert kl["hidden"] < kl["kv"], f"hidden-state Reuse KL {kl['hidden']:.4f} vs per-head {kl['kv']:.4f}"


def test_int8_codes_count_their_bytes_and_are_what_the_artifact_sends(tmp_path):
    """code_dtype int8: the payload budget counts one byte per value plus a 2-byte scale per row, the artifact
    carries the precision through save/load, and the evaluated method sends exactly those bytes; the KL it is
    scored at in calibration is the KL of what arrives."""
    from scd.online.artifacts import PairArtifacts
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(24, 1)]
    val = random_samples(3, 2)
    cals = {d: Calibration(a, b, spec, "a:b", prefixes, tmp_path / d, fit_settings(reuse_source="hidden", r_x=12,
                                                                                 code_dtype=d, batch=16),
                           progress=False, log=lambda s: None) for d in ("fp16", "int8")}
    layers = spec.num_layers - 1                                               # layer 0 is exact
    for d, per_row in (("fp16", 24), ("int8", 14)):
        got = cals[d].payload_ratio({"r_x": 12})
        assert abs(got - layers * per_row / spec.kv_bytes_per_token) < 1e-12, (d, got)
    cals["int8"].traces()
    art = cals["int8"].artifacts_for(cals["int8"].base_plan)
    art.save(tmp_path / "art")
    back = PairArtifacts.load(tmp_path / "art")
    assert back.code_dtype == "int8"
    sent = Evaluator(a, b).sample(val[0], [methods.SCDMethod(back)])[0].payload_bytes
    t = len(val[0].prefix)
    want = layers * t * 14 + 5 * t                                            # codes + token ids and mask
    # calibration scores what arrives: the int8 KL differs from the fp16 one, and only slightly
    fp16 = PlanScorer(a, b, val, lambda plan: dataclasses.replace(art.with_plan(plan), code_dtype="fp16")).kl(art.plan)
    int8 = PlanScorer(a, b, val, art.with_plan).kl(art.plan)
    assert 0 < abs(int8 - fp16) < 0.05 * fp16 + 1e-3, (int8, fp16)
    # the consumer rebuilds from the payload's int8 codes, dequantised layer by layer, exactly what
    # calibration scores (codec.as_received)
    from scd.online import codec
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    ids = val[0].prefix[None]
    codes = encode(back, capture(a, ids, torch.ones_like(ids)), ids)
    plain = codec.encode(codes, "a:b", "local", codec.artifact_dims(back), "int8", compress="none")
    assert want < len(plain) < want + 600, (len(plain), want)                 # + header and crc
    assert sent == len(codec.encode(codes, "a:b", "local", codec.artifact_dims(back), "int8")) <= len(plain), \
        (sent, len(plain))                    # as sent: compressed, if that is smaller
    wire = codec.decode(codec.encode(codes, "a:b", "v", codec.artifact_dims(back), "int8"), "a:b", "v", back.plan,
                        codec.artifact_dims(back))
    got, want = rebuild(b, back, wire)[0], rebuild(b, back, codec.as_received(codes, "int8"))[0]
    err = max((x - y).abs().max().item() for g, w in zip(got, want) for x, y in zip(g, w))
    assert err < 1e-5, f"rebuild from the int8 payload differs from the as-received codes by {err:.2e}"
    with pytest.raises(ValueError, match="code_dtype"):
        CalibConfig(code_dtype="int3")


@pytest.mark.parametrize("token_table, bigram_table", [(0, 0), (16, 0), (16, 48)])
def test_hidden_state_artifacts_survive_save_load_and_the_wire_and_rebuild_padded_batches_row_by_row(tmp_path,
                                                                                                     token_table,
                                                                                                     bigram_table):
    from scd.online import codec
    from scd.online.artifacts import PairArtifacts
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    from tests.conftest import left_padded_batch
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    cfg = fit_settings(reuse_source="hidden", r_x=12, r_h=16, aligner_epochs=2, batch=16, token_table=token_table,
                      bigram_table=bigram_table)
    cal = Calibration(a, b, spec, "a:b", [s.prefix for s in random_samples(24, 1)], tmp_path, cfg, progress=False,
                      log=lambda s: None)
    cal.traces()
    art = cal.artifacts_for(["exact", "patch", "hidden"])
    art.save(tmp_path / "art")
    back = PairArtifacts.load(tmp_path / "art")
    assert back.r_x == 12 and back.plan == art.plan and set(back.reuse_x) == {1, 2} and not back.reuse_k
    if token_table:
        assert torch.equal(back.reuse_x[2].table, art.reuse_x[2].table) and len(back.reuse_x[2].table_ids) == 16
    if bigram_table:
        assert torch.equal(back.reuse_x[2].bigram, art.reuse_x[2].bigram) and len(back.reuse_x[2].bigram_ids) == 48
    ids, mask = left_padded_batch()
    codes = encode(back, capture(a, ids, mask), ids)
    payload = codec.encode(codes, "a:b", "v1", codec.artifact_dims(back), "fp16")
    wire = codec.decode(payload, "a:b", "v1", back.plan, codec.artifact_dims(back))
    assert wire.layers[2]["z_x"].shape == (*ids.shape, 12)
    kv_batch, _ = rebuild(b, back, wire)
    kv_direct, _ = rebuild(b, art, encode(art, capture(a, ids, mask), ids))
    err = max((x - y).abs().max().item() for kvb, kvd in zip(kv_batch, kv_direct) for x, y in zip(kvb, kvd))
    assert err < 5e-2, f"through save/load and fp16 codes the rebuilt KV moved by {err:.2e}"
    _assert_batch_rebuild_equals_rows(a, b, art, ids, mask)
    assert methods.reuse_only(art).art.plan == ["exact", "hidden", "hidden"]


def test_plan_scorer_puts_back_the_consumers_own_keys_or_values_where_asked(tmp_path):
    """PlanScorer.kl(restore=layers, streams=...) scores a rebuilt cache with the consumer's own K and/or V at
    those layers: all of both is the oracle cache (KL 0); K only matches a cache assembled by hand."""
    from scd.evaluation import metrics
    from scd.online import cache, codec
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    cfg = fit_settings(r_x=4, reuse_source="hidden", aligner_epochs=2, pool=1, batch=8)
    cal = Calibration(a, b, spec, "a:b", [s.prefix for s in random_samples(16, 1)], tmp_path, cfg, progress=False,
                      log=lambda s: None)
    cal.traces()
    art = cal.artifacts_for(cal.base_plan)
    val = random_samples(2, 2)
    scorer = PlanScorer(a, b, val, lambda plan: art.with_plan(plan))
    layers = range(spec.num_layers)
    built, own = scorer.kl(art.plan), scorer.kl(art.plan, layers, "kv")
    assert own < 1e-9 < built, (own, built)
    total = 0.0
    for s in val:
        ids, mask = s.prefix[None], torch.ones_like(s.prefix[None])
        o = capture(b, ids, mask, want_xnorm=False)
        ref, _ = cache.extend(b, cache.assemble(b, list(zip(o.keys, o.values))), mask, s.cont[None])
        kv, _ = rebuild(b, art, codec.as_received(encode(art, capture(a, ids, mask), ids), art.code_dtype))
        kv = [(o.keys[l], v) for l, (_, v) in enumerate(kv)]
        logits, _ = cache.extend(b, cache.assemble(b, kv), mask, s.cont[None])
        total += metrics.kl_tv_top1(ref, logits)[0]
    keys_only = scorer.kl(art.plan, layers, "k")
    assert abs(keys_only - total / len(val)) < 1e-6, f"keys restored: {keys_only:.6f}, by hand {total / len(val):.6f}"
    assert scorer.kl(art.plan, 1) == scorer.kl(art.plan, [1], "kv")


@pytest.mark.parametrize("dtype", ["int4", "mixed"])
def test_quantised_codes_rebuild_from_the_payload_exactly_as_calibration_scores_them(tmp_path, dtype):
    """int4 and mixed (int8 first third, int4 rest) codes: the payload holds code_bytes_per_row per row, and the
    consumer's rebuild from it equals the rebuild from codec.as_received (what calibration scores)."""
    from scd.online import codec
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    cal = Calibration(a, b, spec, "a:b", [s.prefix for s in random_samples(16, 1)], tmp_path,
                      fit_settings(reuse_source="hidden", r_x=12, code_dtype=dtype, batch=16), progress=False,
                      log=lambda s: None)
    cal.traces()
    art = cal.artifacts_for(cal.base_plan)
    ids = random_samples(1, 2)[0].prefix[None]
    codes = encode(art, capture(a, ids, torch.ones_like(ids)), ids)
    dims = codec.artifact_dims(art)
    plain = codec.encode(codes, "a:b", "v", dims, dtype, compress="none")
    coded = sum(k == "hidden" for k in art.plan) * ids.shape[1] * codec.code_bytes_per_row(12, dtype)
    assert coded + 5 * ids.shape[1] < len(plain) < coded + 5 * ids.shape[1] + 600, (len(plain), coded)
    got = rebuild(b, art, codec.decode(plain, "a:b", "v", art.plan, dims))[0]      # (compressed: test_codec)
    want = rebuild(b, art, codec.as_received(codes, dtype))[0]
    err = max((x - y).abs().max().item() for g, w in zip(got, want) for x, y in zip(g, w))
    assert err < 1e-5, f"{dtype}: rebuild from the payload differs from the as-received codes by {err:.2e}"


def test_droidspeak_profiles_a_block_on_a_two_layer_model():
    """Its default block is two layers from layer 1 at the earliest: on two layers it is one, at layer 1."""
    from scd.evaluation.evaluate import profile_droidspeak
    a = tiny_llama(0, layers=2)
    ds = methods.DroidSpeak()
    start = profile_droidspeak(ds, a, perturbed(a, 0.3), random_samples(2, 5))
    assert (start, ds.n, list(ds.profile)) == (1, 1, [1]), (start, ds.n, ds.profile)


@pytest.mark.parametrize("batch", [2, 8])
def test_the_harness_decodes_every_method_in_one_batch_as_it_would_alone(batch, monkeypatch):
    """Evaluator.sample decodes the methods of one model together (greedy tokens and QA answers), DECODE_BATCH
    methods at a time; each method's greedy agreement and F1 are those of decoding its cache alone, the base's
    over the producer."""
    from scd.evaluation import evaluate, metrics
    from scd.online import cache, decode
    monkeypatch.setattr(evaluate, "DECODE_BATCH", batch)
    a, b = tiny_llama(0), perturbed(tiny_llama(0), 0.5)

    class Tok:                                       # ids as words: F1 over the answer's tokens
        def get_vocab(self):
            return {str(i): i for i in range(97)}

        def convert_tokens_to_string(self, tokens):
            return " ".join(tokens)

        all_special_ids = [1]

        def decode(self, ids):
            return " ".join(map(str, ids))

    ev = Evaluator(a, b, Tok(), greedy_tokens=6, answer_tokens=4)
    s = random_samples(1, 5)[0]
    s = Sample(s.prefix, s.cont, question=s.cont[:3], answer="5 7 9")
    ms = [methods.Oracle(), methods.RawKV(), methods.Int4KV(), methods.DroidSpeak(1, start=1), methods.BaseAlone(a)]
    got = {r.method: r for r in ev.sample(s, ms)}
    ids, mask, ptrace, oracle, _ = ev.reference(s)

    def alone(model, kv, first, n):
        return decode.generate(model, cache.assemble(model, kv), mask, first[None], n)

    ref = alone(b, oracle.kv, s.question, 6)
    for m in ms:
        model = getattr(m, "model", None) or b
        kv = m.build(b, ids, mask, ptrace).kv
        greedy = metrics.greedy_agreement(ref, alone(model, kv, s.question, 6))
        f1, _ = metrics.f1_em(ev._answer(alone(model, kv, s.question, 4)[0].tolist()), s.answer)
        assert (got[m.name].greedy, got[m.name].f1) == (greedy, f1), \
            f"{m.name}: batched greedy {got[m.name].greedy}, F1 {got[m.name].f1}; alone {greedy}, {f1}"
    assert got["oracle"].greedy == 1.0, got["oracle"]
