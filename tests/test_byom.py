"""docs/bring-your-own-models.md's walkthrough, run as written (tests.doc_runner): a base folder, a PEFT
adapter and a text file (built small by tests.byom_pair, in place of the page's /models, /adapters and /data
paths), calibrated, served, checked and called with the `openai` client, on free ports."""
from __future__ import annotations

from tests.byom_pair import build
from tests.conftest import REPO, free_port
from tests.doc_runner import doc_blocks, run_blocks

PAGE = REPO / "docs" / "bring-your-own-models.md"


def walkthrough() -> list[tuple[str, str, str]]:
    return doc_blocks(PAGE, "Walkthrough")


def test_the_walkthrough_covers_a_users_steps():
    code = "\n".join(c for _, lang, c in walkthrough() if lang != "text")
    for step in ("/models/my-base", "/adapters/support", "text_file:", "jobs.calibrate", "scd artifacts",
                 "scd serve --config", "/healthz", "OpenAI(", "extra_body", "chat.completions", "scd calibrate"):
        assert step in code, f"the walkthrough lost its step {step!r}"


def test_the_walkthrough_runs_as_written(tmp_path):
    files = build(tmp_path / "user")
    root = tmp_path / "repo"                # the commands' folder: `scd calibrate` ships it as the job's working dir
    root.mkdir()
    http, dashboard = free_port(), free_port()
    run = run_blocks(walkthrough(), root, {
        "/models/my-base": str(files["base"]), "/adapters/support": str(files["adapter"]),
        "/data/support.txt": str(files["text"]),
        "127.0.0.1:8000": f"127.0.0.1:{http}", "127.0.0.1:8265": f"127.0.0.1:{dashboard}",
        "{port: 8000}": f"{{port: {http}}}", "{dashboard_port: 8265}": f"{{dashboard_port: {dashboard}}}"})
    assert len(run.servers) == 1 and run.servers[0].returncode == 0, \
        f"scd serve did not stop cleanly:\n{run.servers[0].stdout.read()[-3000:]}"
    calibrated = run.output_of("python -m jobs.calibrate")
    assert "quality gate: passed" in calibrated and "published mybase:support@" in calibrated, calibrated[-3000:]
    assert (root / "runs" / "artifacts").is_dir(), "the artifacts are not where the page says (runs/ beside the config)"
    assert "mybase:support" in run.output_of("scd artifacts")
    assert run.output_of("/healthz").split()[0] == "ok", run.output_of("/healthz")
    r, chat = run.namespace["r"], run.namespace["chat"]
    assert r.model_extra["scd"]["mode"] == "scd" and r.usage.completion_tokens > 0, r
    assert chat.model_extra["scd"]["mode"] == "scd", chat


def test_the_pages_other_configs_are_valid(tmp_path):
    blocks = doc_blocks(PAGE, "More specialists, their own settings")
    assert [how for how, _, _ in blocks] == ["config"], blocks
    run_blocks(blocks, tmp_path, {})             # validates it against the schema (not the paths)
