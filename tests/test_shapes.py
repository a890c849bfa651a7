"""Timing families (scd.online.shapes): real architectures' shapes with random weights, built where they run,
their configs, the refusal of a family that does not fit, and a tiny one served end to end with every answer
saying timing_only."""
from __future__ import annotations

import pytest
import torch
import yaml

from cluster.config import ConfigError, load_config, parse
from scd.online import shapes
from scd.online.models import load
from tests.conftest import REPO

PUBLISHED_PARAMS = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248}   # the released checkpoints'


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_a_shape_has_the_published_models_parameters_and_layout(name):
    with torch.device("meta"):                                  # the architecture alone, no memory
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM(shapes.config(name))
    counted = sum(p.numel() for p in model.parameters())
    assert counted == PUBLISHED_PARAMS[name] == shapes.params(name), (name, counted, shapes.params(name))
    cfg = model.config
    rope = cfg.rope_parameters
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 4, cfg
    assert (rope["rope_type"], rope["rope_theta"]) == ("llama3", 500000.0), rope


def test_a_shape_path_builds_a_seeded_random_model_that_says_it_is_for_timing():
    a, tok, spec = load("shape://tiny?seed=1")
    b, _, _ = load("shape://tiny?seed=1")
    c, _, _ = load("shape://tiny?seed=2")
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc), "the seed does not fix the weights"
    assert a.dtype == torch.float32 and a.scd_timing_only and a.scd_weights_digest == "shape:tiny:1"
    assert spec.num_layers == shapes.SHAPES["tiny"]["num_hidden_layers"]
    ids = tok("Notes: a shape has no folder", return_tensors="pt").input_ids
    assert int(ids.max()) < a.config.vocab_size
    assert a(ids).logits.shape == (1, ids.shape[1], a.config.vocab_size)


def test_a_config_names_shapes_and_an_unknown_one_is_a_config_error_naming_the_shapes():
    for n in ("tiny", "1b", "8b"):
        cfg = load_config(REPO / "configs" / f"timing-{n}.yaml")
        assert all(shapes.is_shape(m.path) for m in [cfg.producer, *cfg.specialists]), cfg
    with pytest.raises(ConfigError) as e:
        parse({"producer": {"name": "base", "path": "shape://llama-9b"},
               "specialists": [{"name": "s", "path": "shape://tiny?seed=x"}]})
    assert "base.path: shape://llama-9b: no such shape; the shapes are tiny" in str(e.value), e.value
    assert "s.path: shape://tiny?seed=x: seed must be an integer" in str(e.value), e.value


def test_a_family_that_does_not_fit_is_refused_in_one_line_with_what_it_needs_and_what_there_is():
    cfg = load_config(REPO / "configs" / "timing-8b.yaml")
    n, batch = 1 + len(cfg.specialists), cfg.limits.specialist_max_ongoing
    tokens = cfg.limits.max_input_tokens + cfg.limits.max_tokens                # a row's prefix and its answer
    need = shapes.need_bytes(["llama-3.1-8b"] * n, tokens, batch)
    assert need == n * (shapes.params("llama-3.1-8b") * 2 + batch * shapes.kv_bytes("llama-3.1-8b", tokens)), need
    shapes.check_family(cfg, free_bytes=need)                   # fits exactly
    with pytest.raises(shapes.ShapeError) as e:
        shapes.check_family(cfg, free_bytes=need - 1)
    line = str(e.value)
    assert "\n" not in line and f"needs {need / 2**30:.1f} GiB on the GPU" in line and "is free there" in line, line


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_the_codes_rank_at_size_gives_about_a_tenth_of_the_raw_kv(name):
    from jobs.timing_family import code_rank
    from scd.online import codec
    from scd.online.models import ModelSpec
    spec = ModelSpec.from_config(shapes.config(name))
    r = code_rank(spec, 0.1)
    ratio = lambda r: (spec.num_layers - 1) * codec.code_bytes_per_row(r, "mixed") / spec.kv_bytes_per_token  # noqa: E731
    assert ratio(r) <= 0.1 < ratio(r + 1), (name, r, ratio(r), ratio(r + 1))


