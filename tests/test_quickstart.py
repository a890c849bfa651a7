"""The README's quickstart, run as written (tests.doc_runner): every fenced block of its "## Quickstart"
section, in order.

The commands run in a folder of their own holding a ray_config.yaml for the demo family whose artifacts are
calibrated beforehand (a reduced budget) into a temporary store, on free ports: the README's ports 8000 and
8265 are replaced by those, and nothing else of the text is changed.
"""
from __future__ import annotations

import pytest
import yaml

from tests.conftest import DEMO, REPO, free_port, write_config
from tests.doc_runner import doc_blocks, run_blocks


def quickstart_blocks() -> list[tuple[str, str, str]]:
    return doc_blocks(REPO / "README.md", "Quickstart")


def test_the_quickstart_has_every_step_the_readme_promises():
    blocks = quickstart_blocks()
    code = "\n".join(c for _, lang, c in blocks if lang != "text")
    for step in ("scd serve", "client.completions.create", "client.chat.completions.create", "/v1/fanout",
                 "ray job submit", "jobs.calibrate", "producer:", "scd serve --config"):
        assert step in code, f"the quickstart lost its step {step!r}"
    assert all(how.startswith(("background", "not run", "config")) for how, _, _ in blocks if how), blocks


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, demo_work_dir):
    """A folder with the demo family's ray_config.yaml (free ports, a temporary store holding the three demo
    pairs' artifacts, calibrated here on a reduced budget), as the repository root is after `make demo`."""
    from jobs.calibrate import main as calibrate
    tmp = tmp_path_factory.mktemp("quickstart")
    cfg_path = write_config(tmp, prefixes=8, val=2, heldout=1, aligner_epochs=2, pool=1, work_dir=demo_work_dir)
    raw = yaml.safe_load(cfg_path.read_text())
    http, dashboard = free_port(), free_port()
    raw["ray"] = {"namespace": "scd-quickstart", "num_cpus": 4, "dashboard_port": dashboard}
    raw["http"] = {"port": http}
    raw["producer"]["num_cpus"] = 0.5
    raw["specialists"] = [{"name": n, "path": str(DEMO / n), "num_cpus": 0.5,
                           "autoscaling": {"min_replicas": 1, "max_replicas": 1}} for n in ("qa", "prose", "code")]
    cfg_path.write_text(yaml.safe_dump(raw))
    for pair in ("base:qa", "base:prose", "base:code"):
        calibrate(["--pair", pair, "--config", str(cfg_path), "--no-actors"])
    root = tmp / "repo"                      # the commands' folder: small, as `ray job submit` uploads it
    root.mkdir()
    (root / "ray_config.yaml").write_text(cfg_path.read_text())
    return root, {"127.0.0.1:8000": f"127.0.0.1:{http}", "127.0.0.1:8265": f"127.0.0.1:{dashboard}"}


def test_the_readme_quickstart_runs_as_written(workspace):
    root, ports = workspace
    run = run_blocks(quickstart_blocks(), root, ports)
    assert len(run.servers) == 1, run.servers
    assert run.servers[0].returncode == 0, f"scd serve did not stop cleanly:\n{run.servers[0].stdout.read()[-3000:]}"
    # what the steps say they show: answers from codes, one prefill for the fan-out, the job left qa alone
    namespace = run.namespace
    assert namespace["r"].model_extra["scd"]["mode"] == "scd", namespace["r"]
    assert namespace["chat"].model_extra["scd"]["mode"] == "scd" and namespace["chat"].choices[0].message.content
    fan = namespace["fan"]
    assert fan["prefilled"] is True and [x["scd"]["mode"] for x in fan["results"]] == ["scd"] * 3, fan
    job = run.output_of("ray job submit")
    assert "already published as base:qa@" in job and "succeeded" in job, job[-2000:]


def test_the_demo_shows_every_phase_of_a_time_to_first_token():
    """The demo's per-specialist line names each phase the answer reports, a tail's and a block's too, and
    counts the producer's share into an SCD answer's end-to-end time."""
    from cli.demo import breakdown
    t = {"prefill": 0.0, "encode": 1.0, "transfer_put": 0.5, "transfer": 0.5, "decode": 0.4, "rebuild": 1.8,
         "patch": 0.0, "recompute": 3.0, "tail": 16.5, "first_token": 22.5}
    e2e, text = breakdown({"mode": "scd", "timings_ms": t})
    assert "tail=16.5" in text and "recompute=3.0" in text and abs(e2e - 24.5) < 1e-9, (e2e, text)
    e2e, text = breakdown({"mode": "oracle", "timings_ms": {"prefill": 11.9, "first_token": 16.2}})
    assert e2e == 16.2 and text == "prefill=11.9  first_token=16.2", (e2e, text)
