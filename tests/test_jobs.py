"""The jobs and the CLI: training on a reduced budget, and eval/bench on the committed demo family."""
import json

import pytest

from cli.main import main as scd
from scd.online.models import load, load_pair
from tests.conftest import DEMO


def test_train_family_on_a_tiny_budget_produces_a_loadable_compatible_family(tmp_path):
    from jobs.train_family import SPECIALISTS, main
    report = main(["--out", str(tmp_path), "--base-steps", "3", "--specialist-steps", "2", "--tiny"])
    assert set(report["final_loss"]) == {"base", *SPECIALISTS}
    for name in SPECIALISTS:
        _, _, tok, spec = load_pair(tmp_path / "base", tmp_path / name)
        assert spec.num_layers == 2 and spec.num_kv_heads < spec.num_heads      # GQA
    assert json.loads((tmp_path / "family.json").read_text())["params"] == report["params"]


def test_committed_demo_family_is_small_and_loads():
    files = [p for name in ("base", "qa", "prose", "code") for p in (DEMO / name).rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert total <= 25 * 2**20, f"demo family is {total / 2**20:.1f} MiB (limit 25)"
    for name in ("base", "qa", "prose", "code"):
        model, tok, spec = load(DEMO / name)
        assert spec.model_type == "llama" and tok.decode(tok("def f(x):")["input_ids"]) == "def f(x):"


def test_eval_json_on_the_demo_family(tmp_path, capsys):
    scd(["eval", "--pair", "base:qa", "--json", "--samples", "3", "--calib", "24", "--val", "3",
         "--aligner-epochs", "3", "--pool", "2", "--finetune-samples", "8", "--finetune-epochs", "1",
         "--work-dir", str(tmp_path)])
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["oracle", "raw_kv", "int4_kv", "droidspeak", "reuse_only", "scd"]
    need = {"method", "payload_bytes", "payload_ratio", "kl", "tv", "top1", "greedy", "f1", "consumer_ms",
            "prefill_ratio"}
    for r in rows:
        assert need <= set(r), need - set(r)
    by = {r["method"]: r for r in rows}
    assert by["oracle"]["kl"] < 1e-9 and by["raw_kv"]["payload_ratio"] == 1.0
    assert by["scd"]["payload_ratio"] < 0.3, by["scd"]
    # properties of the committed family: the QA specialist answers, raw producer KV breaks it
    assert by["oracle"]["f1"] == 1.0 and by["raw_kv"]["f1"] < 0.7 * by["oracle"]["f1"], by


def test_bench_prints_side_by_side_ratio(tmp_path, capsys):
    scd(["bench", "--pair", "base:qa", "--tokens", "128,256", "--repeats", "2", "--calib", "16", "--val", "2",
         "--aligner-epochs", "2", "--pool", "1", "--finetune-samples", "8", "--finetune-epochs", "1",
         "--work-dir", str(tmp_path), "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tokens"] for r in rows] == [128, 256], rows
    for r in rows:
        assert r["prefill_ms"] > 0 and r["ratio"] == pytest.approx(r["consumer_ms"] / r["prefill_ms"])
    assert rows[1]["payload_bytes"] > rows[0]["payload_bytes"]


@pytest.mark.parametrize("argv,msg", [
    (["eval", "--pair", "base"], "PRODUCER:CONSUMER"),
    (["eval", "--pair", "base:nope"], "no model 'nope'"),
    (["eval", "--pair", "../..:qa"], "no model '../..'"),
    (["eval", "--pair", "base:qa", "--methods", "magic"], "unknown method"),
    (["bench", "--pair", "base:qa", "--tokens", "1024,x"], "integers separated by commas"),
])
def test_cli_rejects_bad_input_with_a_message(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        scd(argv)
