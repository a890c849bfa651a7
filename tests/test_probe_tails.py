"""The tails probe (tools.probe_tails): a block plan's codes alone decode its block's layers from their codes, and
its rows put each plan's KL beside raw KV's and DroidSpeak's at the same counted compute."""
import pytest
import torch

from scd.evaluation.evaluate import Evaluator
from scd.fitting import blocks
from scd.fitting.calibrate import Calibration
from scd.online.models import ModelSpec
from scd.online.rebuild import encode, rebuild
from scd.online.trace import capture
from tests.conftest import fit_settings, perturbed, random_samples, tiny_llama
from tools.probe_tails import codes_alone, curve_rows


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    a = tiny_llama(0, layers=4)
    b = perturbed(a, 0.3, seed=1)
    cfg = fit_settings(reuse_source="hidden", r_x=6, r_h=8, aligner_epochs=2, batch=16)
    cal = Calibration(a, b, ModelSpec.from_config(a.config), "a:b", [s.prefix for s in random_samples(16, 1)],
                      tmp_path_factory.mktemp("cal"), cfg, progress=False, log=lambda s: None)
    cal.traces()
    return a, b, cal.artifacts_for(["exact", "hidden", "hidden", "hidden"])


def test_the_codes_alone_of_a_block_plan_rebuild_as_the_codes_did(pair):
    a, b, art = pair
    block = blocks.block_artifact(art, 2, None).with_tail(3)
    alone = codes_alone(block)
    assert alone.plan == art.plan and alone.tail_tokens == 0 and not alone.blocks
    ids = random_samples(1, 4)[0].prefix[None]
    tr = capture(a, ids, torch.ones_like(ids))
    (got, _), (want, _) = (rebuild(b, x, encode(x, tr, ids)) for x in (alone, art))
    err = max((g - w).abs().max().item() for gk, wk in zip(got, want) for g, w in zip(gk, wk))
    assert err == 0, f"the block plan's codes alone differ from the codes' rebuild by {err:.2e}"


def test_rows_compare_each_plan_with_raw_kv_and_droidspeak_at_its_counted_compute(pair):
    a, b, art = pair
    held = random_samples(3, 9, t=20)
    rows = {r["method"]: r for r in curve_rows(Evaluator(a, b), held, art, [0, 5], [2], repeats=1, heads=(20,))}
    assert set(rows) == {"raw_kv", "droidspeak@2", "codes", "codes+tail5", "codes+head20", "codes+tail5+head20"}
    # the consumer's own first 20 of 20 tokens is its own cache: the oracle's KL (float noise), at a whole prefill
    assert rows["codes+head20"]["kl"] < 1e-6 and rows["codes+head20"]["consumer_ratio"] == 1, rows["codes+head20"]
    assert rows["raw_kv"]["over_raw"] == 1 and rows["raw_kv"]["consumer_ratio"] == 0
    assert all(r["timed"] > 0 for r in rows.values()), rows
    assert rows["droidspeak@2"]["consumer_ratio"] == 0.5 and rows["codes+tail5"]["consumer_ratio"] == 5 / 20
    # DroidSpeak at a quarter of a prefill: halfway between raw KV (0) and its entry at 2 (half a prefill)
    ds = (rows["raw_kv"]["kl"] + rows["droidspeak@2"]["kl"]) / 2
    got = rows["codes+tail5"]["over_droidspeak"]
    assert abs(got - rows["codes+tail5"]["kl"] / ds) < 1e-9, f"over DroidSpeak {got} against {rows['codes+tail5']['kl'] / ds}"
    assert rows["codes"]["over_droidspeak"] == pytest.approx(rows["codes"]["over_raw"])   # at 0 DroidSpeak is raw KV
    assert rows["codes+tail5"]["kl"] < rows["codes"]["kl"], \
        f"the consumer's own last 5 tokens did not lower the codes' KL: {rows['codes+tail5']['kl']:.4f} " \
        f"against {rows['codes']['kl']:.4f}"
