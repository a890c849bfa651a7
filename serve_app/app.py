"""Builds the Serve application from a DeploymentConfig; placement comes from cluster/, nothing here guesses.

    producer pool (detached, named) -> producers  <-  router (FastAPI ingress)  ->  one deployment per specialist
                                                                                  (a LoRA group's: one for all)
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ray import serve

from actors.adapter_book import stop_book
from actors.producer_pool import start_pool, stop_pool
from actors.registry import stop_registry
from cluster.config import ConfigError, DeploymentConfig
from cluster.runtime import actor_options, connect, drop_messages, machine_cores, replica_caps
from engines.interface import EngineConfig
from scd.online import shapes
from serve_app.errors import key_digest
from serve_app.router import Router
from serve_app.specialist import SpecialistServer

log = logging.getLogger(__name__)

APP_NAME = "scd"
# How often a replica being stopped (a downscale, an undeploy) looks whether its requests have ended (Serve's
# default: every 2 s): it still waits for all of them, up to Serve's graceful_shutdown_timeout_s, and goes soon after
SHUTDOWN_POLL_S = 0.25


def telemetry_settings(cfg: DeploymentConfig) -> dict:
    """What serve_app.telemetry.setup takes: where spans go (Serve's access log is set on the deployments)."""
    return cfg.telemetry.model_dump(exclude={"access_log"})


def specialist_options(cfg: DeploymentConfig, name: str, max_replicas: int | None = None) -> dict:
    """The specialist's Serve deployment options; `max_replicas` caps its autoscaling (cluster.runtime.replica_caps)."""
    s = cfg.specialist(name)
    a = s.autoscaling
    top = a.max_replicas if max_replicas is None else min(a.max_replicas, max_replicas)
    # the replica is a thin shim: it needs no CPU of its own, and goes where the labels say its engine may go
    replica = {"num_cpus": 0, **({"label_selector": dict(s.node_labels)} if s.node_labels else {})}
    return {"name": f"group-{s.group}" if s.group else f"specialist-{s.name}",
            "ray_actor_options": replica,
            "autoscaling_config": {"min_replicas": min(a.min_replicas, top), "max_replicas": top,
                                   "initial_replicas": max(1, a.min_replicas),
                                   "target_ongoing_requests": a.target_ongoing_requests,
                                   "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
                                   "look_back_period_s": a.look_back_period_s},
            **({"max_replicas_per_node": a.max_replicas_per_node} if a.max_replicas_per_node else {}),
            "max_ongoing_requests": cfg.limits.specialist_max_ongoing,
            "max_queued_requests": cfg.limits.specialist_max_queued,
            "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
            "logging_config": logging_config(cfg),
            "user_config": {"artifact": s.artifact, "families": cfg.family_refs()}}


def logging_config(cfg: DeploymentConfig) -> dict:
    """Serve's logging (its controller and proxy, our deployments): its own lines at `ray.log_level` and up, and
    its per-request access log only when the config asks for it, which needs INFO (an access line's level)."""
    level = cfg.ray.log_level
    if cfg.telemetry.access_log and logging.getLevelName(level) > logging.INFO:
        level = "INFO"
    return {"enable_access_log": cfg.telemetry.access_log, "log_level": level}


def embedded_cores(cfg: DeploymentConfig) -> int | None:
    """The cores of this machine (or `ray.cores`) when the deployment starts its own Ray cluster here, else None
    (a cluster's nodes declare their resources, and Ray places replicas by them)."""
    return None if cfg.ray.address or os.environ.get("RAY_ADDRESS") else cfg.ray.cores or machine_cores()


def engine_options(cfg: DeploymentConfig, name: str) -> dict:
    """Where a specialist's engine actor goes (each replica creates one): its GPUs, CPUs, resources, labels."""
    s = cfg.specialist(name)
    return actor_options(s.num_gpus, num_cpus=s.num_cpus, resources=s.resources, node_labels=s.node_labels)


def group_base(cfg: DeploymentConfig, group: str) -> str:
    """The base model folder of a LoRA group: the producer's, which every member must be an adapter of (a
    ConfigError says which is not)."""
    from scd.online.model_files import adapter_problem
    producer = Path(cfg.producer.path).expanduser()
    if shapes.is_shape(cfg.producer.path):
        raise ConfigError(f"group {group!r}: the producer is a timing shape ({cfg.producer.path}), which no "
                          "adapter names as its base")
    for m in cfg.groups()[group]:
        problem = adapter_problem(m.path, producer, m.base)
        if problem:
            raise ConfigError(f"group {group!r}: {m.name}: {problem}; a group holds LoRA adapters of the "
                              "producer's model")
    return str(producer)


ROUTER_QUEUE_FACTOR = 8     # Serve's queue of each proxy before the router, in router slots (see build)


def check_model_folders(cfg: DeploymentConfig) -> None:
    """ConfigError, one line per model, for a model path that is not a model or adapter folder, when the cluster
    is embedded (this machine serves: its folders are the ones the replicas read). A cluster joined at an
    address reads its own machines' folders, which this one may not have."""
    from scd.online.model_files import model_problem
    if cfg.ray.address:
        return
    lines = [f"  {m.name}.path: {problem}" for m in [cfg.producer, *cfg.specialists]
             if not shapes.is_shape(m.path) and (problem := model_problem(m.path, m.base))]
    if lines:
        raise ConfigError(f"{len(lines)} model(s) not found (relative paths are read from the config file's "
                          "folder; a real family's producer is built by `scd fetch-family`):\n" + "\n".join(lines))


def build(cfg: DeploymentConfig):
    """The Serve application (router bound to every specialist deployment). Refuses to serve a non-loopback
    address without an API key unless the config says `auth.allow_unauthenticated: true`."""
    key = cfg.auth.key()
    if key is None and not cfg.http.is_loopback() and not cfg.auth.allow_unauthenticated:
        raise ConfigError(f"http.host {cfg.http.host!r} is reachable from other machines and no API key is set: "
                          "set auth.api_key_env (or auth.api_key), or auth.allow_unauthenticated: true to "
                          "serve it open on purpose")
    try:
        shapes.check_family(cfg)
    except shapes.ShapeError as e:
        raise ConfigError(str(e)) from None
    check_model_folders(cfg)
    ns, base, lim = cfg.ray.namespace, cfg.producer.name, cfg.limits
    transport = cfg.resolved_transport()
    cores = embedded_cores(cfg)
    caps = replica_caps(cfg, cores)
    capped = [s.name for s in cfg.specialists if caps[s.name] < s.autoscaling.max_replicas]
    if capped:
        log.warning("autoscaling capped by this machine's %d cores (the producer and each specialist's engine "
                    "compute on cores of their own): %s", cores,
                    ", ".join(f"{n} at {caps[n]} replica(s)" for n in capped))
    handles = {}
    for s, members in cfg.engines():
        opts = specialist_options(cfg, s.name, caps[s.name])
        common = {"max_batch": lim.specialist_max_ongoing, "max_input_tokens": lim.max_input_tokens,
                  "max_tokens": lim.max_tokens, "producer": base, "store_uri": cfg.artifacts.uri,
                  "namespace": ns, "transport": transport, "control_timeout_s": lim.control_timeout_s,
                  "telemetry": telemetry_settings(cfg)}
        if members:                   # a LoRA group: one deployment, the producer's base and its members' adapters
            config = EngineConfig("group", s.group, group_base(cfg, s.group), members={m.name: m.path for m in members},
                                  **common)
        else:
            config = EngineConfig("specialist", s.name, s.path, base=s.base, **common)
        app = serve.deployment(SpecialistServer).options(**opts).bind(config, engine_options(cfg, s.name))
        handles.update({m.name: app for m in members} if members else {s.name: app})
    # Serve's own limits sit well above the router's admission limit, so that the router's JSON 503 answers
    # an overload, not Serve's plain-text one: a request waits in the proxy's queue until a router replica is
    # assigned, so a burst arriving at once is queued there whole, however quickly the router refuses it
    return Router.options(ray_actor_options={"num_cpus": 0}, num_replicas=lim.router_replicas,
                          logging_config=logging_config(cfg), graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
                          max_ongoing_requests=lim.router_max_ongoing + 16,
                          max_queued_requests=ROUTER_QUEUE_FACTOR * (lim.router_max_ongoing + 16)).bind(
        handles, cfg.model_dump(), key_digest(key))


def health_report(url: str) -> dict | None:
    """What /healthz says now (its report; on a 503 too), or None when nothing answers."""
    import json
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:                # 503: the app answers, nothing serves yet
        try:
            return json.loads(e.read())
        except ValueError:
            return {"status": "down"}
    except Exception:                                  # not up yet
        return None


def health(url: str) -> str | None:
    """What /healthz says now ("ok", "degraded", "down"), or None when nothing answers."""
    report = health_report(url)
    return report and report.get("status", "down")


def started(report: dict | None) -> bool:
    """Everything the deployment started answers: every producer up, every specialist reporting. A pair that
    cannot be served by SCD (no artifact) leaves the status degraded, and that is no reason to wait."""
    return bool(report) and report.get("status") != "down" and bool(report.get("producers")) and \
        all(p.get("state") == "up" for p in report["producers"].values()) and \
        not any("error" in s or "busy" in s for s in report.get("specialists", {}).values())


def wait_healthy(url: str, timeout_s: float = 180) -> bool:
    """Poll the app's /healthz until everything it started answers (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if started(health_report(url)):
            return True
        time.sleep(1)
    return False


def start_proxy(cfg: DeploymentConfig, tries: int = 3) -> None:
    """serve.start, again when its first HTTP proxy did not come up: on a saturated machine Serve's
    controller may replace a proxy that is slow to start while serve.start still waits on the first one
    (it then raises ActorDiedError, or TimeoutError after 60 s); the controller and the new proxy remain,
    and a second call waits for them."""
    import ray
    logs = logging_config(cfg)
    logging.getLogger("ray.serve").setLevel(logs["log_level"])              # this driver's own Serve lines
    for attempt in range(1, tries + 1):
        try:
            serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port}, logging_config=logs)
            # serve.run, which follows, says that it found Serve running and applies no new http_options: it
            # passes none (Serve warns of any that differ)
            drop_messages("ray.serve", "Connecting to existing Serve app")
            return
        except (ray.exceptions.RayActorError, TimeoutError) as e:
            if attempt == tries:
                raise
            log.warning("Serve's HTTP proxy did not start (%s); waiting for it again (%d/%d)",
                        type(e).__name__, attempt, tries)


def deploy(cfg: DeploymentConfig, app=None, blocking: bool = False):
    """Connect (or start Ray), start the producer pool, start Serve's HTTP proxy and run the app (`build(cfg)`
    unless given). Returns the pool actor."""
    app = app or build(cfg)                            # refuses an open non-loopback address before any start
    connect(cfg.ray)
    pool = start_pool(cfg)
    start_proxy(cfg)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=blocking)
    return pool


def undeploy(cfg: DeploymentConfig, keep_serve: bool = False) -> None:
    """Stop what deploy started: the Serve app and its proxy, and the detached actors beside it (the producer
    pool with its producers, the adapter book, the artifact registry), which would otherwise outlive it on a
    shared cluster. `keep_serve`: delete this app only, and leave Serve (its controller, the HTTP proxy and any
    other application) running for the next deploy. Safe to call when any of it is gone."""
    import ray
    if not ray.is_initialized():
        return
    if keep_serve:
        serve.delete(APP_NAME)
    else:
        serve.shutdown()
    stop_pool(cfg.ray.namespace)
    stop_book(cfg.ray.namespace)
    stop_registry(cfg.artifacts.uri, cfg.ray.namespace)


def app_builder(args: dict):
    """`serve deploy` entry (import_path serve_app.app:app_builder, args: {config: PATH}): starts the
    producer pool on the cluster and returns the application."""
    from cluster.config import load_config
    cfg = load_config(args["config"])
    start_pool(cfg)
    return build(cfg)


def serve_deploy_config(cfg: DeploymentConfig, config_path: str) -> dict:
    """A `serve deploy`-compatible config for an existing cluster, generated from ray_config.yaml."""
    deployments = [specialist_options(cfg, s.name) for s, _ in cfg.engines()]
    return {"http_options": {"host": cfg.http.host, "port": cfg.http.port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "serve_app.app:app_builder",
                              "args": {"config": config_path}, "deployments": deployments}]}
