"""The calibration pipeline's stages on a tiny random pair: resumed from checkpoints after a kill, redone only
where a changed setting reaches, aligners trained on their own prefixes, ranks chosen by validation KL within the
payload budget as the wire counts bytes, and the stages after the ranks redone when those change."""
import json
import re

import pytest
import torch

from scd.fitting.calibrate import CalibConfig, Calibration, calibrate
from scd.fitting.scoring import PlanScorer, beats
from scd.online.models import ModelSpec
from tests.conftest import fit_settings, perturbed, random_samples, tiny_llama


def test_calibration_resumes_from_its_checkpoints(tmp_path):
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(20, 1)]
    cfg = fit_settings(r_k=2, r_v=3, r_h=16, aligner_epochs=3, pool=2, batch=8)
    logs = []
    first = Calibration(a, b, spec, "a:b", prefixes, tmp_path, cfg, progress=False, log=logs.append)
    first.traces()
    # simulate a kill after the first chunk: drop the done marker and the later chunks
    (first.trace_dir / "traces.json").unlink()
    for p in sorted((first.trace_dir / "traces").glob("chunk_*"))[1:]:
        p.unlink()
    calls = []
    second = Calibration(a, b, spec, "a:b", prefixes, tmp_path, cfg, progress=False, log=logs.append)
    second.traces(capture_pair=lambda ids, mask: calls.append(ids.shape) or second._capture_local(ids, mask))
    assert len(calls) == 2, f"resumed run recomputed {len(calls)} batches, expected the 2 missing ones"
    assert any("1/3 chunks already on disk" in line for line in logs), logs
    art1 = second.run(random_samples(3, 2))
    logs.clear()
    art2 = Calibration(a, b, spec, "a:b", prefixes, tmp_path, cfg, progress=False, log=logs.append).run(random_samples(3, 2))
    assert any("traces: resumed" in line for line in logs) and any("policy: resumed" in line for line in logs), logs
    assert art1.plan == art2.plan
    for k, v in art1.tensors().items():
        assert torch.equal(v, art2.tensors()[k]), k


def test_a_changed_setting_redoes_only_the_stages_that_depend_on_it(tmp_path):
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(16, 1)]
    cfg = fit_settings(r_k=2, r_v=3, r_h=8, aligner_epochs=2, pool=1, batch=8, finetune_samples=8, finetune_epochs=1)
    val, tune = random_samples(3, 2), random_samples(8, 4, t=20, c=8)
    logs = []

    def run(c, v=val, consumer=b):
        logs.clear()
        cal = Calibration(a, consumer, spec, "a:b", prefixes, tmp_path, c, progress=False, log=logs.append)
        cal.run(v, tune_samples=tune)
        return cal, " | ".join(logs)

    first, out = run(cfg)
    trained = re.findall(r"aligner for layer (\d+) trained", out)
    assert trained and not [l for l in trained if f"aligner for layer {l} resumed" in out], out   # loaded again
    # fine-tuning settings: traces, aligners, ranks and policy are reused, fine-tuning is redone
    second, out = run(CalibConfig(**{**cfg.__dict__, "finetune_lr": 3e-4}))
    assert "traces: resumed" in out and "policy: resumed" in out and "finetune: resumed" not in out, out
    assert second.trace_dir == first.trace_dir and second.plan_dir == first.plan_dir and second.dir != first.dir
    # a policy setting: the aligners and traces stay, the policy is redone
    third, out = run(CalibConfig(**{**cfg.__dict__, "patch_cost": 0.5}))
    assert "traces: resumed" in out and "policy: resumed" not in out and "aligner for layer" in out, out
    assert "trained" not in out and third.plan_dir != first.plan_dir, out
    # other validation samples: the policy is recomputed in the same folder
    _, out = run(cfg, v=random_samples(3, 7))
    assert "stage policy: checkpoint was computed for other inputs (val); recomputing" in out, out
    assert "policy: resumed" not in out, out
    # other consumer weights: nothing is reused
    fourth, out = run(cfg, consumer=perturbed(a, 0.4))
    assert fourth.trace_dir != first.trace_dir and "traces: done" in out, out



