"""The learned selection rule (scd.fitting.selector, `selective.learned`): what a continuation reads, the
selector's features and target, its fit on planted scores and on the fine-tuning and serving lengths, the
rebuild error it may weight by, and an artifact that carries one."""
import math

import pytest
import torch

from scd.fitting.selector import fit_selector
from scd.online import selective
from scd.online.trace import capture
from tests.conftest import REPO, cache_of, largest_diff, left_padded_batch, perturbed, tiny_llama


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
    got = selective.reads_of(b, cache_of(b, ids, mask), mask, cont[None])
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
    kv = cache_of(b, ids, mask)
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
    assert largest_diff(kv, want) < 1e-6, largest_diff(kv, want)
    every, _ = rebuild(b, with_sel.with_tail(80, 80, "learned"), codes)
    assert largest_diff(every, cache_of(b, ids, mask)) < 1e-4, f"every position selected: {largest_diff(every, cache_of(b, ids, mask)):.2e}"


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
