"""End-to-end fine-tuning of a pair's aligners and hidden-state decoders (scd/fitting/finetune.py): it never
worsens validation KL, resumes, belongs to its plan, and keeps an epoch only if its gain stands out of the
validation noise."""
import pytest

from scd.fitting.calibrate import Calibration
from scd.fitting.scoring import PlanScorer
from scd.online.models import ModelSpec
from tests.conftest import fit_settings, perturbed, random_samples, tiny_llama


@pytest.mark.parametrize("source, encoders, x_group, token_table, bigram_table", [
    ("kv", False, 1, 0, 0), ("hidden", False, 1, 0, 0), ("hidden", True, 1, 0, 0), ("hidden", False, 0, 0, 0),
    ("hidden", True, 0, 0, 0), ("hidden", False, 0, 24, 0), ("hidden", False, 0, 24, 64)])
def test_end_to_end_finetune_never_worsens_validation_kl_and_resumes(tmp_path, monkeypatch, source, encoders, x_group,
                                                                     token_table, bigram_table):
    """x_group 0: one hidden-state code for layers 1 and 2 (a cross-layer code), trained as one codec; with a
    token table (and a bigram table), the tables are trained with the decoders. Any validation gain counts
    here (KEEP_Z 0): 4 validation samples cannot tell the tiny pair's gains from noise, and what is checked is
    that the kept weights are trained, saved and resumed (the noise rule has its own tests below)."""
    monkeypatch.setattr("scd.fitting.scoring.KEEP_Z", 0.0)
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(24, 1)]
    cfg = fit_settings(r_k=2, r_v=3, r_h=8, r_x=2, reuse_source=source, aligner_epochs=3,
                      pool=1 if source == "hidden" else 2, batch=8, finetune_samples=16, finetune_epochs=3,
                      finetune_lr=3e-3, finetune_encoders=encoders, code_dtype="int8" if encoders else "fp16",
                      x_group=x_group, token_table=token_table, bigram_table=bigram_table,
                      choose_level=False)           # the artifact as fine-tuned (the level stage: test_levels)
    tune, val = random_samples(16, 4, t=20, c=8), random_samples(4, 2)
    logs = []
    cal = Calibration(a, b, spec, "a:b", prefixes, tmp_path, cfg, progress=False, log=logs.append)
    art = cal.run(val, tune_samples=tune)
    rec = art.info["finetune"]
    assert (art.patch_layers or source == "hidden") and len(rec["val"]) == 4 and len(rec["train"]) == 3, rec
    # the kept epoch is the best of those whose gain stood out of the validation noise (else the closed form)
    kept = [0] + [e + 1 for e, ok in enumerate(rec["gain_kept"]) if ok]
    assert rec["best_epoch"] == min(kept, key=lambda e: rec["val"][e]) and rec["val"][rec["best_epoch"]] <= rec["val"][0], rec
    assert rec["train"][-1] < rec["train"][0], f"training KL did not fall: {rec['train']}"
    # the returned artifacts rebuild with the fine-tuned aligners (nothing stale), as scored
    scorer = PlanScorer(a, b, val, lambda plan: art.with_plan(plan))
    got, want = scorer.kl(art.plan), rec["val"][rec["best_epoch"]]
    assert abs(got - want) < 1e-5, f"artifact scores {got:.6f}, fine-tuning recorded {want:.6f}"
    logs.clear()
    again = Calibration(a, b, spec, "a:b", prefixes, tmp_path, cfg, progress=False, log=logs.append).run(
        val, tune_samples=tune)
    assert any("finetune: resumed" in line for line in logs), logs
    assert abs(PlanScorer(a, b, val, lambda plan: again.with_plan(plan)).kl(again.plan) - got) < 1e-6
    if source == "hidden":                                # the decoders moved, the calibration's own did not
        assert "hidden" in art.plan and rec["best_epoch"] > 0, (art.plan, rec)
        assert art.x_groups == ([] if x_group == 1 else [[1, 2]]) and sorted(art.reuse_x) == (
            [1, 2] if x_group == 1 else [1]), (art.x_groups, sorted(art.reuse_x))
        fitted = cal.hidden()
        moved = max((art.reuse_x[l].dec - fitted[l].dec).abs().max().item() for l in art.reuse_x)
        assert moved > 0 and not any(c.dec.requires_grad or c.enc.requires_grad for c in art.reuse_x.values())
        enc_moved = max((art.reuse_x[l].enc - fitted[l].enc).abs().max().item() for l in art.reuse_x)
        assert (enc_moved > 0) == encoders, f"encoders moved by {enc_moved:.2e} with finetune_encoders={encoders}"
        tables = [(art.reuse_x[l].table, fitted[l].table) for l in art.reuse_x]
        assert all((t is None) == (not token_table) and (f is None) == (not token_table) for t, f in tables)
        if token_table:
            assert len(fitted[1].table_ids) == token_table and max((t - f).abs().max().item() for t, f in tables) > 0
        pairs = [(art.reuse_x[l].bigram, fitted[l].bigram) for l in art.reuse_x]
        assert all((t is None) == (not bigram_table) and (f is None) == (not bigram_table) for t, f in pairs)
        if bigram_table:
            assert len(fitted[1].bigram_ids) == bigram_table and max((t - f).abs().max().item() for t, f in pairs) > 0


