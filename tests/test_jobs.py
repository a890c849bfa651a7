"""The jobs and the CLI: training on a reduced budget, and eval/bench on the committed demo family."""
import json
from pathlib import Path

import pytest

from cli.main import main as scd
from scd.online.models import load, load_pair
from tests.conftest import DEMO, TINY_FIT_FLAGS


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


def test_a_specialist_named_domain_underscore_variant_uses_its_domains_data():
    """`code_few` (the code fine-tune confined to a few layers) is calibrated and evaluated on the code data."""
    from scd.data import samples
    _, tok, _ = load(DEMO / "base")
    assert [samples.domain(n) for n in ("qa", "code", "code_few", "prose")] == ["qa", "code", "code", "prose"]
    few, code = (samples.pair_data(n, tok, 2, 1, 1, 32) for n in ("code_few", "code"))
    assert [s.tolist() for s in few[0]] == [s.tolist() for s in code[0]]
    assert few[2][0].prefix.tolist() == code[2][0].prefix.tolist()
    assert few[0][0].tolist() != samples.pair_data("prose", tok, 2, 1, 1, 32)[0][0].tolist()



@pytest.mark.parametrize("domain", ["prose", "code", "text"])
def test_validation_windows_come_from_documents_apart_from_the_fitted_ones(domain, tmp_path):
    """Validation picks ranks, Patch layers and the fine-tuning epoch: its windows are cut from documents
    (for a --text file, paragraphs) that no calibration prefix or fine-tuning sample comes from."""
    from scd.data import samples
    _, tok, _ = load(DEMO / "base")
    text = None
    if domain == "text":
        text = tmp_path / "t.txt"
        text.write_text("\n\n".join(f"Paragraph {i} says " + f"word{i} " * 60 for i in range(40)))
        text, domain = str(text), "prose"
    train, val, held = (samples.domain_texts(domain, s, text) for s in ("train", "val", "heldout"))
    pieces = lambda texts: {p for t in texts for p in t.split("\n\n")} if text else set(texts)  # noqa: E731
    assert val and train and not pieces(val) & pieces(train) and not pieces(val) & pieces(held)
    calib, vals, _ = samples.pair_data("prose" if domain == "prose" else "code", tok, 6, 4, 1, 32, text_file=text)
    tune = samples.tune_samples("prose" if domain == "prose" else "code", tok, 6, 32, 8, text_file=text)
    in_any = lambda ids, texts: any(tok.decode(ids) in t for t in texts)  # noqa: E731
    assert all(in_any(s.prefix.tolist() + s.cont.tolist(), val) for s in vals)
    assert all(in_any(p.tolist(), train) for p in calib) and all(in_any(s.prefix.tolist(), train) for s in tune)

def test_eval_json_on_the_demo_family(tmp_path, capsys):
    scd(["eval", "--pair", "base:qa", "--json", "--samples", "3", "--calib", "24", "--val", "3",
         "--aligner-epochs", "3", "--pool", "2", "--finetune-samples", "8", "--finetune-epochs", "1",
         "--no-recompute-blocks", "--work-dir", str(tmp_path)])
    rows = json.loads(capsys.readouterr().out)
    # every method by default; the exact ones only for a pair that shares layers (the demo's qa shares none)
    assert [r["method"] for r in rows] == ["oracle", "base", "raw_kv", "int4_kv", "droidspeak", "reuse_only", "scd"]
    need = {"method", "payload_bytes", "payload_ratio", "kl", "tv", "top1", "greedy", "f1", "consumer_ms",
            "prefill_ratio"}
    for r in rows:
        assert need <= set(r), need - set(r)
    by = {r["method"]: r for r in rows}
    assert by["oracle"]["kl"] < 1e-9 and by["raw_kv"]["payload_ratio"] == 1.0
    assert by["scd"]["payload_ratio"] < 0.3, by["scd"]
    # properties of the committed family: the QA specialist answers, raw producer KV breaks it
    assert by["oracle"]["f1"] == 1.0 and by["raw_kv"]["f1"] < 0.7 * by["oracle"]["f1"], by
    assert by["oracle"]["retained_gain"] == 1.0 and by["base"]["retained_gain"] == 0.0, by
    assert by["base"]["f1"] < by["oracle"]["f1"], by                # the base model alone is no QA specialist