def test_aligners_train_on_the_first_aligner_prefixes_only(tmp_path, monkeypatch):
    from scd.fitting import aligners
    from scd.fitting import calibrate as calibrate_mod
    from scd.fitting.checkpoints import key_dir
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(2, 97, (int(n),), generator=g) for n in torch.randint(5, 13, (10,), generator=g)]
    seen, chunks_read, reads = [], [], [0]
    train = aligners.train_aligner
    monkeypatch.setattr(aligners, "train_aligner", lambda z, x_b, *args, **kw: seen.append(x_b) or train(z, x_b, *args, **kw))
    read = calibrate_mod.read_chunks

    def counted(directory):
        for c in read(directory):
            reads[0] += 1
            yield c
    monkeypatch.setattr(calibrate_mod, "read_chunks", counted)
    cals = {}
    for n in (0, 3):            # 3 prefixes: rows of a batch of 4 (left-padded) and the next batch's none
        cfg = fit_settings(r_k=2, r_v=3, r_h=8, aligner_epochs=1, batch=4, aligner_prefixes=n)
        cals[n] = Calibration(a, b, spec, "a:b", prefixes, tmp_path, cfg, progress=False, log=lambda s: None)
        cals[n].traces()
        cals[n].linear()            # its Gram pass reads every chunk; count the aligner's reads alone
        before = reads[0]
        cals[n].aligner(1)
        chunks_read.append(reads[0] - before)
    every, first = seen
    assert chunks_read == [3, 1], chunks_read       # 10 prefixes in batches of 4; the cap of 3 reads only the first
    assert every.shape[0] == sum(len(p) for p in prefixes), (every.shape, [len(p) for p in prefixes])
    assert first.shape[0] == sum(len(p) for p in prefixes[:3]), (first.shape, [len(p) for p in prefixes[:3]])
    assert torch.equal(first, every[:first.shape[0]])
    # a cap is keyed (its aligners and plan are its own); no cap keys as before the setting existed
    assert cals[3].trace_dir == cals[0].trace_dir
    assert cals[3].aligner_dir != cals[0].aligner_dir and cals[3].plan_dir != cals[0].plan_dir
    old = {k: v for k, v in cals[0].cfg.model_dump().items() if k in ("r_h", "ridge", "aligner_width", "aligner_epochs",
           "aligner_context", "aligner_window", "aligner_tokens", "aligner_loss", "seed")}
    assert cals[0].aligner_dir == key_dir(cals[0].trace_dir / "aligners", "", old)

def test_padding_id_does_not_matter_and_none_is_accepted(tmp_path):
    """A tokenizer with neither pad nor eos token gives pad_id None: calibration must run, and since padded
    positions are masked, it must fit the very same artifact as with any other padding id."""
    from scd.fitting.calibrate import pad
    ids, mask = pad([torch.tensor([5, 6, 7]), torch.tensor([8])], None)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    g = torch.Generator().manual_seed(4)
    prefixes = [torch.randint(2, 97, (int(n),), generator=g) for n in torch.randint(8, 24, (24,), generator=g)]
    cfg = fit_settings(r_k=2, r_v=3, r_h=8, aligner_epochs=2, pool=1, batch=8, finetune_samples=0)
    arts = [calibrate(a, b, spec, "a:b", prefixes, random_samples(2, 2), tmp_path / str(pad_id), cfg, pad_id=pad_id,
                      progress=False) for pad_id in (None, 41)]
    for name, t in arts[0].tensors().items():
        err = (t - arts[1].tensors()[name]).abs().max().item()
        assert err < 1e-4, f"{name} depends on the padding id: max difference {err:.2e}"


def test_ranks_are_chosen_by_validation_kl_within_the_payload_budget(tmp_path):
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(24, 1)]
    val = random_samples(3, 2)
    for source in ("kv", "hidden"):
        cfg = fit_settings(payload_budget=0.3, reuse_source=source, aligner_epochs=2, pool=1, batch=16)
        said = []
        cal = Calibration(a, b, spec, "a:b", prefixes, tmp_path / source, cfg, progress=False, log=said.append)
        cal.traces()
        rec = cal.ranks(val)
        line = next(s for s in said if "candidates within" in s)       # the choice is said, the best one or not
        assert line.startswith(f"stage ranks: {rec['chosen']} (reuse-only KL "), line
        assert f"; {len(rec['tried'])} candidates within 0.3)" in line, line
        assert rec["tried"] and all(t["payload_ratio"] <= 0.3 + 1e-9 for t in rec["tried"]), rec
        assert [{k: t[k] for k in rec["chosen"]} for t in rec["tried"]] == cal.rank_candidates()
        best = min(rec["tried"], key=lambda t: t["kl"])
        assert rec["best"] == {k: best[k] for k in rec["chosen"]}
        # the chosen code is the cheapest whose KL the best one does not beat beyond the samples' noise
        pick = next(t for t in rec["tried"] if {k: t[k] for k in rec["chosen"]} == rec["chosen"])
        assert not beats(pick["kls"], best["kls"]), (pick, best)
        assert all(beats(t["kls"], best["kls"]) for t in rec["tried"] if t["payload_ratio"] < pick["payload_ratio"])
        # the scores are what a plain scorer gives, and the artifact carries the chosen ranks
        scorer = PlanScorer(a, b, val, lambda plan: cal.artifacts_for(plan, **rec["chosen"]))
        assert abs(scorer.kl(cal.base_plan) - pick["kl"]) < 1e-9
        art = cal.artifacts_for(cal.base_plan)
        got = {"r_x": art.r_x} if source == "hidden" else {"r_k": art.r_k, "r_v": art.r_v}
        assert got == rec["chosen"], (got, rec["chosen"])
        assert art.plan[1:] == [("hidden" if source == "hidden" else "reuse")] * 2
        again = Calibration(a, b, spec, "a:b", prefixes, tmp_path / source, cfg, progress=False, log=lambda s: None)
        assert again.ranks(val) == rec                                                      # resumed
    with pytest.raises(ValueError, match="payload_budget"):
        CalibConfig(payload_budget=1.5)
    with pytest.raises(ValueError, match="reuse_source"):
        CalibConfig(reuse_source="magic")


