"""Nested code ranks: one artifact serves several payload sizes (PairArtifacts.levels), the producer picks one
per request from its link's bandwidth and a TTFT target (scd.online.links), the consumer rebuilds from
whatever level arrives."""
import dataclasses

import pytest
import torch

from actors.messages import GenParams
from engines.producer import ProducerEngine
from engines.specialist import SpecialistEngine
from scd.evaluation import methods
from scd.fitting.calibrate import Calibration
from scd.fitting.scoring import PlanScorer
from scd.online import codec, links
from scd.online.models import ModelSpec
from scd.online.rebuild import encode, rebuild
from scd.online.trace import capture
from tests.conftest import fit_settings, perturbed, random_samples, tiny_llama
from tests.test_models import _tokenizer


def _max_err(kv_a, kv_b) -> float:
    return max((x - y).abs().max().item() for la, lb in zip(kv_a, kv_b) for x, y in zip(la, lb))


@pytest.fixture(scope="module", params=["kv", "hidden"])
def fitted(request, tmp_path_factory):
    """A calibrated tiny pair (per-head or hidden-state Reuse, with a Patch layer) and its calibration."""
    a = tiny_llama(0)
    b = perturbed(a, 0.3, seed=1)
    spec = ModelSpec.from_config(a.config)
    cfg = fit_settings(reuse_source=request.param, r_k=8, r_v=12, r_x=24, r_h=16, aligner_epochs=2, batch=16)
    cal = Calibration(a, b, spec, "a:b", [s.prefix for s in random_samples(24, 1)], tmp_path_factory.mktemp("cal"), cfg,
                      progress=False, log=lambda s: None)
    cal.traces()
    kind = "hidden" if request.param == "hidden" else "reuse"
    return a, b, cal, cal.artifacts_for(["exact", "patch", kind])


def test_levels_are_fractions_of_the_reuse_ranks_smallest_first(fitted):
    _, _, _, art = fitted
    want = [{"r_x": 6}, {"r_x": 12}, {"r_x": 18}, {"r_x": 24}] if art.reuse_x else \
        [{"r_k": 2, "r_v": 3}, {"r_k": 4, "r_v": 6}, {"r_k": 6, "r_v": 9}, {"r_k": 8, "r_v": 12}]
    assert art.levels == want
    sizes = [codec.code_bytes(art, 100, lv) for lv in art.levels]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), sizes


def test_a_level_of_the_full_artifact_rebuilds_what_the_artifact_fitted_at_that_rank_rebuilds(fitted):
    """Nested codes: the leading columns of a rank-R fit are the rank-r fit, so sending a lower level of
    the published artifact equals calibrating at that rank (through the wire and the consumer's decoders)."""
    a, b, cal, art = fitted
    ids = random_samples(1, 2)[0].prefix[None]
    trace = capture(a, ids, torch.ones_like(ids))
    for level in art.levels[:-1]:
        small = cal.artifacts_for(art.plan, **level)
        dims = codec.artifact_dims(art, level)
        wire = codec.decode(codec.encode(encode(art, trace, ids, level), "a:b", "v", dims, "fp16"), "a:b", "v",
                            art.plan, codec.level_dims(art))
        assert wire.level == level
        got, _ = rebuild(b, art, wire)
        want, _ = rebuild(b, small, codec.as_received(encode(small, trace, ids), "fp16"))
        err = _max_err(got, want)
        assert err < 1e-3, f"level {level}: rebuilt KV differs from the rank-{level} fit's by {err:.2e}"
    with pytest.raises(ValueError, match="not one this artifact serves"):
        encode(art, trace, ids, {k: v + 1 for k, v in art.reuse_ranks.items()})


def test_lower_levels_cost_kl_and_bytes_monotonically(fitted):
    a, b, _, art = fitted
    from scd.evaluation.evaluate import Evaluator
    rows = Evaluator(a, b, _tokenizer(97)).run(random_samples(4, 3), [*methods.at_levels(art), methods.SCDMethod(art)],
                                                desc=None)
    kls, sizes = [r["kl"] for r in rows], [r["payload_ratio"] for r in rows]
    ladder = ", ".join(f"{r['method']}: {k:.3g} nats at {b:.3f}" for r, k, b in zip(rows, kls, sizes))
    # every step up the ladder (each level, then the full code) costs bytes and buys KL
    assert all(a < b for a, b in zip(sizes, sizes[1:])), f"payload not rising level by level: {ladder}"
    assert all(a > b for a, b in zip(kls, kls[1:])), f"KL not falling level by level: {ladder}"


