"""Connecting to Ray (an address, the job's cluster, or an embedded local one) and placement decisions.

Placement lives here and nowhere else: actor bodies receive their options and ask `device()` which device
Ray gave them; they never choose GPUs themselves.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import ray

from cluster.config import DeploymentConfig, RaySettings


def connect(settings: RaySettings, **overrides) -> dict:
    """Idempotent: reuse an initialised Ray, join `settings.address` (or the job's RAY_ADDRESS, set by
    `ray job submit`), else start an embedded local cluster. Returns the cluster's resources."""
    if not ray.is_initialized():
        address = settings.address or os.environ.get("RAY_ADDRESS", "")
        kwargs = {"namespace": settings.namespace, "log_to_driver": True, "logging_level": settings.log_level,
                  **overrides}
        if address:
            ray.init(address=address, **kwargs)
        else:
            if settings.dashboard_port is not None:
                kwargs.setdefault("include_dashboard", True)
                kwargs.setdefault("dashboard_port", settings.dashboard_port)
            kwargs.setdefault("include_dashboard", False)
            start_local(num_cpus=settings.num_cpus, num_gpus=settings.num_gpus, **kwargs)
            if kwargs["include_dashboard"]:
                name_for_jobs()
    return ray.cluster_resources()


class DropMessages(logging.Filter):
    """Drops the records whose message contains one of `parts`."""

    def __init__(self, *parts: str):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


def drop_messages(logger: str, *parts: str) -> None:
    """Keep the records of `logger` (itself, not its children) whose message contains one of `parts` out of the
    output; idempotent."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, DropMessages) and f.parts == parts for f in target.filters):
        target.addFilter(DropMessages(*parts))


LOCAL_STARTS = 3        # Ray gives a new node's raylet 30 s to register, which a machine busy enough can miss


@contextlib.contextmanager
def environ(**values: str):
    """These environment variables set while the block runs (processes it starts inherit them), then as before;
    only these: variables the block sets itself stay (ray.init sets PYTHONBREAKPOINT in the driver), which
    `mock.patch.dict(os.environ)`, restoring the whole environment, would undo."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_local(**kwargs):
    """`ray.init(address="local")`, started again (up to LOCAL_STARTS times) when its raylet did not register in
    time; the processes of a start that timed out are stopped first (Ray leaves them running). Ray's loggers in
    the cluster's worker processes (its actors', a Ray Job's supervisor's, whose lines reach this terminal) log at
    this driver's `logging_level`. Returns ray.init's context."""
    import sys

    from ray._common.utils import get_default_ray_temp_dir
    level = kwargs.get("logging_level", logging.INFO)
    level = logging.getLevelName(level) if isinstance(level, int) else level
    for attempt in range(1, LOCAL_STARTS + 1):
        try:
            with environ(RAY_LOGGER_LEVEL=level.lower()):      # read by each worker process Ray starts
                return ray.init(address="local", **kwargs)
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == LOCAL_STARTS:
                raise
            print(f"[scd] Ray's local cluster did not start within Ray's 30 s (try {attempt} of {LOCAL_STARTS}): "
                  "starting it again", file=sys.stderr, flush=True)
            ray.shutdown()
            _stop_session(kwargs.get("_temp_dir") or get_default_ray_temp_dir())


def _stop_session(temp_dir: str) -> None:
    """Stop the processes of the newest Ray session under temp_dir (a start that failed), by their command
    lines, which name the session's folder."""
    import psutil
    session = Path(temp_dir) / "session_latest"
    if not session.is_symlink():
        return
    name = session.resolve().name
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid != os.getpid() and any(name in arg for arg in proc.info["cmdline"] or ()):
            try:
                proc.kill()
            except psutil.Error:
                pass


def name_for_jobs() -> None:
    """Name the embedded cluster in its temp dir's address file, as `ray start` does. A Ray Job's driver
    joins the cluster its supervisor resolves from that file; with no file there Ray joins any cluster it
    finds running on the machine, so a job submitted to this cluster's Jobs API could run on another one.
    `shutdown` removes the name again."""
    node = ray._private.worker._global_node
    _address_file(node).write_text(node.gcs_address)


def _address_file(node) -> Path:
    return Path(node.get_temp_dir_path()) / "ray_current_cluster"


def shutdown() -> None:
    """`ray.shutdown()`, removing the address file `connect` wrote for an embedded cluster if it still names
    this one (a stale name would send later `ray.init(address="auto")` calls to a cluster that is gone)."""
    node = ray._private.worker._global_node
    if node is not None and node.head:
        try:
            path = _address_file(node)
            if path.read_text().strip() == node.gcs_address:
                path.unlink()
        except OSError:
            pass
    ray.shutdown()