def test_the_rank_stage_counts_the_bytes_the_wire_sends(tmp_path):
    """Quantised codes travel compressed (codec's zstd stage): the rank stage measures how much on its
    validation codes, and the budget buys the rank those bytes leave room for."""
    from scd.online import codec
    from scd.online.rebuild import encode
    from scd.online.trace import capture
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    prefixes, val = [s.prefix for s in random_samples(24, 1, t=120)], random_samples(3, 2, t=120)
    cfg = fit_settings(payload_budget=0.14, reuse_source="hidden", code_dtype="int4", batch=16)
    cal = Calibration(a, b, spec, "a:b", prefixes, tmp_path, cfg, progress=False, log=lambda s: None)
    cal.traces()
    in_code_bytes = max(c["r_x"] for c in cal.rank_candidates())
    rec = cal.ranks(val)
    assert 0.5 < rec["wire_factor"] < 1, rec
    widest = max(t["r_x"] for t in rec["tried"])
    assert widest > in_code_bytes, (rec["tried"], in_code_bytes)
    assert all(t["payload_ratio"] <= 0.14 + 1e-9 for t in rec["tried"]), rec["tried"]
    # the codes the codec sends for the validation prefixes at the widest rank tried fit the budget (token
    # ids zeroed: the budget counts codes), and they compress about as the rank the factor was measured at
    art = cal.artifacts_for(cal.base_plan, r_x=widest)
    sent = plain = 0
    for s in val:
        codes = encode(art, capture(a, s.prefix[None], torch.ones(1, 120, dtype=torch.long)), s.prefix[None])
        codes.token_ids = torch.zeros_like(codes.token_ids)        # (not in place: it is the sample's prefix)
        sent += codec.body_bytes(codec.encode(codes, "a:b", "v", codec.artifact_dims(art), "int4"))
        plain += codec.body_bytes(codec.encode(codes, "a:b", "v", codec.artifact_dims(art), "int4", compress="none"))
    raw = len(val) * 120 * spec.kv_bytes_per_token
    assert sent / raw <= 0.14, f"codes as sent at r_x {art.r_x}: {sent / raw:.4f} of the raw KV, over the budget of 0.14"
    at_chosen = sent / (plain - 5 * 120 * len(val))
    assert abs(at_chosen - rec["wire_factor"]) < 0.05, (at_chosen, rec["wire_factor"])
    again = Calibration(a, b, spec, "a:b", prefixes, tmp_path, cfg, progress=False, log=lambda s: None)
    assert again.ranks(val) == rec and again.payload_ratio(rec["chosen"]) == cal.payload_ratio(rec["chosen"])


def test_stages_after_the_ranks_are_redone_when_the_ranks_stage_chooses_otherwise(tmp_path):
    """The ranks stage may choose another rank in the same folder (its wire accounting changed): the layer
    policy, fitted for the old code, is recomputed and says why."""
    a = tiny_llama(0)
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    prefixes, val = [s.prefix for s in random_samples(16, 1)], random_samples(2, 2)
    cfg = fit_settings(payload_budget=0.3, reuse_source="hidden", aligner_epochs=1, pool=1, batch=16)
    lines = []

    def run():
        cal = Calibration(a, b, spec, "a:b", prefixes, tmp_path, cfg, progress=False, log=lines.append)
        cal.traces()
        return cal.ranks(val), cal.policy(val)

    ranks, _ = run()
    run()
    assert "stage policy: resumed from checkpoint" in lines, lines
    path = next(tmp_path.rglob("ranks.json"))
    record = json.loads(path.read_text())
    other = ranks["chosen"]["r_x"] // 2
    record["chosen"] = {"r_x": other}
    path.write_text(json.dumps(record))
    lines.clear()
    run()
    assert "stage policy: checkpoint was computed for other inputs (ranks); recomputing" in lines, lines
