"""tools.lora_timeline against a stand-in server (no models): the adapter answers by fallback until its artifact
is published, then from it; it is unloaded under long requests. The tool must see the switch, count every
answer, and report failed requests (none here; one where the server errs)."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.conftest import send_json
from tools import lora_timeline

NAME = "support"


class Server:
    """The endpoints lora_timeline calls, on a free port: `switch_after` answers by fallback before the artifact
    is published; with `error_at`, that answer of the adapter's is an HTTP 500."""

    def __init__(self, switch_after: int = 3, error_at: int | None = None):
        self.asked, self.running, self.loaded, self.unloaded = 0, 0, False, False
        self.switch_after, self.error_at, self.lock = switch_after, error_at, threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                published = outer.asked > outer.switch_after
                send_json(self, 200, {"specialists": {NAME: {
                    "calibration": f"job-1: {'SUCCEEDED' if published else 'RUNNING'}",
                    "artifact": f"base:{NAME}@v1" if published else None, "running": outer.running}}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/load_lora_adapter":
                    outer.loaded = True
                    return send_json(self, 200, {"loaded": body["lora_name"]})
                if self.path == "/v1/unload_lora_adapter":
                    outer.unloaded = True
                    return send_json(self, 200, {"unloaded": body["lora_name"]})
                if body["model"] != NAME:
                    return send_json(self, 200, {"scd": {"mode": "scd", "artifact": "base:qa@v1"}})
                if outer.unloaded and body["max_tokens"] <= 4:
                    return send_json(self, 404, {"error": {"message": f"no model {NAME}"}})
                with outer.lock:
                    outer.asked += 1
                    n = outer.asked
                if n == outer.error_at:
                    return send_json(self, 500, {"error": {"message": "boom"}})
                if body["max_tokens"] > 4:                      # a long request: running until it ends
                    with outer.lock:
                        outer.running += 1
                    time.sleep(3)                       # long enough to overlap on a busy machine
                    with outer.lock:
                        outer.running -= 1
                if n > outer.switch_after:
                    return send_json(self, 200, {"scd": {"mode": "scd", "artifact": f"base:{NAME}@v1"}})
                return send_json(self, 200, {"scd": {"mode": "fallback", "reason": "no artifact yet"}})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.mark.parametrize("error_at", [None, 2])
def test_the_timeline_sees_the_switch_and_counts_every_answer(error_at, capsys):
    server = Server(error_at=error_at)
    try:
        rc = lora_timeline.main(["--url", server.url, "--path", "/adapters/support", "--name", NAME, "--others", "qa",
                                 "--prefix-tokens", "16", "--after", "2", "--unload-under", "2", "--bound-s", "60"])
    finally:
        server.close()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    events = [what for _, what in out["events"]]
    assert server.loaded and server.unloaded, events
    assert any(e.startswith("switch: first answer from base:support@v1") for e in events), events
    assert any(e.startswith("unload asked with 2 requests running") for e in events), events
    modes = out["answers"][NAME]
    assert modes.get("scd", 0) >= 2 and modes.get("fallback:no artifact yet", 0) >= 1, modes
    assert out["answers"]["qa"].get("scd", 0) >= 1, out["answers"]
    if error_at is None:
        assert rc == 0 and out["failed"] == [], out["failed"]
    else:
        assert rc == 1 and [a["status"] for a in out["failed"]] == [500], out["failed"]
