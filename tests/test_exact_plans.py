"""Exact plans served: a consumer that shares its lower layers with the producer gets the producer's K and V
there and its residual at the entry layer, and runs its own layers above (scd.fitting.exact). Through the
engines it answers as the oracle does; calibration chooses the entry under the quality bound and publishes it
without fitting a code."""
import shutil

import pytest
import torch
import yaml

from actors.messages import GenParams
from engines.producer import ProducerEngine
from engines.specialist import SpecialistEngine
from scd.fitting import exact
from scd.online.models import ModelSpec
from tests.conftest import DEMO, tiny_llama, write_config
from tests.test_models import _tokenizer


def _top_adapted(base, first: int, scale: float = 0.5, seed: int = 1):
    """base with every weight of layers >= first moved by relative noise: layers below are the base's."""
    other = type(base)(base.config).eval()
    other.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for l in range(first, base.config.num_hidden_layers):
            for p in other.model.layers[l].parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    return other


def answers_as_the_oracle(base, top, art, seed: int, grow: int, prompts: int = 6) -> int:
    """How many of `prompts` greedy answers (12 tokens, prefixes of 10, 10 + grow, ... random tokens) the engines
    serving `art` (the producer on `base`, the specialist `top`) give as the specialist's own prefill does;
    every one must be served from codes."""
    tok = _tokenizer(97)
    producer = ProducerEngine(base, tok, {art.pair: (art, "v1")}, cache_bytes=1 << 20)
    served, oracle = SpecialistEngine("top", top, tok, art, "v1"), SpecialistEngine("top", top, tok)
    params = GenParams(max_tokens=12)
    g = torch.Generator().manual_seed(seed)
    same = 0
    for i in range(prompts):
        prefix = torch.randint(2, 97, (10 + grow * i,), generator=g).tolist()
        payload = producer.encode(prefix, [art.pair]).per_pair[art.pair].payload
        text, info, _ = served.complete(prefix, [11], payload, None, params)
        assert info.mode == "scd" and ("recompute" in info.timings) == bool(art.blocks), info
        same += text == oracle.complete(prefix, [11], None, "oracle", params)[0]
    return same


def test_the_engines_serve_an_exact_plan_as_the_oracle_answers():
    base = tiny_llama(0, layers=6)
    art = exact.artifact("a:top", ModelSpec.from_config(base.config), 4, "bf16")
    same = answers_as_the_oracle(base, _top_adapted(base, 4), art, seed=3, grow=5)
    assert same == 6, f"an exact plan in bf16 should answer as the oracle: {same} of 6 greedy answers equal"


def test_the_bound_with_a_noise_margin_refuses_a_plan_within_it_by_its_mean_alone():
    raw_kls = [0.30, 0.25, 0.35, 0.28, 0.32, 0.30]                    # raw KV's mean 0.30: the bound 0.06
    near = [0.02, 0.11, 0.03, 0.09, 0.04, 0.04]                       # mean 0.055, but spread across samples
    clear = [0.03, 0.025, 0.035, 0.03, 0.03, 0.03]                    # mean 0.03, every sample well within
    cheap = {"entry": 8, "consumer_ratio": 0.2, "kl": sum(near) / 6, "kls": near, "payload_bytes": 100,
             "consumer_ms": 10.0}
    dear = {"entry": 6, "consumer_ratio": 0.35, "kl": sum(clear) / 6, "kls": clear, "payload_bytes": 100,
            "consumer_ms": 20.0}
    raw = sum(raw_kls) / 6
    means = exact.Bound(0.2, 1.0)
    margin = exact.Bound(0.2, 1.0, noise_z=1.0)
    assert exact.choose([cheap, dear], raw, means, gbps=25, raw_kls=raw_kls) is cheap, "the means alone: the cheaper"
    assert not margin.meets(cheap, raw, raw_kls), "0.055 against a bound of 0.06 is within one standard error"
    assert exact.choose([cheap, dear], raw, margin, gbps=25, raw_kls=raw_kls) is dear
    assert margin.meets(cheap, raw), "without raw KV's per-sample KLs the mean decides"
    assert margin.meets({**cheap, "kls": near[:3]}, raw, raw_kls), "KLs of other samples: the mean decides"


