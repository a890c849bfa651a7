"""Builds the Serve application from a DeploymentConfig; placement comes from cluster/, nothing here guesses.

    producer actor (detached, named)  <-  router (FastAPI ingress)  ->  one deployment per specialist
"""
from __future__ import annotations

import time

import ray
from ray import serve

from actors.producer_actor import PRODUCER_NAME, ProducerActor
from cluster.config import DeploymentConfig
from cluster.runtime import actor_options, connect
from serve_app.router import Router
from serve_app.specialist import SpecialistServer

APP_NAME = "scd"


def telemetry_settings(cfg: DeploymentConfig) -> dict:
    return cfg.telemetry.model_dump()


def specialist_options(cfg: DeploymentConfig, name: str) -> dict:
    s = cfg.specialist(name)
    a = s.autoscaling
    return {"name": f"specialist-{s.name}",
            "ray_actor_options": actor_options(s.num_gpus, num_cpus=s.num_cpus, resources=s.resources,
                                               node_labels=s.node_labels),
            "autoscaling_config": {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
                                   "initial_replicas": max(1, a.min_replicas),
                                   "target_ongoing_requests": a.target_ongoing_requests,
                                   "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s},
            "user_config": {"artifact": s.artifact}}


def build(cfg: DeploymentConfig):
    """The Serve application (router bound to every specialist deployment)."""
    ns, base = cfg.ray.namespace, cfg.producer.name
    transport = cfg.resolved_transport()
    handles = {s.name: serve.deployment(SpecialistServer).options(**specialist_options(cfg, s.name)).bind(
        s.name, s.path, f"{base}:{s.name}", cfg.artifacts.uri, ns, telemetry_settings(cfg), transport,
        cfg.producer_timeout_s)
        for s in cfg.specialists}
    return Router.options(ray_actor_options={"num_cpus": 0}).bind(handles, PRODUCER_NAME, ns, base, cfg.producer_timeout_s,
                                                                  telemetry_settings(cfg))


def start_producer(cfg: DeploymentConfig):
    """The detached, named producer actor (reused if it already runs with the same transport; one left by a
    deployment with another transport is replaced, since replicas must speak the producer's transport)."""
    pairs = {f"{cfg.producer.name}:{s.name}": s.artifact for s in cfg.specialists}
    transport = cfg.resolved_transport()
    opts = actor_options(cfg.producer.num_gpus, name=PRODUCER_NAME, detached=True, namespace=cfg.ray.namespace,
                         num_cpus=cfg.producer.num_cpus, resources=cfg.producer.resources,
                         node_labels=cfg.producer.node_labels)
    try:
        old = ray.get_actor(PRODUCER_NAME, namespace=cfg.ray.namespace)
    except ValueError:
        old = None
    if old is not None and ray.get(old.stats.remote()).get("transport") != transport:
        ray.kill(old)
        for _ in range(100):                        # the name is free once the kill has gone through
            try:
                ray.get_actor(PRODUCER_NAME, namespace=cfg.ray.namespace)
            except ValueError:
                break
            time.sleep(0.1)
    return ProducerActor.options(**opts).remote(cfg.producer.path, pairs, cfg.artifacts.uri, cfg.ray.namespace,
                                                transport=transport)


def wait_healthy(url: str, timeout_s: float = 180) -> bool:
    """Poll the app's /healthz until it says ok (True) or `timeout_s` passes (False)."""
    import json
    import urllib.request
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=30) as r:
                if json.loads(r.read())["status"] == "ok":
                    return True
        except Exception:                              # not up yet, or degraded (503)
            pass
        time.sleep(1)
    return False


def deploy(cfg: DeploymentConfig, blocking: bool = False):
    """Connect (or start Ray), start the producer, start Serve's HTTP proxy and run the app."""
    connect(cfg.ray)
    producer = start_producer(cfg)
    serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
    serve.run(build(cfg), name=APP_NAME, route_prefix="/", blocking=blocking)
    return producer


def app_builder(args: dict):
    """`serve deploy` entry (import_path serve_app.app:app_builder, args: {config: PATH}): starts the
    producer actor on the cluster and returns the application."""
    from cluster.config import load_config
    cfg = load_config(args["config"])
    start_producer(cfg)
    return build(cfg)


def serve_deploy_config(cfg: DeploymentConfig, config_path: str) -> dict:
    """A `serve deploy`-compatible config for an existing cluster, generated from ray_config.yaml."""
    deployments = [specialist_options(cfg, s.name) for s in cfg.specialists]
    return {"http_options": {"host": cfg.http.host, "port": cfg.http.port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "serve_app.app:app_builder",
                              "args": {"config": config_path}, "deployments": deployments}]}
