"""The consumer's own last tokens (PairArtifacts.tail_tokens, scd.online.selective.run_tail): over its own cache the
tail changes nothing; over another model's it makes the last positions the consumer's, left padding and all;
an artifact keeps its tail through a save and load and serves it; a held-out curve compares plans with tails
against DroidSpeak at the same compute."""
import pytest
import torch

from scd.fitting import points
from scd.online import codec
from scd.online.artifacts import PairArtifacts
from scd.online.models import ModelSpec
from scd.online.rebuild import encode, rebuild
from scd.online.selective import run_tail
from scd.online.trace import capture
from tests.conftest import left_padded_batch, perturbed, tiny_llama


def _err(kv, want, positions=slice(None)) -> float:
    return max((g[..., positions, :] - w[..., positions, :]).abs().max().item()
               for (gk, gv), (wk, wv) in zip(kv, want) for g, w in ((gk, wk), (gv, wv)))


def test_a_tail_over_the_consumers_own_cache_is_its_own_cache_and_over_another_it_replaces_the_last_tokens():
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    ids, mask = left_padded_batch(lengths=(12, 7, 9))
    own = capture(b, ids, mask, want_xnorm=False)
    own_kv = list(zip(own.keys, own.values))
    got = run_tail(b, own_kv, ids, mask, 4)
    assert _err(got, own_kv) < 1e-5, f"the tail over the consumer's own cache moved it by {_err(got, own_kv):.2e}"
    raw = capture(a, ids, mask, want_xnorm=False)
    raw_kv = list(zip(raw.keys, raw.values))
    got = run_tail(b, raw_kv, ids, mask, 4)
    assert _err(got, raw_kv, slice(None, -4)) == 0, "positions before the tail are the cache's as given"
    assert _err(got, raw_kv, slice(-4, None)) > 1e-2, "the tail's K and V are the consumer's, not the producer's"
    # each row as if alone: the left padding changes nothing (row 1 has 7 tokens, its tail its last 4)
    for row in range(3):
        n = int(mask[row].sum())
        alone = run_tail(b, [(k[row:row + 1, :, -n:], v[row:row + 1, :, -n:]) for k, v in raw_kv],
                         ids[row:row + 1, -n:], mask[row:row + 1, -n:], 4)
        mine = [(k[row:row + 1, :, -n:], v[row:row + 1, :, -n:]) for k, v in got]
        assert _err(mine, alone) < 1e-5, f"row {row} differs from itself alone by {_err(mine, alone):.2e}"
    # a tail as long as the prefix keeps its first position from the cache (layer 0 of position 0 is exact anyway)
    first = [(k[:1], v[:1]) for k, v in raw_kv]
    whole = run_tail(b, first, ids[:1], mask[:1], 100)
    assert _err(whole, first, slice(0, 1)) == 0 and _err(whole, first, slice(1, None)) > 1e-2