def test_the_entry_chosen_is_the_cheapest_modeled_ttft_that_meets_the_bound():
    pts = [{"entry": 4, "consumer_ratio": 0.5, "kl": 1e-6, "payload_bytes": 1000, "consumer_ms": 50.0},
           {"entry": 6, "consumer_ratio": 0.25, "kl": 0.01, "payload_bytes": 1400, "consumer_ms": 25.0},
           {"entry": 8, "consumer_ratio": 0.0, "kl": 0.09, "payload_bytes": 1800, "consumer_ms": 1.0}]
    raw = 0.1
    lossless = exact.Bound(max_kl_ratio=0.001, max_consumer_ratio=1.0)
    assert exact.choose(pts, raw, lossless, gbps=25)["entry"] == 4        # only the lossless plan is within it
    loose = exact.Bound(max_kl_ratio=0.2, max_consumer_ratio=1.0)
    assert exact.choose(pts, raw, loose, gbps=25)["entry"] == 6           # cheaper, and KL 0.1 x raw
    slow_link = 1e-4                                                      # bytes dominate: the fewest of them
    assert exact.choose(pts, raw, loose, gbps=slow_link)["entry"] == 4
    assert exact.choose(pts, raw, exact.Bound(0.001, max_consumer_ratio=0.3), gbps=25) is None
    whole = [{"entry": 8, "consumer_ratio": 0.0, "kl": 3e-6, "payload_bytes": 1800, "consumer_ms": 1.0}]
    assert exact.choose(whole, 0.0, loose, gbps=25) == whole[0], "lossless passes where raw KV is exact too"
    packed = [{"entry": 8, "consumer_ratio": 0.0, "kl": 0.0015, "payload_bytes": 300, "consumer_ms": 2.0}]
    assert exact.choose(packed, 2e-5, loose, gbps=25) is None, "no ratio to an exact raw KV can be met"
    assert exact.choose(packed, 2e-5, exact.Bound(0.2, 1.0, max_kl=0.002), gbps=25) == packed[0], \
        "where raw KV is exact, an absolute max_kl is the bound"
    assert exact.choose(packed, 0.1, exact.Bound(0.2, 1.0, max_kl=0.001), gbps=25) is None
    either = exact.Bound(max_kl_ratio=1.0, max_consumer_ratio=1.0)
    assert exact.choose(pts[1:], raw, either, gbps=25)["entry"] == 8
    slow_encode = [pts[1], {**pts[2], "producer_ms": 500.0}]           # the producer's encode counts too
    assert exact.choose(slow_encode, raw, either, gbps=25)["entry"] == 6
    piped = {**pts[0], "entry_bytes": 100, "block_ms": 48.0}            # E-first: the block runs while the rest
    one_byte_a_ms = 8e-6                                                  # arrives (1000 bytes take 1000 ms here)
    assert exact.modeled_ttft_ms(piped, one_byte_a_ms) == pytest.approx(max(100 + 48, 1000 + 2))
    assert exact.modeled_ttft_ms(pts[0], one_byte_a_ms) == pytest.approx(1000 + 50)
    served = {**pts[0], "serving": {"payload_bytes": 4000, "consumer_ms": 200.0, "producer_ms": 5.0, "tokens": 2048}}
    assert exact.modeled_ttft_ms(served, one_byte_a_ms) == pytest.approx(5 + 4000 + 200), "timed at serving length"
    # a tail (its last tokens, or selective positions) runs over the whole rebuilt cache: after the block and the
    # rest's decode, never beside them
    tailed = {**piped, "tail": 8, "consumer_ms": 70.0, "tail_ms": 20.0}
    assert exact.modeled_ttft_ms(tailed, one_byte_a_ms) == pytest.approx(max(100 + 48, 1000 + 2) + 20)
    fast_link = 8e-3                                                      # the block decides: 0.1 + 48, then 20
    assert exact.modeled_ttft_ms(tailed, fast_link) == pytest.approx(0.1 + 48 + 20)
    untimed = {k: v for k, v in tailed.items() if k != "tail_ms"}       # a record from before tail_ms
    assert exact.modeled_ttft_ms(untimed, fast_link) == pytest.approx(1.0 + 70), "nothing beside an untimed tail"
    assert exact.modeled_ttft_ms({**piped, "tail_ms": 0.0}, one_byte_a_ms) == exact.modeled_ttft_ms(piped, one_byte_a_ms)
    assert exact.entries(18, 30) == [18, 21, 24, 27, 30] and exact.entries(4, 6) == [4, 5, 6]
    assert exact.entries(18, 30, adapted_until=24) == [18, 20, 21, 22, 30], "above layer 23 it is raw KV again"


