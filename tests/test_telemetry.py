import json
import subprocess
import sys


def test_spans_link_across_a_carrier_and_phases_become_child_spans(tmp_path):
    # a fresh interpreter: the global tracer provider can be set once per process
    path = tmp_path / "spans.jsonl"
    code = f"""
from serve_app import telemetry
telemetry.setup("file", path={str(path)!r})
with telemetry.span("router.request", model="qa"):
    carrier = telemetry.carrier()
with telemetry.span("specialist.generate", carrier):          # as if in another process
    telemetry.record_phases({{"rebuild": 1.5, "first_token": 4.0}}, telemetry.carrier(), specialist="qa")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}
    assert set(spans) == {"router.request", "specialist.generate", "phase.rebuild", "phase.first_token"}
    root, spec = spans["router.request"], spans["specialist.generate"]
    assert len({s["trace_id"] for s in spans.values()}) == 1, "all spans must share one trace"
    assert spec["parent_id"] == root["span_id"]
    assert spans["phase.rebuild"]["parent_id"] == spec["span_id"]
    assert abs((spans["phase.first_token"]["end_ns"] - spans["phase.first_token"]["start_ns"]) / 1e6 - 4.0) < 1e-3


def test_unknown_exporter_is_refused(tmp_path):
    code = "from serve_app import telemetry\ntelemetry.setup('pigeon')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "unknown telemetry exporter 'pigeon'" in r.stderr