def test_a_finetune_checkpoint_of_another_plan_is_not_resumed(tmp_path):
    """Fine-tuned aligners and decoders belong to the plan they were tuned under: a checkpoint whose plan
    differs from the one chosen now (e.g. a policy recomputed under a payload budget) is recomputed."""
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    cfg = fit_settings(r_x=2, r_h=8, reuse_source="hidden", aligner_epochs=2, pool=1, batch=8, finetune_samples=8,
                      finetune_epochs=1)
    tune, val = random_samples(8, 4, t=20, c=8), random_samples(3, 2)
    logs = []
    cal = Calibration(a, b, spec, "a:b", [s.prefix for s in random_samples(16, 1)], tmp_path, cfg, progress=False,
                      log=logs.append)
    cal.traces()
    art = cal.artifacts_for(cal.base_plan)
    cal.finetune(art, tune, val)
    other = cal.artifacts_for(cal.plan_with([1]))
    logs.clear()
    cal.finetune(other, tune, val)
    assert any("fine-tuned for another plan" in line for line in logs), logs
    logs.clear()
    cal.finetune(cal.artifacts_for(cal.plan_with([1])), tune, val)
    assert any("finetune: resumed" in line for line in logs), logs


def test_a_validation_gain_within_the_noise_keeps_the_closed_form_fit():
    """beats: a gain counts only beyond 2 standard errors of the per-sample differences."""
    from scd.fitting.scoring import beats
    before = [1.0, 1.0, 1.0, 1.0]
    assert beats(before, [0.90, 0.91, 0.89, 0.90])                     # small, but every sample gains
    assert not beats(before, [0.50, 1.40, 0.60, 1.30])                 # a larger mean gain, half the samples worse
    assert not beats(before, before) and not beats(before, [1.1] * 4)
    assert beats([1.0], [0.99]) and not beats([1.0], [1.0])            # one sample: no spread to test against
    with pytest.raises(ValueError):
        beats(before, [0.9])


def test_the_cheapest_code_the_best_one_does_not_beat_beyond_the_noise_is_chosen():
    """cheapest_within_noise (the ranks stage's rule): more bytes must buy a gain the samples can tell."""
    from scd.fitting.scoring import cheapest_within_noise
    small = {"r_x": 8, "payload_ratio": 0.10, "kls": [1.0, 1.0, 1.0, 1.0]}
    noisy = {"r_x": 16, "payload_ratio": 0.12, "kls": [0.50, 1.40, 0.60, 1.30]}   # lowest mean, half the samples worse
    clear = {"r_x": 24, "payload_ratio": 0.14, "kls": [0.90, 0.91, 0.89, 0.90]}   # every sample gains
    assert cheapest_within_noise([small, noisy]) is small
    assert cheapest_within_noise([small, clear]) is clear
    assert cheapest_within_noise([clear, small, noisy]) is noisy    # the best, clear, beats small but not noisy
    assert cheapest_within_noise([noisy]) is noisy