def test_a_consumer_refuses_dims_that_are_not_one_of_its_levels(fitted):
    a, _, _, art = fitted
    ids = random_samples(1, 2)[0].prefix[None]
    level = art.levels[1]
    blob = codec.encode(encode(art, capture(a, ids, torch.ones_like(ids)), ids, level), "a:b", "v",
                        codec.artifact_dims(art, level), "fp16")
    with pytest.raises(codec.PayloadError, match="dims"):
        codec.decode(blob, "a:b", "v", art.plan, codec.artifact_dims(art))      # the full dims only


def test_choose_takes_the_largest_level_whose_codes_arrive_in_time(fitted):
    _, _, _, art = fitted
    tokens = 1000
    ms = [links.transfer_ms(codec.code_bytes(art, tokens, lv), 1.0) for lv in art.levels]
    assert links.transfer_ms(125_000_000, 1.0) == pytest.approx(1000.0)       # 1 Gbit in a second
    assert links.choose(art, tokens, None, 5.0) == art.levels[-1]              # nothing known: the full code
    assert links.choose(art, tokens, 1.0, None) == art.levels[-1]
    for i, t in enumerate(ms):
        assert links.choose(art, tokens, 1.0, t) == art.levels[i]
        assert links.choose(art, tokens, 1.0, t * 0.999) == art.levels[max(0, i - 1)]
    assert links.choose(art, tokens, 1.0, 0.0) == art.levels[0]              # too late anyway: the smallest
    assert links.choose(art, tokens, 10.0, ms[-1] / 10) == art.levels[-1]     # 10x the bandwidth, a tenth the time
    with pytest.raises(ValueError, match="positive"):
        links.transfer_ms(10, 0.0)


def test_the_producer_sends_each_link_the_level_that_fits_and_the_answer_says_which(fitted):
    a, b, _, art = fitted
    tok = _tokenizer(97)
    prefix = random_samples(1, 4)[0].prefix.tolist()
    full = codec.code_bytes(art, len(prefix))
    # a link slow enough that the full code takes ~10 s, a target of 1 s: the producer sends a lower level
    slow_gbps = full * 8 / 1e9 / 10
    art_c = dataclasses.replace(art, pair="a:c")
    producer = ProducerEngine(a, tok, {"a:b": (art, "v1"), "a:c": (art_c, "v1")}, cache_bytes=1 << 20,
                              link_gbps={"a:b": slow_gbps}, ttft_target_ms=1000.0)
    res = producer.encode(prefix, ["a:b", "a:c"])
    slow, fast = res.per_pair["a:b"], res.per_pair["a:c"]
    assert fast.level == art.levels[-1] and slow.level != art.levels[-1], (slow.level, fast.level)
    assert len(slow.payload) < len(fast.payload)
    for e, engine in ((slow, SpecialistEngine("b", b, tok, art, "v1")), (fast, SpecialistEngine("c", b, tok, art_c, "v1"))):
        _, info, _ = engine.complete(prefix, [11], e.payload, None, GenParams(max_tokens=2))
        assert info.mode == "scd" and info.level == e.level and info.as_dict()["level"] == e.level
    again = producer.encode(prefix, ["a:b"])
    assert again.per_pair["a:b"].cache_hit and again.per_pair["a:b"].level == slow.level
    assert again.per_pair["a:b"].payload == slow.payload and producer.cache.stats.misses == 2


def test_the_bench_sweep_models_each_bandwidths_level_from_the_measured_phases(fitted):
    from cli.bench import per_link
    _, _, _, art = fitted
    tokens = 1000
    names = [x.name for x in methods.at_levels(art)] + ["scd"]
    sizes = [codec.code_bytes(art, tokens, lv) for lv in art.levels]
    m = {"tokens": tokens, "producer_prefill_ms": 50.0,
         "methods": {"raw_kv": {"producer_ms": 0.0, "consumer_ms": 1.0, "payload_bytes": 4 * sizes[-1]},
                     **{n: {"producer_ms": 2.0, "consumer_ms": 3.0, "payload_bytes": b} for n, b in zip(names, sizes)}}}
    kls = {n: 1.0 / (i + 1) for i, n in enumerate(names)}
    # 10 ms left for the link after 52 ms of prefill and encode: the bandwidth at which level i just fits
    just = [b * 8 / 1e6 / 10.0 for b in sizes]
    rows = per_link(m, art, [just[1] * 1.0001, just[-1] * 1.01], 62.0, kls)
    assert [r["method"] for r in rows] == [names[1], "scd"], rows
    assert rows[0]["ttft_ms"] == pytest.approx(50 + 2 + 10 + 3, rel=1e-3) and rows[0]["kl"] == kls[names[1]]
    assert rows[1]["payload_ratio"] == pytest.approx(0.25) and rows[1]["level"] == art.levels[-1]
    assert per_link(m, art, [just[1] * 1.0001], None, kls, link_ms=10.0) == rows[:1]     # the link's share given


