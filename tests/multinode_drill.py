"""Node-failure drill on a simulated 3-node Ray cluster (one machine): kill the node that hosts the producer
while requests flow, and watch the app heal. Prints one JSON line of what it saw; tests/test_multinode.py
runs it in its own process (the test session's Ray is a different cluster) and asserts on that line.

    head      : GCS, Serve controller, HTTP proxy (HeadOnly); no `scd_worker` resource, no worker label
    worker x2 : resources {scd_worker: 4}, labels {scd-role: worker}; a third joins after one is killed
    producer  : resources {scd_worker: 1}         -> a worker, by custom resource
    qa (x2)   : node_labels {scd-role: worker}    -> the workers, by label selector, one replica a node

Timeline: the head starts alone and the app is deployed on it, so the router (which has no placement key)
lives on the head and the drill kills a model node, not the front door; the models wait until both workers
join, one qa replica on each (`max_replicas_per_node: 1`). Then load (a few threads posting
/v1/completions), kill the producer's node without grace and start a third worker in its place (as a
cluster's autoscaler would; the surviving worker holds one qa replica already), keep the load on until the
producer is ALIVE on a surviving node and answers `scd` again and Serve runs both qa replicas on nodes
other than the dead one (or `--bound-s` passes), then a short tail of load. On failure the JSON line carries
`error`, and the exit status is 1.

    python tests/multinode_drill.py [--bound-s 60] [--threads 3] [--store STORE_WITH_BASE_QA]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PREFIX = ("Notes:\nClara Petrov lives in Galen Cross. Tilda Vance works as a brewer. Clara Petrov owns a teal "
          "kettle. Tilda Vance lives in Hythe.\n")
WORKER = {"resources": {"scd_worker": 4}, "labels": {"scd-role": "worker"}}
# Node death noticed in about 3 s instead of Ray's default 15 s or more; the rest is Ray's defaults.
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
               "health_check_failure_threshold": 3}
QA_REPLICAS = 2


def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"error": f"not JSON: {text[:200]!r}"}
    except Exception as e:                               # refused, reset, timed out: no HTTP answer at all
        return 0, {"error": f"{type(e).__name__}: {e}"}


def write_drill_config(tmp: Path, port: int, store: Path | None = None) -> Path:
    """The test suite's demo config, one calibrated pair (base:qa), placed by the worker resource and label;
    `store`: a store that has base:qa (the test session's, copied), else it is calibrated here."""
    import shutil

    import yaml

    from jobs.calibrate import main as calibrate
    from tests.conftest import DEMO, SERVE_BUDGET, write_config
    if store is not None:
        shutil.copytree(store, tmp / "store")
    path = write_config(tmp, **SERVE_BUDGET)
    if store is None:
        with contextlib.redirect_stdout(sys.stderr):     # stdout carries the one JSON line
            calibrate(["--pair", "base:qa", "--config", str(path), "--no-actors"])
    raw = yaml.safe_load(path.read_text())
    raw["producer"].update(num_cpus=0.25, resources={"scd_worker": 1})
    raw["specialists"] = [{"name": "qa", "path": str(DEMO / "qa"), "num_cpus": 0.25,
                           "node_labels": {"scd-role": "worker"},
                           "autoscaling": {"min_replicas": QA_REPLICAS, "max_replicas": QA_REPLICAS,
                                           "max_replicas_per_node": 1}}]
    raw["ray"] = {"namespace": "scd-drill"}
    raw["http"] = {"port": port}
    raw["producer_timeout_s"] = 2.0
    path.write_text(yaml.safe_dump(raw))
    return path


class Placement:
    """Where the app's actors run, from Ray's state API (needs the head's dashboard)."""

    def __init__(self, dashboard: str, names: dict[str, str]):
        self.dashboard = dashboard                       # named: other Ray clusters may run on this machine
        self.names = names                               # node_id -> "head" | "worker1" | "worker2"

    def actors(self) -> list[dict]:
        from ray.util.state import list_actors
        return [{"state": a.state, "class_name": a.class_name, "node_id": a.node_id, "name": a.name,
                 "actor_id": a.actor_id}
                for a in list_actors(address=self.dashboard, limit=1000, raise_on_missing_output=False)]

    def snapshot(self) -> dict:
        out = collections.defaultdict(list)
        for a in self.actors():
            if a["state"] != "ALIVE":
                continue
            cls = a["class_name"]
            if cls == "ProducerActor":
                key = "producer"
            elif cls == "ArtifactRegistry":
                key = "registry"
            elif cls.startswith("ServeReplica:scd:"):
                key = cls.split(":", 2)[2]
            elif cls in ("ServeController", "ProxyActor"):
                key = cls
            else:
                continue
            out[key].append(self.names.get(a["node_id"], a["node_id"]))
        return {k: sorted(v) for k, v in sorted(out.items())}

    def producer(self) -> tuple[str | None, str | None, str | None]:
        """(state, node id, actor id) of the producer: Ray restarts an actor under the same id, while one
        created again (its name freed) gets a new id."""
        live = [a for a in self.actors() if a["class_name"] == "ProducerActor" and a["state"] != "DEAD"]
        return (live[0]["state"], live[0]["node_id"], live[0]["actor_id"]) if live else (None, None, None)


def wait_spread(where: Placement, timeout_s: float = 120) -> float:
    """Seconds until both qa replicas run, each on a worker of its own (`max_replicas_per_node: 1`: the second
    waits for the second worker); a RuntimeError after `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        nodes = [a["node_id"] for a in where.actors()
                 if a["state"] == "ALIVE" and a["class_name"] == "ServeReplica:scd:specialist-qa"]
        if len(set(nodes)) == len(nodes) == QA_REPLICAS and running_replicas() == QA_REPLICAS:
            return round(time.monotonic() - t0, 1)
        time.sleep(0.5)
    raise RuntimeError(f"qa replicas not on two workers after {timeout_s} s: {where.snapshot()}")


def running_replicas(deployment: str = "specialist-qa") -> int:
    from ray import serve
    try:
        dep = serve.status().applications["scd"].deployments[deployment]
    except KeyError:
        return 0
    return sum(n for state, n in dep.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")


def drill(seen: dict, bound_s: float, threads: int, store: Path | None = None) -> None:
    """Runs the drill, filling `seen` as it goes (so a failure still reports what came before it)."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from cluster.config import load_config
    from serve_app.app import deploy, wait_healthy
    from tests.conftest import free_port

    t_all = time.monotonic()
    seen.update(bound_s=bound_s, threads=threads)
    tmp = Path(tempfile.mkdtemp(prefix="scd-drill-"))
    port = free_port()
    cfg = load_config(write_drill_config(tmp, port, store))
    seen["calibrate_s"] = round(time.monotonic() - t_all, 1)
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "include_dashboard": True, "dashboard_port": free_port(),
            "dashboard_agent_listen_port": free_port(), "_system_config": FAST_HEALTH})
        ctx = ray.init(address=cluster.address, namespace=cfg.ray.namespace, log_to_driver=False)
        cfg = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"address": cluster.address})})   # joined
        names = {cluster.head_node.node_id: "head"}
        where = Placement("http://" + ctx.dashboard_url, names)
        # The router has no placement key; deploying before the workers join puts it on the head, so the
        # drill kills a model node and not the front door. The models wait for the workers (placement).
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        failed: list[str] = []

        def deploy_app():                                 # serve.start inside is a no-op: Serve runs already
            try:
                deploy(cfg)
            except Exception as e:
                failed.append(f"deploy: {type(e).__name__}: {e}")

        deploying = threading.Thread(target=deploy_app, daemon=True)
        deploying.start()
        deadline = time.monotonic() + 120
        while "Router" not in where.snapshot():
            if time.monotonic() > deadline or not deploying.is_alive():
                raise RuntimeError("the router never started on the head")
            time.sleep(0.5)
        workers = [cluster.add_node(num_cpus=2, wait=False, **WORKER) for _ in range(2)]   # together, so
        cluster.wait_for_nodes()                          # that Serve's SPREAD sees both when replicas place
        names.update({w.node_id: f"worker{i + 1}" for i, w in enumerate(workers)})
        deploying.join(timeout=180)
        url = f"http://127.0.0.1:{port}"
        if deploying.is_alive() or failed or not wait_healthy(url, timeout_s=120):
            raise RuntimeError(f"the app never became healthy {failed}")
        seen["spread_wait_s"] = wait_spread(where)
        seen["deploy_s"] = round(time.monotonic() - t_all, 1)
        seen["placement_before"] = where.snapshot()

        log: list[dict] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def load(k: int):
            i = 0
            while not stop.is_set():
                i += 1
                start = time.monotonic() - t0
                status, out = _post(url + "/v1/completions", {
                    "model": "qa", "max_tokens": 4,
                    "prompt": PREFIX + f"Request {k}.{i}. Question: Where does Clara Petrov live?\nAnswer:"})
                scd = out.get("scd") or {}
                if status != 200:
                    time.sleep(0.2)                       # no hot loop on errors
                log.append({"t": round(start, 2), "end": round(time.monotonic() - t0, 2), "status": status,
                            "mode": scd.get("mode"), "reason": scd.get("reason"),
                            "error": None if status == 200 else str(out.get("error", out))[:300]})

        pool = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(threads)]
        for th in pool:
            th.start()
        while not any(r["mode"] == "scd" for r in log):
            if time.monotonic() - t0 > 60:
                raise RuntimeError(f"no scd answer before the kill; first answers: {log[:3]}")
            time.sleep(0.2)
        time.sleep(3)                                     # a few seconds of steady load before the kill

        _, node_id, producer_id = where.producer()
        victim = next(w for w in workers if w.node_id == node_id)
        seen["killed"] = names[node_id]
        t_kill = time.monotonic() - t0
        seen["kill_at_s"] = round(t_kill, 1)             # seconds into the load
        cluster.remove_node(victim, allow_graceful=False)
        # a new worker, as a cluster's autoscaler starts one: the replica the survivor may not take goes there
        spare = cluster.add_node(num_cpus=2, wait=False, **WORKER)
        names[spare.node_id] = "worker3"

        back: dict = {}
        qa_min = QA_REPLICAS
        while time.monotonic() - t0 - t_kill < bound_s and not {"producer_alive", "scd_again",
                                                                "replicas_running"} <= set(back):
            now = time.monotonic() - t0
            if "node_dead" not in back and not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node_id):
                back["node_dead"] = now
            state, node, actor_id = where.producer()
            if "producer_alive" not in back and state == "ALIVE" and node != node_id:
                back["producer_alive"] = now
                seen["producer_restarted_in_place"] = actor_id == producer_id   # same actor: Ray restarted it
            qa_min = min(qa_min, running_replicas())
            if "scd_again" not in back and any(r["mode"] == "scd" and r["t"] > t_kill for r in log):
                back["scd_again"] = min(r["end"] for r in log if r["mode"] == "scd" and r["t"] > t_kill)
            survivors = [n for n in where.snapshot().get("specialist-qa", []) if n != seen["killed"]]
            if "replicas_running" not in back and len(survivors) >= QA_REPLICAS and \
                    running_replicas() >= QA_REPLICAS:
                back["replicas_running"] = now
            time.sleep(0.5)
        time.sleep(3)                                     # a tail of load on the healed app
        stop.set()
        for th in pool:
            th.join(timeout=90)

        seen["after_kill_s"] = {k: round(v - t_kill, 1) for k, v in sorted(back.items(), key=lambda kv: kv[1])}
        seen["qa_running_min_after_kill"] = qa_min
        seen["placement_after"] = where.snapshot()
        seen["qa_running_after"] = running_replicas()
        outcome = collections.Counter(f"{r['status']} {r['mode']}" + (f" {r['reason']}" if r["reason"] else "")
                                      for r in log)
        seen["requests"] = {"total": len(log), "ended_after_kill": sum(r["end"] > t_kill for r in log),
                            "outcomes": dict(sorted(outcome.items())),
                            "not_200": [r for r in log if r["status"] != 200][:10]}
    finally:
        from ray import serve as _serve
        for step in (_serve.shutdown, ray.shutdown, *((cluster.shutdown,) if cluster else ())):
            try:
                step()
            except Exception as e:                        # keep tearing down; say what failed
                seen.setdefault("teardown_errors", []).append(f"{step.__qualname__}: {e}")
    seen["wall_s"] = round(time.monotonic() - t_all, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bound-s", type=float, default=60, help="how long after the kill the app may take to heal")
    p.add_argument("--threads", type=int, default=3, help="load threads posting /v1/completions")
    p.add_argument("--store", type=Path, help="an artifact store holding base:qa (default: calibrate it first)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # a test's timeout: run the finally, then exit
    seen: dict = {}
    try:
        drill(seen, args.bound_s, args.threads, args.store)
    except BaseException as e:                            # SystemExit from SIGTERM too: report, then fail
        seen["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(seen), flush=True)
    sys.exit(1 if "error" in seen else 0)


if __name__ == "__main__":
    main()