@pytest.fixture(scope="module")
def top_folder(tmp_path_factory):
    """The demo base with its top two layers fine-tuned (moved), saved with the base's tokenizer."""
    from transformers import AutoModelForCausalLM
    out = tmp_path_factory.mktemp("top") / "top"
    base = AutoModelForCausalLM.from_pretrained(DEMO / "base").eval()
    first = base.config.num_hidden_layers - 2
    _top_adapted(base, first, scale=0.3).save_pretrained(out)
    for f in DEMO.joinpath("base").iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out, first


@pytest.fixture(scope="module")
def top_published(top_folder, tmp_path_factory):
    """base:top calibrated and published by the job (on the demo base and `top_folder`): (config, store, the
    published ref, the job's output)."""
    import contextlib
    import io
    from jobs.calibrate import main as calibrate
    folder, _ = top_folder
    tmp = tmp_path_factory.mktemp("top-published")
    cfg = write_config(tmp, heldout=3, val=3, gate_vs_raw_kv=1.0)
    doc = yaml.safe_load(cfg.read_text())
    doc["specialists"].append({"name": "top", "path": str(folder)})
    cfg.write_text(yaml.safe_dump(doc))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ref = calibrate(["--pair", "base:top", "--config", str(cfg), "--no-actors"])
    return cfg, tmp / "store", ref, out.getvalue()


def test_calibration_publishes_the_exact_plan_of_a_top_layer_fine_tune(top_folder, top_published):
    from artifacts_store import ArtifactStore
    _, first = top_folder
    _, store_dir, ref, out = top_published
    assert f"layers 0-{first - 1} of {first + 2} are the producer's exactly" in out, out
    assert "stage traces" not in out, "an exact plan fits nothing: no traces"
    store = ArtifactStore(store_dir)
    art, _ = store.load(ref)
    assert art.plan == ["exact"] + ["shared"] * (first - 1) + ["entry", "recompute"], art.plan
    m = store.show(ref)
    assert m.metrics["kl"] < 1e-3 and m.metrics["kl"] < 0.05 * m.metrics["kl_raw_kv"], m.metrics
    assert {"report/summary.md", "report/compute.png"} <= set(m.files), sorted(m.files)
    assert art.info["exact"]["chosen"]["entry"] == first and art.info["structure"]["verified_max_abs"] == 0.0
    assert art.info["exact"]["chosen"]["serving"]["tokens"] == 256, "plans are chosen timed at serving_tokens"
    assert "timed at 256 tokens" in out, out