def test_one_unpadded_row_runs_its_tail_in_plain_torch_as_transformers_does(monkeypatch):
    """A served request's tail (one row, no padding) goes through fast_decode.FastStep.extend: the same K and V
    as transformers' forward gives the same row (fast_decode turned off)."""
    from scd.online import fast_decode, selective
    a, b = tiny_llama(0), perturbed(tiny_llama(0), 0.3)
    ids = torch.randint(2, 97, (1, 14), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    raw = capture(a, ids, mask, want_xnorm=False)
    raw_kv = list(zip(raw.keys, raw.values))
    used = []
    real = fast_decode.step_for
    monkeypatch.setattr(selective.fast_decode, "step_for", lambda m: used.append(m) or real(m))
    fast = run_tail(b, raw_kv, ids, mask, 5)
    monkeypatch.setattr(selective.fast_decode, "step_for", lambda m: None)
    hf = run_tail(b, raw_kv, ids, mask, 5)
    err = _err(fast, hf)
    assert used == [b] and err < 1e-5, f"plain torch's tail differs from transformers' by {err:.2e}"
    assert _err(fast, raw_kv, slice(None, -5)) == 0 and _err(fast, raw_kv, slice(-5, None)) > 1e-2


def test_an_artifact_keeps_its_tail_through_a_save_and_load_and_rebuilds_with_it(tmp_path):
    a = tiny_llama(0, layers=4)
    b = perturbed(tiny_llama(0, layers=4), 0.3, seed=1)
    spec = ModelSpec.from_config(a.config)
    art = PairArtifacts.exact("a:b", spec, ["exact", "shared", "shared", "shared"], "bf16").with_tail(5)
    art.save(tmp_path / "art")
    loaded = PairArtifacts.load(tmp_path / "art")
    assert loaded.tail_tokens == 5
    assert PairArtifacts.load(tmp_path / "art").with_tail(0).description() == \
        PairArtifacts.exact("a:b", spec, ["exact", "shared", "shared", "shared"], "bf16").description()
    with pytest.raises(ValueError, match="tail_tokens and tail_of must be 0 or more"):
        art.with_tail(-1)
    share = art.with_tail(5, 20)                    # the last quarter of every prefix
    share.save(tmp_path / "share")
    again = PairArtifacts.load(tmp_path / "share")
    assert (again.tail_tokens, again.tail_of) == (5, 20) and "tail_of" not in art.description()
    assert [again.tail_for(t) for t in (20, 16, 80, 2)] == [5, 4, 20, 1]
    assert [art.tail_for(t) for t in (16, 80)] == [5, 5]           # a count without tail_of
    ids = torch.randint(2, 97, (1, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    tr = capture(a, ids, mask)
    codes = codec.as_received(encode(loaded, tr, ids), "bf16")
    kv, phases = rebuild(b, loaded, codes)
    plain, _ = rebuild(b, loaded.with_tail(0), codes)
    want = run_tail(b, plain, ids, mask, 5)
    assert _err(kv, want) < 1e-6 and "tail_ms" in phases, _err(kv, want)
    kv, _ = rebuild(b, again, codes)                # 5 of 20 tokens: the last 4 of these 16
    want = run_tail(b, plain, ids, mask, 4)
    assert _err(kv, want) < 1e-6 and _err(kv, run_tail(b, plain, ids, mask, 5)) > 1e-3, _err(kv, want)


def test_the_tail_is_served_by_a_specialist():
    from actors.messages import GenParams
    from engines.producer import ProducerEngine
    from engines.specialist import SpecialistEngine
    from tests.test_models import _tokenizer
    a = tiny_llama(0, layers=4)
    b = perturbed(tiny_llama(0, layers=4), 0.3, seed=1)
    spec = ModelSpec.from_config(a.config)
    art = PairArtifacts.exact("a:b", spec, ["exact", "shared", "shared", "shared"], "bf16").with_tail(3)
    tok = _tokenizer(97)
    ids = list(range(5, 25))
    payload = ProducerEngine(a, tok, {"a:b": (art, "v1")}, cache_bytes=1 << 20).encode(ids, ["a:b"]).per_pair["a:b"].payload
    _, info, _ = SpecialistEngine("b", b, tok, art, "v1").complete(ids, [11], payload, None,
                                                                      GenParams(max_tokens=4))
    assert info.mode == "scd" and "tail" in info.timings, info
    _, plain, _ = SpecialistEngine("b", b, tok, art.with_tail(0), "v1").complete(ids, [11], payload, None,
                                                                                GenParams(max_tokens=4))
    assert plain.mode == "scd" and "tail" not in plain.timings, plain



def test_points_are_named_costed_and_compared_with_droidspeak_at_the_same_compute():
    from jobs.report import against_droidspeak, held_out_curve
    n, t = 8, 100
    assert points.point_name(8, 0, n) == "codes" and points.point_name(6, 20, n) == "enter@6+tail20"
    assert points.point_name(6, 20, n, "attention") == "enter@6+sel20"
    assert points.point_name(6, 20, n, "suffix") == "enter@6+rsel20"
    assert [points.parse_point(s, n) for s in ("codes+tail20", "enter@6", "droidspeak@4", "raw_kv", "enter@x",
                                               "codes+sel30", "enter@6+selx", "codes+rsel30", "enter@6+lsel8")] == \
        [(8, 20, "last", n), (6, 0, "last", n), (4, 0, "last", n), None, None, (8, 30, "attention", n), None,
         (8, 30, "suffix", n), (6, 8, "learned", n)]
    # a block that ends below the top: layers 3..6, named as a slice; a stop not above the entry nor below the top
    # is no point
    assert points.point_name(3, 16, n, "suffix", stop=7) == "enter@3:7+rsel16"
    assert points.point_name(3, 0, n, stop=n) == "enter@3"
    assert [points.parse_point(s, n) for s in ("enter@3:7+rsel16", "enter@3:7", "enter@3:3", "enter@3:8",
                                               "enter@3:x")] == [(3, 16, "suffix", 7), (3, 0, "last", 7),
                                                                 None, None, None]
    assert points.consumer_ratio(3, 0, n, t, stop=7) == pytest.approx(4 / 8)
    assert points.kind({"entry": 3, "stop": 7, "tail": 16, "rule": "suffix"}, n) == \
        "block below the top + selective, the request's reads"
    assert points.consumer_ratio(6, 20, n, t) == pytest.approx(0.25 + 0.2)
    # the attention rule's window runs twice: counted again; a tail within it is the window, run once
    assert points.consumer_ratio(6, 20, n, t, "attention") == pytest.approx(0.25 + (20 + points.SELECT_WINDOW) / t)
    assert points.consumer_ratio(6, 8, n, t, "attention") == pytest.approx(0.25 + points.SELECT_WINDOW / t)
    # the suffix rule's first pass of the request: counted as a window too
    assert points.consumer_ratio(6, 20, n, t, "suffix") == pytest.approx(0.25 + (20 + points.SELECT_WINDOW) / t)
    rows = [{"method": "scd", "kl": 0.1}, {"method": "enter@6", "kl": 0.3}, {"method": "codes+tail25", "kl": 0.2},
            {"method": "raw_kv", "kl": 1.0}, {"method": "droidspeak@4", "kl": 0.4},
            {"method": "droidspeak@6", "kl": 0.5}, {"method": "droidspeak", "kl": 0.9}]
    # entering at a layer DroidSpeak entered at compares with it there; a tail of 25 of 100 tokens costs 0.25,
    # DroidSpeak's entry at 6: the same; the chosen plan (the scd row) is enter@4
    got = against_droidspeak(rows, "enter@4", n, t)
    assert got == pytest.approx({"enter@6": 0.6, "codes+tail25": 0.4, "enter@4": 0.25}), got
    curve = held_out_curve(rows, "enter@4", n, t)
    assert [x[:2] for x in curve["DroidSpeak"]] == [(0.0, 1.0), (0.25, 0.5), (0.5, 0.4)], curve
    # between two DroidSpeak points: linear in compute; beyond the deepest entry measured: not compared
    assert points.droidspeak_at(0.125, [(0.0, 1.0), (0.25, 0.5)]) == pytest.approx(0.75)
    assert points.droidspeak_at(0.6, [(0.0, 1.0), (0.25, 0.5)]) is None
    assert points.pareto([{"consumer_ratio": 0.2, "kl": 0.3}, {"consumer_ratio": 0.3, "kl": 0.4},
                          {"consumer_ratio": 0.5, "kl": 0.1}]) == [{"consumer_ratio": 0.2, "kl": 0.3},
                                                                   {"consumer_ratio": 0.5, "kl": 0.1}]


def test_the_job_publishes_a_tail_where_it_is_the_cheapest_plan_within_the_bound(tmp_path, capsys, monkeypatch):
    """The block stage's choice with tails: a tail point that meets the bound at the least modeled TTFT (its KL
    set to 0 here, so that the choice does not hang on what a tiny budget fits) is published as the codes with
    tail_tokens, which the held-out evaluation rebuilds with."""
    from artifacts_store import ArtifactStore
    from jobs.calibrate import main as calibrate
    from scd.fitting import blocks
    from tests.conftest import write_config
    curve = blocks.curve

    def tails_meet(*a, **k):
        pts, raw = curve(*a, **k)
        return [{**p, "kl": 0.0} if p["tail"] and p.get("rule", "last") == "last" else p for p in pts], raw
    monkeypatch.setattr(blocks, "curve", tails_meet)
    cfg = write_config(tmp_path, recompute_blocks=True, max_kl_ratio=0.01, max_consumer_prefill_ratio=0.1,
                       tails=[8])
    ref = calibrate(["--pair", "base:prose", "--config", str(cfg), "--no-actors"])
    out = capsys.readouterr().out
    assert "codes alone, and the prefix's last 8 tokens through every layer (within the quality bound)" in out, out
    art, _ = ArtifactStore(tmp_path / "store").load(ref)
    assert art.tail_tokens == 8 and not art.blocks, (art.tail_tokens, art.plan)
    chosen = art.info["blocks"]["chosen"]
    assert (chosen["entry"], chosen["tail"]) == (8, 8) and chosen["consumer_ratio"] == pytest.approx(8 / 96), chosen


@pytest.mark.parametrize("rule, mark, note, window, pair", [
    ("attention", "sel", "positions its last tokens attend to most", points.SELECT_WINDOW, "base:prose"),
    ("learned", "lsel", "positions its selector picks", 0, "base:prose"),
    ("suffix", "rsel", "positions the request's own tokens read most", points.SELECT_WINDOW, "base:qa")])
def test_the_job_publishes_a_selective_plan_where_it_is_the_cheapest_within_the_bound(
        tmp_path, capsys, monkeypatch, rule, mark, note, window, pair):
    """calibration.selective's points beside the entries, under the attention rule, the selector the job
    fitted, and (QA samples: a question follows the prefix) the question's reads: one over the codes alone that
    meets the bound (its KL set to 0 here, as for tails above) is published as the codes with its tail_rule,
    its share of every prefix, and the held-out evaluation rebuilds with it. A text pair measures no suffix
    rule (no request follows its windows)."""
    from artifacts_store import ArtifactStore
    from jobs.calibrate import main as calibrate
    from scd.fitting import blocks
    from tests.conftest import write_config
    curve = blocks.curve

    def selective_meets(*a, **k):
        pts, raw = curve(*a, **k)
        return [{**p, "kl": 0.0} if p.get("rule") == rule and p["entry"] == 8 else p for p in pts], raw
    monkeypatch.setattr(blocks, "curve", selective_meets)
    cfg = write_config(tmp_path, recompute_blocks=True, max_kl_ratio=0.01, max_consumer_prefill_ratio=0.3,
                       entries=[7], selective=[0.1, 0.5], selector_samples=8 if rule == "learned" else 0)
    ref = calibrate(["--pair", pair, "--config", str(cfg), "--no-actors"])
    out = capsys.readouterr().out
    art, _ = ArtifactStore(tmp_path / "store").load(ref)
    t, k = art.tail_of, art.tail_tokens
    assert (k, art.tail_rule) == (round(0.1 * t), rule) and not art.blocks, art.description()
    assert f"codes+{mark}{k} KL 0.0000" in out and f"{mark}{round(0.5 * t)}" not in out, out   # 0.5: beyond the ceiling
    assert f"codes alone, and the {k} {note} through every layer (within the quality bound)" in out, out
    assert ("+rsel" in out) == (pair == "base:qa"), "the suffix rule is measured where a question follows the prefix"
    chosen = art.info["blocks"]["chosen"]
    assert (chosen["entry"], chosen["tail"], chosen["rule"]) == (8, k, rule), chosen
    run = window if rule == "attention" and k <= window else k + window     # a share within the window: the window
    assert chosen["consumer_ratio"] == pytest.approx(run / t), chosen