def test_random_artifacts_of_every_plan_kind_have_the_plans_and_payload_they_say(tmp_path):
    from jobs.timing_family import PLAN_KINDS, random_artifact
    from scd.online import codec
    from scd.online.models import ModelSpec
    spec = ModelSpec.from_config(shapes.config("tiny"))
    arts = {k: random_artifact(k, f"base:{k}", spec, 2048) for k in PLAN_KINDS}
    assert arts["codes"].plan == ["exact"] + ["hidden"] * 3 and arts["alora"].plan == ["shared"] * 4
    assert arts["block_2_3"].plan == ["exact", "hidden", "hidden", "entry"], arts["block_2_3"].plan
    assert arts["block_1_3"].plan == ["exact", "entry", "recompute", "recompute"], arts["block_1_3"].plan
    assert arts["exact_half"].plan == ["exact", "shared", "entry", "recompute"], arts["exact_half"].plan
    sent = codec.code_bytes(arts["codes"], 1024) / (1024 * spec.kv_bytes_per_token)
    assert 0.08 < sent < 0.12, f"the codes take {sent:.3f} of the raw KV, not about 0.1"


@pytest.mark.parametrize("kind", ["codes", "block_1_3", "exact_half"])
def test_a_payload_kept_on_the_device_rebuilds_the_cache_the_host_bytes_rebuild(kind):
    """SCDMethod(wire=True), what tools.bench_size times on a GPU (the payload as a producer sends it over Ray
    Direct Transport): the same cache as the host bytes' path, its payload the uncompressed body (a block's in
    two parts, E-first)."""
    from jobs.timing_family import random_artifact
    from scd.evaluation import methods
    from scd.online.models import ModelSpec
    from scd.online.trace import capture
    producer, tok = shapes.build(f"{shapes.SCHEME}tiny")
    consumer, _ = shapes.build(f"{shapes.SCHEME}tiny?seed=1")
    art = random_artifact(kind, f"base:{kind}", ModelSpec.from_config(producer.config), len(tok))
    ids = torch.randint(len(tok), (1, 96), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        trace = capture(producer, ids, mask, want_hidden=art.needs_hidden)
        host = methods.SCDMethod(art).build(consumer, ids, mask, trace)
        device = methods.SCDMethod(art, wire=True).build(consumer, ids, mask, trace)
    err = max((a - b).abs().max().item() for x, y in zip(host.kv, device.kv) for a, b in zip(x, y))
    assert err == 0.0, f"the kept payload's cache differs from the host bytes' by {err:.3g}"
    assert device.payload_bytes >= host.payload_bytes > 0, (device.payload_bytes, host.payload_bytes)
    assert (device.entry_bytes > 0) == (host.entry_bytes > 0) == (kind != "codes"), (device.entry_bytes, host.entry_bytes)


def test_a_random_plan_shape_can_end_its_block_below_the_top():
    """random_artifact(entry=, stop=): the shape of a calibrated block below the top (the consumer's layers
    entry..stop-1, codes below and above); a block that does not fit the layers is refused; and
    tools.bench_lora_group reads NAME=ENTRY[:STOP]."""
    import argparse

    from jobs.timing_family import random_artifact
    from scd.online.models import ModelSpec
    from tools.bench_lora_group import plan_shapes
    spec = ModelSpec.from_config(shapes.config("tiny"))
    art = random_artifact("codes", "base:qa", spec, 2048, entry=1, stop=3)
    assert art.plan == ["exact", "entry", "recompute", "hidden"] and art.blocks == [(1, 3)], art.plan
    assert sorted(art.reuse_x) == [3] and sorted(art.entry_align) == [1]
    assert random_artifact("codes", "base:qa", spec, 2048, entry=2).plan == ["exact", "hidden", "entry", "recompute"]
    for stop in (2, 5):
        with pytest.raises(ValueError, match=rf"a block \[2, {stop}\) of 4 layers"):
            random_artifact("codes", "base:qa", spec, 2048, entry=2, stop=stop)
    assert plan_shapes("qa=17:27,code=8") == {"qa": (17, 27), "code": (8, None)}
    for bad in ("qa=x", "qa=17:", "=8", "qa=17:2x"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=ENTRY or NAME=ENTRY:STOP"):
            plan_shapes(bad)


def test_bench_size_times_every_plan_kind_against_the_own_prefill_and_says_timing_only(tmp_path):
    """tools.bench_size at the tiny shape (the GPU script's CPU rehearsal): a row per prefix length and plan
    kind, each kind's payload as its plan sends it, the tables written."""
    import json

    from jobs.timing_family import PLAN_KINDS
    from tools.bench_size import main
    assert main(["--shape", "tiny", "--tokens", "64,96", "--repeats", "1", "--device", "cpu", "--out", str(tmp_path),
                 "--profile", "96"]) == 0
    r = json.loads((tmp_path / "size.json").read_text())
    assert r["timing_only"] and [(x["tokens"], x["kind"]) for x in r["rows"]] == \
        [(t, k) for t in (64, 96) for k in PLAN_KINDS], r["rows"]
    ratio = {x["kind"]: x["payload_ratio"] for x in r["rows"] if x["tokens"] == 96}
    assert ratio["codes"] < 0.15 < ratio["exact_half"] < ratio["alora"], ratio       # codes < half shared < all
    assert all(x["oracle_ms"] > 0 and x["consumer_ms"] >= 0 and x["fanout"]["8"] > 0 for x in r["rows"]), r["rows"]
    assert "timing-only" in (tmp_path / "size.md").read_text()
    # --profile: every phase at 96 tokens under the profiler, its host operators and a trace each
    phases = r["profile"]["phases"]
    assert r["profile"]["tokens"] == 96 and [p["phase"].split(":")[0] for p in phases[2:2 + len(PLAN_KINDS)]] == \
        list(PLAN_KINDS), [p["phase"] for p in phases]
    assert [p["phase"] for p in phases[:2]] == ["oracle prefill", "producer prefill"], phases[:2]
    assert sum("decode batch 1" in p["phase"] for p in phases) == 3, [p["phase"] for p in phases]
    rates = [(d["batch"], d["engine_tok_s"] > 0, d["static_rebuilt_tok_s"] > 0, d["loop_tok_s"] > 0) for d in r["decode"]]
    assert rates == [(b, True, True, True) for b in (1, 8, 32)], rates
    for p in phases:
        assert p["wall_ms"] > 0 and p["host"] and p["host"][0]["ms"] > 0 and (tmp_path / p["trace"]).stat().st_size, p
    md = (tmp_path / "profile.md").read_text()
    assert "timing-only" in md and all(f"**{p['phase']}**" in md for p in phases), md[:400]


def test_bench_size_refuses_a_profile_length_it_does_not_measure(capsys):
    from tools.bench_size import main
    with pytest.raises(SystemExit) as e:
        main(["--shape", "tiny", "--tokens", "64,96", "--profile", "80"])
    assert e.value.code == 2 and "--profile 80 is not one of --tokens 64,96" in capsys.readouterr().err


def test_a_tiny_timing_family_serves_every_plan_kind_and_every_answer_says_timing_only(ray_cluster, tmp_path):
    """configs/timing-tiny.yaml as it is (on a free port, with a store of its own), its random artifacts
    published by jobs.timing_family: one fan-out to every specialist, each served by its plan."""
    import requests
    from ray import serve

    from jobs.timing_family import main as publish
    from serve_app.app import deploy, undeploy, wait_healthy
    from tests.test_serve import SERVE_PORT
    raw = yaml.safe_load((REPO / "configs" / "timing-tiny.yaml").read_text())
    raw.update(ray={"namespace": "scd-test-timing"}, http={"port": SERVE_PORT},
               artifacts={"uri": str(tmp_path / "store")})
    (tmp_path / "timing.yaml").write_text(yaml.safe_dump(raw))
    assert publish(["--config", str(tmp_path / "timing.yaml")]) == 0
    cfg = load_config(tmp_path / "timing.yaml")
    names = [s.name for s in cfg.specialists]
    deploy(cfg)
    url = f"http://127.0.0.1:{cfg.http.port}"
    try:
        wait_healthy(url, timeout_s=300)
        fan = requests.post(url + "/v1/fanout", timeout=120, json={"prefix": "Notes: timing " * 40, "requests": [
            {"specialist": s, "suffix": " and", "max_tokens": 4} for s in names]}).json()
        served = {r["specialist"]: (r["scd"]["mode"], r["scd"]["reason"], r["scd"]["timing_only"])
                  for r in fan["results"]}
        assert served == {s: ("scd", None, True) for s in names}, served
        undeploy(cfg, keep_serve=True)                 # the app goes; Serve's proxy stays for the next one
        assert "scd" not in serve.status().applications, serve.status().applications
        assert requests.get(url + "/-/healthz", timeout=30).status_code == 200
        assert requests.get(url + "/healthz", timeout=30).status_code == 404
    finally:
        undeploy(cfg, keep_serve=True)