def test_a_link_counts_the_bytes_calibration_measured_on_the_wire(fitted):
    """A level's payload ratio measured on held-out payloads (info["levels"], compressed as sent) is what
    the link carries: a level measured at half its code bytes fits a budget its code bytes do not."""
    _, _, _, art = fitted
    tokens = 1000
    full = codec.code_bytes(art, tokens)
    budget = links.transfer_ms(full, 1.0) * 0.6
    assert links.choose(art, tokens, 1.0, budget) != art.levels[-1]
    half = full / 2 / (art.spec.kv_bytes_per_token * tokens)
    measured = dataclasses.replace(art, info={"levels": [{**lv, "payload_ratio": half if lv == art.levels[-1] else 1.0}
                                                         for lv in art.levels]})
    assert links.level_bytes(measured, tokens, art.levels[-1]) == pytest.approx(full / 2, abs=1)
    assert links.choose(measured, tokens, 1.0, budget) == art.levels[-1]
    assert links.level_bytes(art, tokens, art.levels[0]) == codec.code_bytes(art, tokens, art.levels[0])   # unmeasured


def test_a_link_never_gets_a_level_that_failed_the_quality_gate(fitted):
    """Levels whose held-out KL lost to raw KV reuse at calibration (info["levels"][i]["servable"] false) are
    never chosen: a slow link gets the smallest level that passed, and the consumer still decodes any level."""
    _, _, _, art = fitted
    art = dataclasses.replace(art, info={"levels": [{**lv, "servable": i > 0} for i, lv in enumerate(art.levels)]})
    assert art.servable_levels == art.levels[1:]
    assert links.choose(art, 1000, 1.0, 0.0) == art.levels[1]
    assert links.choose(art, 1000, 1.0, 1e9) == art.levels[-1]
    assert codec.artifact_dims(art, art.levels[0]) in codec.level_dims(art)


def test_an_artifact_cut_to_a_level_rebuilds_what_that_level_sent_rebuilds(fitted):
    """PairArtifacts.at_level: the encoders' leading columns and the decoders' leading rows, so serving the cut
    artifact at its full ranks equals serving the whole one at that level."""
    a, b, _, art = fitted
    ids = random_samples(1, 3)[0].prefix[None]
    trace = capture(a, ids, torch.ones_like(ids))
    for level in art.levels[:-1]:
        cut = art.at_level(level)
        assert cut.reuse_ranks == level and cut.levels[-1] == level, (cut.reuse_ranks, level)
        got, _ = rebuild(b, cut, codec.as_received(encode(cut, trace, ids), "fp16"))
        want, _ = rebuild(b, art, codec.as_received(encode(art, trace, ids, level), "fp16"))
        assert _max_err(got, want) < 1e-5, f"{level}: {_max_err(got, want):.2e}"
    with pytest.raises(ValueError, match="not a level"):
        art.at_level({k: v + 1 for k, v in art.reuse_ranks.items()})


def test_calibration_serves_the_level_with_the_lowest_validation_kl(tmp_path):
    """The level stage scores every level of the finished artifact on validation and cuts the artifact to the
    one with the lowest KL, which then scores what the stage recorded for it."""
    a = tiny_llama(0)
    b = perturbed(a, 0.3, seed=1)
    cfg = fit_settings(reuse_source="hidden", r_x=24, r_h=8, aligner_epochs=2, pool=1, batch=16, finetune_samples=0)
    val = random_samples(4, 2)
    cal = Calibration(a, b, ModelSpec.from_config(a.config), "a:b", [s.prefix for s in random_samples(24, 1)], tmp_path,
                      cfg, progress=False, log=lambda s: None)
    art = cal.run(val)
    rec = art.info["level"]
    assert [t["r_x"] for t in rec["tried"]] == [6, 12, 18, 24], rec["tried"]
    best = min(rec["tried"], key=lambda t: t["kl"])
    assert rec["chosen"] == {"r_x": best["r_x"]} and art.r_x == best["r_x"], rec
    assert all(c.enc.shape[1] == art.r_x and c.dec.shape[0] == art.r_x for c in art.reuse_x.values())
    got = PlanScorer(a, b, val, lambda plan: art).kl(art.plan)
    assert abs(got - best["kl"]) < 1e-6, f"the served artifact scores {got:.6f}, the stage recorded {best['kl']:.6f}"
    off = Calibration(a, b, cal.spec, "a:b", cal.prefixes, tmp_path, cfg.model_copy(update={"choose_level": False}),
                      progress=False, log=lambda s: None).run(val)
    assert off.r_x == 24 and "level" not in off.info