def test_finetuning_keeps_the_best_epoch_whose_gain_stands_out(tmp_path):
    """Scripted per-sample validation KLs: epoch 1 has the lowest mean but a noisy gain, epoch 2 a smaller
    consistent one, epoch 3 a larger mean than epoch 2. Epoch 2's weights are the ones kept."""
    from scd.fitting.finetune import finetune_aligners
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    cfg = fit_settings(r_x=2, reuse_source="hidden", pool=1, batch=8)
    cal = Calibration(a, b, spec, "a:b", [s.prefix for s in random_samples(16, 1)], tmp_path, cfg, progress=False,
                      log=lambda s: None)
    cal.traces()
    art = cal.artifacts_for(cal.base_plan)
    script = iter([[1.0, 1.0, 1.0, 1.0], [0.3, 1.5, 0.3, 1.4], [0.90, 0.91, 0.89, 0.90], [0.93, 0.92, 0.94, 0.93]])
    decoders = []

    def val_kl(candidate):
        decoders.append({l: c.dec.detach().clone() for l, c in candidate.reuse_x.items()})
        return next(script)

    fit = finetune_aligners(a, b, art, random_samples(8, 4, t=20, c=8), val_kl, epochs=3, lr=3e-3, batch=8)
    assert fit.gain_kept == [False, True, True] and fit.best_epoch == 2, fit
    assert fit.val == pytest.approx([1.0, 0.875, 0.9, 0.93]), fit.val
    moved = {e: max((art.reuse_x[l].dec - d).abs().max().item() for l, d in decoders[e].items()) for e in range(4)}
    assert moved[2] == 0 and min(moved[0], moved[1], moved[3]) > 0, f"kept decoders differ from each epoch's by {moved}"


def test_a_fine_tuning_record_with_another_keep_rule_is_recomputed_and_says_which_input_changed(tmp_path):
    from scd.fitting.checkpoints import load_record, save_record
    path = tmp_path / "finetuned" / "record.json"
    path.parent.mkdir()
    save_record(path, {"best_epoch": 2}, {"tune": "t", "val": "v", "keep": "paired gain > 0 standard errors"})
    lines = []
    assert load_record(path, {"tune": "t", "val": "v", "keep": "paired gain > 0 standard errors"}, lines.append) == \
        {"best_epoch": 2}
    assert load_record(path, {"tune": "t", "val": "v", "keep": "paired gain > 2 standard errors"}, lines.append) is None
    assert lines == ["stage finetuned: checkpoint was computed for other inputs (keep); recomputing"], lines


def test_a_fine_tuning_killed_after_an_epoch_goes_on_from_it_and_ends_where_an_unbroken_run_does(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setattr("scd.fitting.scoring.KEEP_Z", 0.0)
    a = tiny_llama(0)
    b = perturbed(a, 0.5)
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(24, 1)]
    cfg = fit_settings(r_k=2, r_v=3, r_h=8, r_x=2, reuse_source="hidden", aligner_epochs=3, pool=1, batch=8,
                      finetune_samples=16, finetune_epochs=3, finetune_lr=3e-3)
    tune, val = random_samples(16, 4, t=20, c=8), random_samples(4, 2)

    def run(folder, log=lambda s: None):
        return Calibration(a, b, spec, "a:b", prefixes, tmp_path / folder, cfg, progress=False, log=log).run(
            val, tune_samples=tune)

    unbroken = run("unbroken")
    from scd.fitting import finetune
    tune_fn, calls = finetune.finetune_aligners, []

    def killed_in_epoch_2(producer, consumer, art, samples, val_kl, *args, **kw):
        def scored(candidate):
            calls.append(1)
            if len(calls) == 3:         # the start, epoch 1, then epoch 2's score: killed before it is kept
                raise KeyboardInterrupt
            return val_kl(candidate)
        return tune_fn(producer, consumer, art, samples, scored, *args, **kw)
    monkeypatch.setattr(finetune, "finetune_aligners", killed_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        run("broken")
    monkeypatch.setattr(finetune, "finetune_aligners", tune_fn)
    assert list((tmp_path / "broken").rglob("progress.safetensors")), "no epoch kept"
    logs = []
    resumed = run("broken", logs.append)
    assert any("finetune: resumed after epoch 1 of 3" in line for line in logs), logs
    want, got = unbroken.info["finetune"], resumed.info["finetune"]
    assert got["best_epoch"] == want["best_epoch"] > 0 and len(got["val"]) == 4, (got, want)   # a trained epoch kept
    err = max(abs(x - y) for x, y in zip(got["val"] + got["train"], want["val"] + want["train"]))
    assert err < 1e-6, f"resumed run's KLs differ from the unbroken run's by {err:.2e}: {got} vs {want}"
    moved = max((resumed.reuse_x[l].dec - unbroken.reuse_x[l].dec).abs().max().item() for l in unbroken.reuse_x)
    assert moved < 1e-6, f"resumed decoders differ from the unbroken run's by {moved:.2e}"
    assert not list((tmp_path / "broken").rglob("progress.safetensors")), "progress left behind after the record"