def test_a_resubmitted_exact_plan_job_finds_its_pair_published_and_publishes_nothing(top_published):
    import contextlib
    import io
    from artifacts_store import ArtifactStore
    from jobs.calibrate import main as calibrate
    cfg, store_dir, ref, _ = top_published
    versions = [v.version for v in ArtifactStore(store_dir).list("base:top")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        again = calibrate(["--pair", "base:top", "--config", str(cfg), "--no-actors"])
    assert again == ref and f"already published as {ref}" in out.getvalue(), out.getvalue()
    assert [v.version for v in ArtifactStore(store_dir).list("base:top")] == versions, "published again"


@pytest.mark.parametrize("transport", ["object_store", "nixl"])
def test_replicas_take_an_exact_plan_entry_first_and_answer_as_the_oracle(top_folder, top_published, ray_cluster,
                                                                           transport):
    """Through the real actors: the producer offers the entry part and the rest as two payloads (two tickets),
    the specialist receives the entry, runs its block while it receives the rest, and answers as its own
    prefill does; both staged payloads are released."""
    import ray
    from actors.messages import SpecialistRequest
    from actors.producer_actor import ProducerActor
    from actors.specialist_actor import SpecialistActor
    from engines.interface import EngineConfig, ProducerConfig
    folder, _ = top_folder
    _, store_dir, _, _ = top_published
    ns = f"scd-test-efirst-{transport}"
    name = f"producer-efirst-{transport}"
    producer = ProducerActor.options(name=name, namespace=ns, num_cpus=0).remote(ProducerConfig(
        str(DEMO / "base"), {"base:top": "latest"}, str(store_dir), ns, name=name, transport=transport, watch_s=0,
        inline_bytes=0))
    replica = SpecialistActor.options(namespace=ns, num_cpus=0).remote(EngineConfig(
        "specialist", "top", str(folder), producer="base", store_uri=str(store_dir), namespace=ns, transport=transport))
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(DEMO / "base")
        prefix = tok("Notes on the river: the ferry leaves at nine and returns at noon.")["input_ids"] * 2
        params = GenParams(max_tokens=8)
        codes = ray.get(producer.encode.remote(prefix, ["base:top"]))
        pc = codes.per_pair["base:top"]
        assert pc.entry_ticket is not None and pc.ticket is not None, pc
        assert pc.entry_ticket.nbytes < pc.ticket.nbytes, (pc.entry_ticket.nbytes, pc.ticket.nbytes)
        served = ray.get(replica.generate.remote(SpecialistRequest(prefix, [11], params, pc, producer=name), "a"))
        oracle = ray.get(replica.generate.remote(SpecialistRequest(prefix, [11], params, reason="oracle"), "b"))
        assert served.scd["mode"] == "scd", (served.scd["reason"], served.scd["timings_ms"])
        assert {"transfer", "transfer_rest", "recompute"} <= set(served.scd["timings_ms"]), served.scd
        assert served.text == oracle.text, (served.text, oracle.text)
        if transport == "nixl":
            assert ray.get(producer.stats.remote())["staged"] == 0, "both parts are released once pulled"
    finally:
        ray.kill(replica)
        ray.kill(producer)


def test_scd_eval_takes_the_exact_plan_and_marks_what_fails_the_bound(top_folder, tmp_path, capsys):
    from cli.evaluate import main as evaluate
    folder, first = top_folder
    rows = {r["method"]: r for r in evaluate([
        "--producer", str(DEMO / "base"), "--consumer", str(folder), "--samples", "2", "--val", "3",
        "--prefix-tokens", "64", "--methods", "raw_kv,int4_kv,scd", "--work-dir", str(tmp_path), "--json",
        "--cost-tokens", "256"])}
    err = capsys.readouterr().err
    assert "exact plan: enter at layer" in err and "stage traces" not in err, err
    assert rows["scd"]["kl"] < 0.05 * rows["raw_kv"]["kl"] and rows["scd"]["meets_bound"] is True, rows["scd"]
    assert rows["raw_kv"]["meets_bound"] is False, "raw KV is 1 x itself, outside a bound of 0.2 x"
    assert not any(tmp_path.iterdir()), "an exact plan fits nothing: the work folder stays empty"
    # Table 2's cost column: every method timed beside the consumer's own prefill on one 256-token prefix
    assert all(r["cost_tokens"] == 256 and r["cost_ratio"] > 0 for r in rows.values()), rows
    with pytest.raises(SystemExit, match="longer than .* context"):
        evaluate(["--producer", str(DEMO / "base"), "--consumer", str(folder), "--samples", "1", "--val", "3",
                  "--prefix-tokens", "64", "--methods", "raw_kv", "--work-dir", str(tmp_path),
                  "--cost-tokens", "100000"])


def test_scd_eval_draws_droidspeak_at_each_entry(top_folder, tmp_path, capsys):
    from cli.evaluate import main as evaluate
    folder, first = top_folder
    args = ["--producer", str(DEMO / "base"), "--consumer", str(folder), "--samples", "2", "--val", "3",
            "--prefix-tokens", "64", "--methods", "raw_kv", "--work-dir", str(tmp_path), "--json"]
    rows = {r["method"]: r for r in evaluate(args + ["--droidspeak-entries", f"{first},{first + 1}"])}
    at, above = rows[f"droidspeak@{first}"], rows[f"droidspeak@{first + 1}"]
    # entered where the residual is still the base's, DroidSpeak is the exact plan: the oracle's cache
    assert at["kl"] < 1e-4 and above["kl"] > 100 * max(at["kl"], 1e-7), (at, above)
    assert at["meets_bound"] is True, at                  # 2 of the layers run, within 0.2 x raw KV
    assert above["payload_bytes"] > at["payload_bytes"], "one more layer's K and V below the entry"
    layers = first + 2
    with pytest.raises(SystemExit, match=f"below .*{layers} layers"):
        evaluate(args + ["--droidspeak-entries", str(layers)])
    with pytest.raises(SystemExit, match="integers"):
        evaluate(args + ["--droidspeak-entries", "x"])


def test_scd_eval_measures_bf16_and_klt_with_exact_dtype_auto(top_folder, tmp_path, capsys):
    from cli.evaluate import main as evaluate
    folder, first = top_folder
    rows = {r["method"]: r for r in evaluate([
        "--producer", str(DEMO / "base"), "--consumer", str(folder), "--samples", "2", "--val", "3",
        "--prefix-tokens", "64", "--methods", "raw_kv,exact,exact_klt,scd", "--exact-dtype", "auto",
        "--work-dir", str(tmp_path), "--json"])}
    err = capsys.readouterr().err
    curve = next(line for line in err.splitlines() if line.startswith("exact plans (validation)"))
    assert f"enter@{first} bf16" in curve and f"enter@{first} klt" in curve, curve
    assert "exact plan: enter at layer" in err, err
    assert rows["exact_klt"]["payload_bytes"] < 0.6 * rows["exact"]["payload_bytes"], rows
    assert rows["exact_klt"]["kl"] < 0.2 * rows["raw_kv"]["kl"], (rows["exact_klt"]["kl"], rows["raw_kv"]["kl"])


def test_kivi4_carries_keys_per_channel_and_values_per_group_within_half_a_step():
    """kivi4 on the wire: keys in int4 per channel over 32 tokens, values in int4 per group, the residual in
    bf16; each value decodes within half its group's step, and the payload is what the layout says."""
    from scd.online import codec
    from scd.online.rebuild import encode
    from scd.online.trace import capture
    base = tiny_llama(0, layers=4)
    spec = ModelSpec.from_config(base.config)
    art = exact.artifact("a:b", spec, 2, "kivi4")
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    tr = capture(base, ids, torch.ones_like(ids), want_hidden=True)
    payload = codec.encode(encode(art, tr, ids), "a:b", "v1", codec.artifact_dims(art), "kivi4", compress="none")
    got = codec.decode(payload, "a:b", "v1", art.plan, codec.level_dims(art))
    k, v = tr.keys[1], tr.values[1]                                      # (1, n_kv, 40, 8)
    kg = torch.cat([k, k[..., -1:, :].expand(1, 2, 24, 8)], -2).unflatten(-2, (2, 32))   # tokens padded to 64
    k_step = (kg.amax(-2) - kg.amin(-2)) / 15                            # per channel per 32 tokens
    k_err = (got.layers[1]["k"] - k).abs().unflatten(-2, (-1, 20))
    assert float(k_err.max()) <= 0.5 * float(k_step.max()) * 1.02, (float(k_err.max()), float(k_step.max()))
    v_step = (v.amax(-1) - v.amin(-1)) / 15                              # head_dim 8 < 32: one group per row
    assert bool(((got.layers[1]["v"] - v).abs() <= 0.5 * v_step[..., None] * 1.02 + 1e-3).all())
    assert torch.equal(got.layers[2]["z_e"].reshape(tr.hidden[2].shape), tr.hidden[2].bfloat16())
    body = 5 * 40 + (2 * 8 * 2 * 4 + 2 * 64 * 4) + (2 * 40 * (4 + 4)) + 40 * 32 * 2   # ids+mask, K, V, residual
    assert codec.body_bytes(payload) == body, (codec.body_bytes(payload), body)
    with pytest.raises(ValueError, match="kivi4 carries"):
        codec.field_dtype("z_x", "kivi4")


def test_scd_bench_times_the_exact_plan_beside_the_baselines(top_folder, tmp_path, capsys):
    from cli.bench import main as bench
    folder, first = top_folder
    (r,) = bench(["--producer", str(DEMO / "base"), "--consumer", str(folder), "--tokens", "96", "--repeats", "1",
                  "--bandwidth", "10,100", "--plot-dir", str(tmp_path), "--val", "2", "--prefix-tokens", "48",
                  "--work-dir", str(tmp_path / "work"), "--json"])
    assert r["plan"][first] == "entry" and r["recompute_ms"] > 0, r
    phases = r["bandwidth"]["phases"]
    assert {"oracle", "raw_kv", "int4_kv", "droidspeak", "scd"} == set(phases), sorted(phases)
    assert phases["scd"]["payload_bytes"] < phases["raw_kv"]["payload_bytes"], phases
    assert not (tmp_path / "work").exists(), "an exact plan fits nothing"


def test_one_family_payload_serves_members_entering_at_different_layers_as_their_own_payloads_do(tmp_path):
    """Two consumers that share layers [0, 2) and [0, 4) with the producer, and one that shares every layer (an
    activated LoRA's prefix): the family payload carries the producer's K and V once for every layer some member
    shares and a residual at each member's entry. Each member rebuilds from it exactly the cache its own payload
    gives, the family payload is smaller than the three, and it survives a save and load."""
    import dataclasses
    from scd.online import codec
    from scd.online.family_artifacts import FamilyArtifacts, union_kind
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    base = tiny_llama(0, layers=6)
    spec = ModelSpec.from_config(base.config)
    consumers = {"a:low": _top_adapted(base, 2), "a:high": _top_adapted(base, 4, seed=2), "a:all": base}
    arts = {"a:low": exact.artifact("a:low", spec, 2, "bf16"), "a:high": exact.artifact("a:high", spec, 4, "bf16"),
            "a:all": exact.artifact("a:all", spec, 6, "bf16", whole_prefix=True)}
    fam = FamilyArtifacts("a:fam", {p: dataclasses.replace(a, pair="a:fam") for p, a in arts.items()})
    assert fam.encoder.plan == ["shared", "shared", "shared_entry", "shared", "shared_entry", "shared"], fam.encoder.plan
    assert union_kind(["recompute", "entry"]) == "entry" and union_kind(["recompute", "recompute"]) == "recompute"
    fam.save(tmp_path / "fam")
    fam = FamilyArtifacts.load(tmp_path / "fam")
    ids = torch.randint(2, 97, (1, 19), generator=torch.Generator().manual_seed(5))
    trace = capture(base, ids, torch.ones_like(ids), want_hidden=True)
    one = codec.encode(encode(fam.encoder, trace, ids), "a:fam", "v1", codec.artifact_dims(fam.encoder), "bf16")
    own_bytes = 0
    for pair, consumer in consumers.items():
        own = codec.encode(encode(arts[pair], trace, ids), pair, "v1", codec.artifact_dims(arts[pair]), "bf16")
        own_bytes += len(own)
        want, _ = rebuild(consumer, arts[pair], codec.decode(own, pair, "v1", arts[pair].plan,
                                                             codec.artifact_dims(arts[pair])))
        member = fam.members[pair]
        got, _ = rebuild(consumer, member, codec.decode(one, "a:fam", "v1", member.payload_plan,
                                                        codec.artifact_dims(member)))
        err = max((x - y).abs().max().item() for g, w in zip(got, want) for x, y in zip(g, w))
        assert err == 0.0, f"{pair}: the family payload rebuilt a cache {err:.2e} away from its own payload's"
    assert len(one) < 0.75 * own_bytes, f"family payload {len(one)} bytes against {own_bytes} for the three"


def test_the_family_job_publishes_exact_members_as_one_payload_and_the_engines_serve_it(top_folder, tmp_path,
                                                                                         capsys):
    """Two fine-tunes of the demo base's top two and top three layers, each calibrated to its exact plan:
    `jobs.family` fits nothing, scores each member's held-out KL from the one family payload as its own
    payload's, and publishes; a fan-out to both then gets one payload, and each answers as its oracle."""
    from transformers import AutoModelForCausalLM
    from artifacts_store import ArtifactStore
    from jobs.calibrate import main as calibrate
    from jobs.family import main as family_job
    folder, first = top_folder
    three = tmp_path / "top3"
    base = AutoModelForCausalLM.from_pretrained(DEMO / "base").eval()
    _top_adapted(base, first - 1, scale=0.3, seed=4).save_pretrained(three)
    for f in folder.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, three / f.name)
    cfg = write_config(tmp_path, heldout=2, val=2, gate_vs_raw_kv=1.0)
    doc = yaml.safe_load(cfg.read_text())
    doc["specialists"] += [{"name": "top", "path": str(folder)}, {"name": "top3", "path": str(three)}]
    cfg.write_text(yaml.safe_dump(doc))
    for pair in ("base:top", "base:top3"):
        calibrate(["--pair", pair, "--config", str(cfg), "--no-actors"])
    result = family_job(["--config", str(cfg), "--members", "top,top3", "--name", "share", "--publish",
                         "--repeats", "1", "--out", str(tmp_path / "family")])
    out = capsys.readouterr().out
    assert "stage" not in out and result["published"], out
    assert result["plan"][first - 1:] == ["shared_entry", "entry", "recompute"], result["plan"]
    for row in result["kl"]:
        assert row["family"] == row["served_pair"] < 1e-3, f"{row['member']}: family {row['family']}, own {row['served_pair']}"
    cost = result["fanout"]
    assert cost["family_bytes"] < 0.75 * cost["pairs_bytes"], cost
    store = ArtifactStore(tmp_path / "store")
    fam, manifest = store.load_family("base:share@latest")
    tok = _tokenizer_of(folder)
    producer = ProducerEngine(base, tok, {}, cache_bytes=1 << 20)
    producer.set_family(fam, manifest.version)
    models = {"base:top": AutoModelForCausalLM.from_pretrained(folder).eval(),
              "base:top3": AutoModelForCausalLM.from_pretrained(three).eval()}
    prefix = tok("Notes: Clara Petrov lives in Galen Cross. Tilda Vance lives in Orrin Vale.")["input_ids"]
    res = producer.encode(prefix, list(models))
    assert {e.family for e in res.per_pair.values()} == {"base:share"}
    assert res.per_pair["base:top"].payload is res.per_pair["base:top3"].payload, "one payload for the fan-out"
    params = GenParams(max_tokens=8)
    suffix = tok(" Question: Where does Clara Petrov live? Answer:")["input_ids"]
    for pair, model in models.items():
        served = SpecialistEngine(pair, model, tok)
        served.set_family(fam.members[pair], manifest.version)
        text, info, _ = served.complete(prefix, suffix, res.per_pair[pair].payload, None, params)
        assert info.mode == "scd", info
        assert text == SpecialistEngine(pair, model, tok).complete(prefix, suffix, None, "oracle", params)[0]