def test_eval_chooses_a_plan_as_the_job_does_and_exits_3_when_none_meets_the_bound(tmp_path, capsys):
    """A pair scd eval calibrates gets the job's plan stages (codes, then entries, tails and selective shares
    within the ceiling, on the validation prefixes); a bound nothing meets ends it with status 3 and one line."""
    budget = ["--calib", "16", "--val", "2", "--aligner-epochs", "2", "--pool", "1", "--finetune-samples", "8",
              "--finetune-epochs", "1", "--prefix-tokens", "96", "--samples", "2", "--methods", "raw_kv,scd",
              "--work-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as out:
        scd(["eval", "--pair", "base:prose", "--max-kl-ratio", "0.0001", "--max-consumer-prefill-ratio", "0.3",
             "--report", str(tmp_path / "report")] + budget)
    err = capsys.readouterr().err
    assert out.value.code == 3, err
    # the report is written all the same: the curve a user reads to see what the bound asked
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "| plan kind | <= 0.1 | <= 0.2 | <= 0.35 | <= 0.5 |" in summary and "| scd |" in summary, summary
    assert "Chosen: none within the bound" in summary, summary
    assert (tmp_path / "report" / "compute.png").read_bytes()[:4] == b"\x89PNG", "no plan curve drawn"
    curve = next(line for line in err.splitlines() if "plans (validation)" in line)
    assert "codes KL" in curve and "codes+sel5 KL" in curve and "enter@7 KL" in curve, curve
    assert "codes+lsel5 KL" in curve, curve                            # the learned rule's shares too
    assert "selector: fitted on 16 samples of 96-2048 tokens" in err, err  # 8 fine-tuning, 8 at the serving length
    assert "codes+sel19" not in curve, "a share beyond the ceiling is not measured"
    line = err.strip().splitlines()[-1]
    assert line.startswith("no plan of base:prose meets the quality bound (KL <= 0.0001 x raw KV's, consumer "
                           "<= 0.3 of a prefill; the KL by 1 standard error of the samples)"), line
    # a bound the codes meet on the validation prefixes: they are the plan, and the command ends normally (the
    # checkpoints of the run above resumed)
    from cli.evaluate import main as evaluate
    rows = {r["method"]: r for r in evaluate(["--pair", "base:prose", "--max-kl-ratio", "0.99", "--bound-noise-z", "0",
                                              "--json"] + budget)}     # by the mean alone: 2 validation samples
    err = capsys.readouterr().err
    assert "codes alone (within the quality bound)" in err and "stage traces: resumed" in err, err
    assert rows["scd"]["payload_ratio"] < 1, rows


def test_eval_refuses_a_report_folder_it_cannot_make_before_any_work(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(SystemExit) as out:
        scd(["eval", "--pair", "base:qa", "--report", str(tmp_path / "taken" / "report")])
    err = capsys.readouterr().err
    assert out.value.code == 2 and "--report" in err and "cannot make that folder" in err, err
    assert "Traceback" not in err


def test_eval_measures_selective_recompute_as_a_method_and_refuses_a_bad_rule(tmp_path, capsys):
    scd(["eval", "--pair", "base:qa", "--json", "--samples", "2", "--val", "2", "--methods", "oracle,raw_kv",
         "--selective", "structural@1,deviation@0.25,suffix@1", "--work-dir", str(tmp_path)])
    by = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(by) == {"oracle", "raw_kv", "raw_kv+structural@1", "raw_kv+deviation@0.25", "raw_kv+suffix@1"}, by
    assert by["raw_kv+structural@1"]["kl"] < 1e-6, "every position recomputed is the consumer's own prefill"
    assert by["raw_kv+suffix@1"]["kl"] < 1e-6, "every position, by the question's reads too"
    assert by["raw_kv+deviation@0.25"]["kl"] < by["raw_kv"]["kl"], by
    with pytest.raises(SystemExit, match="reads the question after each prefix: base:prose's samples are text"):
        scd(["eval", "--pair", "base:prose", "--methods", "raw_kv", "--selective", "suffix@0.2", "--work-dir",
             str(tmp_path)])
    with pytest.raises(SystemExit, match="--selective"):
        scd(["eval", "--pair", "base:qa", "--selective", "tail@0.1", "--work-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="learned@F repairs the scd row by its artifact's selector: there is no"):
        scd(["eval", "--pair", "base:qa", "--methods", "raw_kv", "--selective", "learned@0.2", "--work-dir",
             str(tmp_path)])


@pytest.fixture(scope="module")
def bench_work_dir(tmp_path_factory) -> str:
    """One calibration for the bench tests, which ask for the same budget and fit settings (TINY_FIT): the second
    resumes the first's."""
    return str(tmp_path_factory.mktemp("bench-work"))


def test_bench_prints_side_by_side_ratio(bench_work_dir, capsys):
    import torch
    threads = torch.get_num_threads()
    try:                                # --threads 1: as a replica of num_cpus 1 runs
        scd(["bench", "--pair", "base:qa", "--tokens", "128,256", "--repeats", "2", "--calib", "16", "--val", "2",
             "--aligner-epochs", "2", "--pool", "1", "--finetune-samples", "8", "--finetune-epochs", "1",
             "--selector-samples", "0", "--work-dir", bench_work_dir, "--threads", "1", "--json", *TINY_FIT_FLAGS])
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tokens"] for r in rows] == [128, 256] and {r["threads"] for r in rows} == {1}, rows
    for r in rows:
        assert r["prefill_ms"] > 0 and r["ratio"] == pytest.approx(r["consumer_ms"] / r["prefill_ms"])
    assert rows[1]["payload_bytes"] > rows[0]["payload_bytes"]


def test_bench_fanout_and_bandwidth_views_of_one_measurement(bench_work_dir, tmp_path, capsys):
    scd(["bench", "--pair", "base:qa", "--tokens", "128", "--repeats", "1", "--calib", "16", "--val", "2",
         "--aligner-epochs", "2", "--pool", "1", "--finetune-samples", "8", "--finetune-epochs", "1",
         "--selector-samples", "0", "--work-dir", bench_work_dir, "--fanout", "1,4", "--bandwidth", "10,400",
         "--plot-dir", str(tmp_path / "plots"), "--ttft-target", "1e9", "--kl-samples", "2", "--json",
         "--no-choose-level", *TINY_FIT_FLAGS])   # per-head codes at their fitted ranks: the levels below are known
    (r,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [f["n"] for f in r["fanout"]] == [1, 4] and r["fanout"][1]["ratio"] < r["fanout"][0]["ratio"], r["fanout"]
    bw = r["bandwidth"]
    assert list(bw["ttft_ms"]) == ["oracle", "raw_kv", "int4_kv", "droidspeak", "reuse_only", "scd",
                                   "scd@r_k=2,r_v=3", "scd@r_k=4,r_v=6", "scd@r_k=6,r_v=9"]
    # a target no link misses: the full code everywhere, with its KL
    assert [x["method"] for x in r["links"]] == ["scd", "scd"] and all(x["kl"] >= 0 for x in r["links"]), r["links"]
    assert bw["ttft_ms"]["oracle"][0] == bw["ttft_ms"]["oracle"][1]              # nothing on the link
    assert all(w < c for w, c in zip(bw["ttft_prefilled_ms"]["scd"], bw["ttft_ms"]["scd"]))
    assert bw["ttft_ms"]["raw_kv"][0] > bw["ttft_ms"]["raw_kv"][1]               # 10 Gbps is slower than 400
    assert bw["phases"]["scd"]["payload_bytes"] < bw["phases"]["raw_kv"]["payload_bytes"]
    assert (tmp_path / "plots").joinpath(Path(bw["plot"]).name).read_bytes()[:4] == b"\x89PNG"


def test_bench_fanout_and_ttft_arithmetic():
    from cli.bench import fanout, ttft
    m = {"prefill_ms": 100.0, "producer_prefill_ms": 90.0,
         "methods": {"oracle": {"producer_ms": 0.0, "consumer_ms": 100.0, "payload_bytes": 0},
                     "raw_kv": {"producer_ms": 0.0, "consumer_ms": 1.0, "payload_bytes": 125_000_000},
                     "scd": {"producer_ms": 10.0, "consumer_ms": 5.0, "payload_bytes": 12_500_000}}}
    rows = fanout(m, [1, 4])
    assert rows[0]["ratio"] == pytest.approx((90 + 10 + 5) / 100) and rows[1]["ratio"] == pytest.approx(120 / 400)
    t = ttft(m, [10.0, 100.0])               # 125 MB is 100 ms at 10 Gbps, 10 ms at 100 Gbps
    assert t["oracle"] == [100.0, 100.0]
    assert t["raw_kv"] == pytest.approx([90 + 1 + 100, 90 + 1 + 10])
    assert t["scd"] == pytest.approx([90 + 10 + 5 + 10, 90 + 10 + 5 + 1])
    warm = ttft(m, [10.0], prefilled=True)   # the producer holds the prefix: its encode is left, not its prefill
    assert warm["scd"] == pytest.approx([10 + 5 + 10]) and warm["oracle"] == [100.0]
    # E-first: 1.25 MB of entry (1 ms at 10 Gbps) starts a 40 ms block while the other 11.25 MB arrive (9 ms more)
    m["methods"]["scd"].update(consumer_ms=45.0, entry_bytes=1_250_000, recompute_ms=40.0)
    assert ttft(m, [10.0, 1.0], prefilled=True)["scd"] == pytest.approx([10 + max(1 + 40, 10 + 5),
                                                                          10 + max(10 + 40, 100 + 5)])


@pytest.mark.parametrize("argv,msg", [
    (["eval", "--pair", "base"], "PRODUCER:CONSUMER"),
    (["eval", "--pair", "base:nope"], "no model 'nope'"),
    (["eval", "--pair", "../..:qa"], "no model '../..'"),
    (["eval", "--pair", "base:qa", "--methods", "magic"], "unknown method"),
    (["bench", "--pair", "base:qa", "--tokens", "1024,x"], "integers separated by commas"),
    (["bench", "--pair", "base:qa", "--fanout", "0,2"], "--fanout must be positive"),
    (["bench", "--pair", "base:qa", "--threads", "0"], "--threads must be positive"),
    (["bench", "--pair", "base:qa", "--bandwidth", "10,fast"], "numbers separated by commas"),
    (["bench", "--pair", "base:qa", "--bandwidth", "10", "--plot-dir", __file__], "not a folder"),
    (["bench", "--pair", "base:qa", "--ttft-target", "5"], "need --bandwidth"),
    (["bench", "--pair", "base:qa", "--bandwidth", "10", "--link-ms", "0"], "positive time"),
    (["bench", "--pair", "base:qa", "--bandwidth", "10", "--link-ms", "1", "--ttft-target", "9"], "not both"),
])
def test_cli_rejects_bad_input_with_a_message(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        scd(argv)