def actor_options(num_gpus: float, name: str | None = None, detached: bool = False,
                  namespace: str | None = None, num_cpus: float = 1, resources: dict[str, float] | None = None,
                  node_labels: dict[str, str] | None = None) -> dict:
    """Ray actor options for a model-holding actor: GPUs from the config, else `num_cpus` logical CPUs
    (one by default, so that a producer and a consumer can run side by side on a small machine).

    Placement: `resources` (custom resources a node must offer) pass through as Ray's `resources`, and
    `node_labels` become Ray's `label_selector`. Both are also valid Serve `ray_actor_options`, so the
    producer actor and every specialist replica are placed by the same keys; empty ones are left out."""
    opts: dict = {"num_gpus": num_gpus, "num_cpus": 0 if num_gpus > 0 else num_cpus}
    if resources:
        opts["resources"] = dict(resources)
    if node_labels:
        opts["label_selector"] = dict(node_labels)
    if name:
        opts.update(name=name, get_if_exists=True)
    if detached:
        opts["lifetime"] = "detached"
    if namespace:
        opts["namespace"] = namespace
    return opts


def device() -> str:
    """Inside an actor: 'cuda' when Ray assigned it a GPU that torch can see, else 'cpu'."""
    if ray.get_gpu_ids():
        import torch
        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


def lower_cpu_priority(niceness: int = 5) -> None:
    """Inside a CPU-bound specialist replica: let the processes every request depends on (the producer, the
    router, Ray's own) go first when the cores are contended, e.g. while a restarted producer loads its model
    under load. No effect on a replica that Ray gave a GPU."""
    import os
    if device() == "cpu":
        try:
            os.nice(niceness)
        except OSError:                      # not permitted here: run at the normal priority
            pass


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or a taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                       # no affinity on this platform
        return os.cpu_count() or 1


def threads_for(assigned_cpus: float, node_cpus: float, cores: int) -> int:
    """Compute threads for a process granted `assigned_cpus` of a node that declares `node_cpus` logical CPUs
    on `cores` real ones: its share of the real cores (a node declaring more CPUs than it has, to fit several
    models on a small machine, must not run a thread per declared CPU), at least one."""
    share = assigned_cpus * min(1.0, cores / node_cpus) if node_cpus > 0 else assigned_cpus
    return max(1, int(share))


def cpu_threads() -> int:
    """Inside an actor: threads for its compute, from the CPUs Ray granted it, as a share of this node's real
    cores (torch would otherwise use every core of the node in every process)."""
    ctx = ray.get_runtime_context()
    assigned = ctx.get_assigned_resources().get("CPU", 1)
    node = next((n for n in ray.nodes() if n.get("NodeID") == ctx.get_node_id()), {})
    return threads_for(assigned, node.get("Resources", {}).get("CPU", 0.0), machine_cores())


def replica_caps(cfg: DeploymentConfig, cores: int | None) -> dict[str, int]:
    """The most replicas each specialist may autoscale to. With `cores` (an embedded cluster: one machine whose
    cores are known) every model process on CPU computes on cores of its own: the producers and the replicas
    each CPU specialist starts with take theirs first (`num_cpus` each, at least one), and autoscaling adds a
    CPU replica only while the cores left hold it, one specialist after the other in config order. A replica
    beyond the cores adds no compute: its start (a process, a model load) and its smaller batches take the
    cores the running ones need; nor more than `max_replicas_per_node` (the machine is one node). GPU
    specialists, and every specialist on a cluster of declared resources (`cores` None: Ray places replicas
    where nodes have CPUs to grant), keep their configured maximum."""
    caps = {s.name: s.autoscaling.max_replicas for s in cfg.specialists}
    if cores is not None:
        _cap_by_cores(cfg, cores, caps)
        for s in cfg.specialists:
            caps[s.name] = min(caps[s.name], s.autoscaling.max_replicas_per_node or caps[s.name])
    for first, members in cfg.engines():           # a LoRA group's members share its replicas
        caps.update({m.name: caps[first.name] for m in members})
    return caps


def _cap_by_cores(cfg: DeploymentConfig, cores: int, caps: dict[str, int]) -> None:
    cost = lambda m: max(1, int(m.num_cpus))                                  # noqa: E731
    on_cpu = [s for s, _ in cfg.engines() if s.num_gpus <= 0]
    spare = cores - (cost(cfg.producer) * cfg.producer.initial_replicas() if cfg.producer.num_gpus <= 0 else 0)
    for s in on_cpu:
        caps[s.name] = max(1, s.autoscaling.min_replicas)
        spare -= cost(s) * caps[s.name]
    grew = True
    while grew:
        grew = False
        for s in on_cpu:
            if caps[s.name] < s.autoscaling.max_replicas and spare >= cost(s):
                caps[s.name] += 1
                spare -= cost(s)
                grew = True


def use_token_auth(environ=os.environ) -> None:
    """Before a client connects to a cluster we did not start: Ray 2.60 clusters want a token, which Ray's
    client side reads from RAY_AUTH_TOKEN, else the file at RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token, but
    only with RAY_AUTH_MODE=token (which `ray.init` sets by itself for address "auto" alone). Sets the mode
    whenever a token exists and the user chose none; Ray (imported with this module) reads its config again."""
    path = Path(environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    if "RAY_AUTH_MODE" not in environ and (environ.get("RAY_AUTH_TOKEN") or path.is_file()):
        environ["RAY_AUTH_MODE"] = "token"
        if environ is os.environ:
            ray._raylet.Config.initialize("")        # Ray read RAY_AUTH_MODE when it was first imported


def auth_token_path() -> Path:
    """Where Ray keeps the cluster token that CLI clients need (RAY_AUTH_MODE=token)."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token")).expanduser()