def _tokenizer_of(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def test_bench_e_first_times_both_ways_over_an_emulated_link(top_published, tmp_path, capsys):
    """tools.bench_e_first on the demo base and its top-layer fine-tune: both ways served from codes, neither
    faster than its bytes over the link allow, the model's E-first never above its whole."""
    from scd.online.links import transfer_ms
    from tools.bench_e_first import main as bench
    cfg, _, _, _ = top_published
    out = bench(["--config", str(cfg), "--specialist", "top", "--tokens", "64", "--gbps", "0.01,100",
                 "--repeats", "1", "--json", str(tmp_path / "e.json")])
    assert out["entry_bytes"] + out["rest_bytes"] > out["payload_bytes"] > out["rest_bytes"], out
    for row in out["rows"]:
        link = transfer_ms(out["payload_bytes"], row["gbps"])
        assert row["whole_ms"] >= link and row["e_first_ms"] >= transfer_ms(out["rest_bytes"], row["gbps"]), row
        assert row["modeled_e_first_ms"] <= row["modeled_whole_ms"] + 1e-6, row
    assert "E-first" in capsys.readouterr().out and (tmp_path / "e.json").exists()
    with pytest.raises(SystemExit, match="--gbps must be positive"):
        bench(["--config", str(cfg), "--specialist", "top", "--gbps", "0"])
    with pytest.raises(SystemExit, match="no specialist 'nope'"):
        bench(["--config", str(cfg), "--specialist", "nope"])
