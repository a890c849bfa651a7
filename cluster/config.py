"""`ray_config.yaml` -> a validated DeploymentConfig (pydantic). One error lists every problem with its path.

Relative paths in the file are resolved against the file's own folder, so a config works from any cwd.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster import placement
from cluster.calibration_settings import PAIR_DATA, CalibrationSettings
from scd.online import shapes
from scd.settings import CalibConfig

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class ConfigError(ValueError):
    """A config file that cannot be used; the message lists every problem as `path.in.file: reason`."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RaySettings(_Strict):
    address: str = Field("", description="Ray address to join (`auto`: the cluster `ray start` runs on this "
                         "machine); empty: $RAY_ADDRESS where set (inside a Ray Job), else an embedded local cluster")
    namespace: str = Field("scd", description="Ray namespace of the named actors and jobs")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the embedded cluster (default: all)")
    num_gpus: int | None = Field(None, ge=0, description="GPUs of the embedded cluster (default: detected)")
    cores: int | None = Field(None, ge=1, description="the real cores the embedded cluster's model processes share "
                              "(default: this machine's); autoscaling adds a CPU specialist's replica only while "
                              "they hold its engine beyond the producers and every specialist's first replicas")
    dashboard_port: int | None = Field(None, ge=1, le=65535, description="the embedded cluster's dashboard (the "
                                       "Jobs API that `ray job submit` talks to) on this port; null: no dashboard")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="Ray's and Ray Serve's own log lines (the cluster's start, Serve's controller, HTTP "
                               "proxy and replicas; terminal and Serve's log files) at this level and up: INFO "
                               "shows each deployment step; telemetry.access_log logs Serve at INFO")


class ModelSettings(_Strict):
    name: str = Field(pattern=NAME, description="short name used in URLs, pair ids and artifact refs")
    path: str = Field(description="local HF model folder (config.json, weights, tokenizer), or a PEFT adapter "
                      "folder merged into its base at load; relative to the config file's folder; or "
                      "shape://NAME[?seed=N], a timing model of a real architecture's shape with random weights "
                      "(scd/online/shapes.py: tiny, llama-3.2-1b, llama-3.1-8b): its answers say timing_only")
    base: str | None = Field(None, description="an adapter's base model folder, relative to the config file's "
                             "folder; default: the folder its adapter_config.json names (base_model_name_or_path)")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica; 0 runs on CPU")
    num_cpus: float = Field(1, gt=0, description="logical CPUs per replica when it runs on CPU")
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "Ray custom resources per replica, {name: amount}: it runs only on nodes started with them "
        "(`ray start --resources`, a node type's `resources` in a `ray up` file)"))
    node_labels: dict[str, str] = Field(default_factory=dict, description=(
        "Ray label selector, {key: value}: it runs only on nodes whose labels match (`ray start --labels`, a "
        "node type's `labels`); a value may be `v`, `!v`, `in(a,b)` or `!in(a,b)`"))

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        return placement.check_resources(v)

    @field_validator("node_labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return placement.check_labels(v)


class _ReplicaRange(_Strict):
    """min_replicas .. max_replicas, in order (each subclass declares both, with its own defaults)."""

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        return self


class Autoscaling(_ReplicaRange):
    min_replicas: int = Field(1, ge=0, description="fewest replicas (0: none while idle; it starts with one)")
    max_replicas: int = Field(1, ge=1, description="most replicas")
    target_ongoing_requests: float = Field(2.0, gt=0, description="requests each replica should hold on average; "
                                           "more adds replicas (Serve's autoscaling)")
    upscale_delay_s: float = Field(2.0, ge=0, description="how long more replicas must be wanted before one is added")
    downscale_delay_s: float = Field(10.0, ge=0, description="how long fewer replicas must be wanted before one "
                                                             "is removed")
    look_back_period_s: float = Field(30.0, gt=0, description="the window Serve averages each replica's ongoing "
                                      "requests over before it decides, longer than Serve's metrics interval (10 s, "
                                      "or $RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S) (shorter: replicas "
                                      "follow a burst's end sooner; longer: they ride out a lull)")
    max_replicas_per_node: int | None = Field(None, ge=1, le=100, description=(
        "most replicas on one node (Serve's max_replicas_per_node): 1 puts each on a node of its own, so that a "
        "node's failure takes one of them; a replica with no node left to take it waits for one to join. "
        "default: no limit"))

    @model_validator(mode="after")
    def _window(self):
        every = serve_metrics_interval_s()
        if self.look_back_period_s <= every:
            raise ValueError(f"look_back_period_s ({self.look_back_period_s:g}) must be longer than Serve's metrics "
                             f"interval ({every:g} s): the window would hold no measurement")
        return self


def serve_metrics_interval_s() -> float:
    """How often Serve's handles push the ongoing requests autoscaling averages (its own setting, 10 s unless
    $RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S says otherwise)."""
    try:
        return float(os.environ.get("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", 10.0))
    except ValueError:
        return 10.0


class ProducerAutoscaling(_ReplicaRange):
    """Producers added and removed from their prefill load, as Serve scales specialists from their queues."""
    min_replicas: int = Field(1, ge=1, description="fewest producers")
    max_replicas: int = Field(2, ge=1, description="most producers")
    target_busy: float = Field(0.7, gt=0, le=1, description="the fraction of its time each producer should spend "
                               "prefilling and encoding (averaged over 10 s); more in total adds producers")
    upscale_delay_s: float = Field(5.0, ge=0, description="how long more producers must be wanted before one is "
                                                           "added")
    downscale_delay_s: float = Field(30.0, ge=0, description="how long fewer producers must be wanted before one "
                                                             "is removed")


class ProducerSettings(ModelSettings):
    replicas: int = Field(1, ge=1, le=64, description="producers in the pool, each with the same model and "
                          "artifact versions; the router sends each prefix to the one that owns it on a hash ring")
    autoscaling: ProducerAutoscaling | None = Field(None, description="between min_replicas and max_replicas "
                                                    "from the producers' load (replicas: the initial count)")
    load_bound: float = Field(1.25, gt=1, description="a producer holding more than this times the average of "
                              "the encodes in flight, plus load_slack, is passed over for the next on the ring "
                              "(bounded loads)")
    load_slack: int = Field(2, ge=0, description="encodes a producer may hold beyond load_bound x average before "
                            "a prefix it owns goes elsewhere (where its cache misses: a prefill)")
    cache_mb: int | None = Field(None, ge=0, description="the prefix code cache of each producer, MiB (a payload "
                                 "larger than it is never cached); default: 64 on a CPU, 2048 on a GPU, where an "
                                 "8B model's codes of a 4k-token prefix are about 50 MB")
    stage_mb: int | None = Field(None, ge=1, description="payloads each producer holds until the replicas pull "
                                 "them (nixl, cuda_ipc), MiB; past it the oldest go and their replicas fall back "
                                 "(transport_error); default: 256 on a CPU, 4096 on a GPU")

    def memory_bytes(self) -> tuple[int, int]:
        """(prefix code cache, staging) in bytes, the defaults by where the producer runs."""
        gpu = self.num_gpus > 0
        cache = self.cache_mb if self.cache_mb is not None else (2048 if gpu else 64)
        stage = self.stage_mb if self.stage_mb is not None else (4096 if gpu else 256)
        return cache << 20, stage << 20

    def initial_replicas(self) -> int:
        a = self.autoscaling
        return self.replicas if a is None else min(max(self.replicas, a.min_replicas), a.max_replicas)


class SpecialistSettings(ModelSettings):
    artifact: str = Field("latest", description="artifact version of the producer->this pair, or 'latest'")
    exact: bool = Field(False, description="answer requests that do not say (`exact`) in exact mode: the "
                                          "specialist's own output, codes only drafting it")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, description="this specialist's replicas, "
                                     "scaled by Serve from the requests they hold")
    link_gbps: float | None = Field(None, gt=0, description="bandwidth from the producer to this specialist "
                                                            "(Gbps); default: link.bandwidth_gbps")
    group: str | None = Field(None, pattern=NAME, description=(
        "a LoRA group to serve this specialist in (its path a PEFT LoRA or aLoRA of the producer's model): one "
        "engine holds the base once and every member's adapter unmerged, runs a prefix's base layers once for "
        "all members, no codes sent, and decodes their rows in one batch (docs/lora-groups.md); the group's "
        "replicas take their first member's placement and autoscaling"))
    calibration: dict[str, object] = Field(default_factory=dict, description=(
        "this pair's own values of the `calibration:` section's keys marked per pair: every fit setting "
        "(scd.settings.CalibConfig, e.g. more Patch layers for a specialist whose gap sits in a few layers), its own "
        "`text_file`, quality bound and plan settings (PAIR_DATA); the rest come from that section"))


class FamilySettings(_Strict):
    """One code for several specialists (`python -m jobs.family --publish`): a fan-out whose specialists are all
    members of this family gets one payload, encoded once; each member's replicas rebuild it with their own
    decoders. Its members are the ones its artifact was fitted for."""
    name: str = Field(pattern=NAME, description="the family's name: its artifact is PRODUCER:NAME")
    artifact: str = Field("latest", description="artifact version of the family, or 'latest'")


class LinkSettings(_Strict):
    """Ranks chosen per link: with a bandwidth and a TTFT target, the producer sends each specialist the
    largest of its artifact's nested code levels that arrives within the target (scd.online.links)."""
    bandwidth_gbps: float | None = Field(None, gt=0, description="bandwidth from the producer to the specialists "
                                                                 "(Gbps), unless a specialist sets link_gbps")
    ttft_target_ms: float | None = Field(None, gt=0, description=(
        "the codes should reach a specialist this long after the producer starts on the request (its prefill "
        "and encode count); unset: every code at its artifact's full ranks"))


class HttpSettings(_Strict):
    host: str = Field("127.0.0.1", description="bind address of the HTTP proxy")
    port: int = Field(8000, ge=1, le=65535, description="port of the HTTP proxy")

    def is_loopback(self) -> bool:
        import ipaddress
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:                                   # a host name: only localhost is known to be local
            return False


class AuthSettings(_Strict):
    """Like vLLM's --api-key: when a key is set, every endpoint but /healthz needs `Authorization: Bearer KEY`."""
    api_key: str | None = Field(None, min_length=8, description="the key itself (prefer api_key_env)")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="name of an environment variable holding the key")
    allow_unauthenticated: bool = Field(False, description="serve a non-loopback address without a key anyway")

    @model_validator(mode="after")
    def _one_source(self):
        if self.api_key and self.api_key_env:
            raise ValueError("set api_key or api_key_env, not both")
        return self

    def key(self) -> str | None:
        """The key in effect (read from the environment now, for api_key_env); None means no auth."""
        if self.api_key_env:
            import os
            value = os.environ.get(self.api_key_env, "")
            if not value:
                raise ConfigError(f"auth.api_key_env names ${self.api_key_env}, which is not set or empty")
            if len(value) < 8:
                raise ConfigError(f"${self.api_key_env} holds a key of {len(value)} characters; use at least 8")
            return value
        return self.api_key


class LimitSettings(_Strict):
    """Every request and every remote call is bounded; overload answers 503 with Retry-After."""
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest HTTP request body")
    max_input_tokens: int | None = Field(None, ge=2, description="prefix + prompt tokens per request "
                                                                 "(default and upper bound: the model's context)")
    max_tokens: int = Field(512, ge=1, description="largest max_tokens a request may ask for")
    max_fanout: int = Field(8, ge=1, description="most items in one /v1/fanout")
    request_timeout_s: float = Field(120.0, gt=0, description="a specialist call (whole answer) gives up after this")
    first_token_timeout_s: float = Field(60.0, gt=0, description="a stream gives up when no token came for this long")
    control_timeout_s: float = Field(5.0, gt=0, description="status/tokenize/register calls give up after this")
    router_replicas: int = Field(1, ge=1, description="replicas of the router, which admits requests and calls "
                                                       "the producer and the specialists")
    router_max_ongoing: int = Field(64, ge=1, description="requests a router replica answers at once; beyond, "
                                                          "503 with Retry-After")
    specialist_max_ongoing: int = Field(4, ge=1, description="requests one specialist replica runs at once; "
                                        "their decode steps run as one batch")
    specialist_max_queued: int = Field(32, ge=0, description="requests waiting for a specialist's replicas; beyond, "
                                                             "503 with Retry-After")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of an overload 503")
    producer_retry_s: float = Field(2.0, ge=0, description="after the producer failed, requests fall back at once "
                                                           "for this long before it is asked again")


class ArtifactSettings(_Strict):
    uri: str = Field("runs/artifacts", description="artifact store: local path (relative to the config file's "
                     "folder) or pyarrow URI (s3://, gs://, hdfs://)")
    watch_s: float = Field(10.0, ge=0, description="the producer checks for newly published versions this often "
                                                   "and renews its leases on the versions it serves (0 = never)")


class TelemetrySettings(_Strict):
    exporter: Literal["none", "console", "file", "otlp"] = Field("none", description="where request spans go: "
                                                              "nowhere, stdout, a file (path), a collector (endpoint)")
    path: str | None = Field(None, description="file exporter: where spans are appended (JSON lines), by every "
                             "process that records them; taken as given, not against the config's folder")
    endpoint: str | None = Field(None, description="otlp exporter: collector endpoint")
    access_log: bool = Field(False, description="Serve's log line per request in every replica (shipped to the "
                             "driver's terminal: CPU on a small machine); metrics and spans count requests anyway")

    @model_validator(mode="after")
    def _needs(self):
        if self.exporter == "file" and not self.path:
            raise ValueError("exporter 'file' needs a path")
        if self.exporter == "otlp" and not self.endpoint:
            raise ValueError("exporter 'otlp' needs an endpoint")
        return self


class DeploymentConfig(_Strict):
    ray: RaySettings = Field(default_factory=RaySettings, description="the Ray cluster to join or start")
    producer: ProducerSettings = Field(description="the base model: it prefills each prefix once and sends codes")
    specialists: list[SpecialistSettings] = Field(min_length=1, description=(
        "the fine-tuned models served from the producer's codes, each a Serve deployment"))
    families: list[FamilySettings] = Field(default_factory=list, description=(
        "families of specialists that share one code (python -m jobs.family --publish); a fan-out to members "
        "of one family sends one payload, any other request each pair's own"))
    transport: Literal["auto", "object_store", "nixl", "cuda_ipc"] = Field(
        "auto", description="how codes travel: auto (nixl when every model has a GPU, else object_store) | "
                            "object_store | nixl (Ray Direct Transport: each replica pulls its payload from the "
                            "producer, CPU or GPU; on GPUs the codes stay in device memory) | cuda_ipc (the "
                            "same pulls for models that share one GPU)")
    transport_inline_bytes: int = Field(64 << 10, ge=0, le=1 << 20, description=(
        "a payload of at most this many bytes rides in its ticket as host bytes on every transport (no put, no "
        "pull: a pull costs a Ray round trip to the producer, 2.5-6 ms on a GPU machine); 0: every payload "
        "travels by the transport itself"))
    producer_timeout_s: float = Field(10.0, gt=0, description="router waits this long for codes, then the "
                                                                "specialists prefill themselves (fallback); an encode "
                                                                "the producer has begun by then is waited for up to "
                                                                "this long again")
    http: HttpSettings = Field(default_factory=HttpSettings, description="where the HTTP API listens")
    auth: AuthSettings = Field(default_factory=AuthSettings, description="the API key, if any")
    limits: LimitSettings = Field(default_factory=LimitSettings, description="bounds on requests and remote calls")
    artifacts: ArtifactSettings = Field(default_factory=ArtifactSettings, description="the artifact store")
    link: LinkSettings = Field(default_factory=LinkSettings, description="code levels chosen per link")
    calibration: CalibrationSettings = Field(default_factory=CalibrationSettings, description=(
        "how pairs are calibrated: every fit setting, the quality gate, plans, checkpoints"))
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings, description="where request spans go")

    @model_validator(mode="after")
    def _unique(self):
        names = [s.name for s in self.specialists]
        dup = sorted({n for n in names if names.count(n) > 1} | ({self.producer.name} & set(names)))
        if dup:
            raise ValueError(f"model names must be unique across producer and specialists: {dup}")
        fams = [f.name for f in self.families]
        dup = sorted({n for n in fams if fams.count(n) > 1} | (set(fams) & {self.producer.name, *names}))
        if dup:
            raise ValueError(f"family names must be unique and differ from every model's name: {dup}")
        return self

    @model_validator(mode="after")
    def _groups(self):
        """A LoRA group's members share its engine: they are adapters (not timing shapes) placed alike, and a
        group's name is not a model's."""
        for group, members in self.groups().items():
            if group in {self.producer.name, *(s.name for s in self.specialists)}:
                raise ValueError(f"group {group!r}: a group's name must differ from every model's name")
            shaped = [s.name for s in members if shapes.is_shape(s.path)]
            if shaped:
                raise ValueError(f"group {group!r}: {shaped} are timing shapes, not adapters a group can hold")
            first = members[0]
            for s in members[1:]:
                for key in ("num_gpus", "num_cpus", "resources", "node_labels"):
                    if getattr(s, key) != getattr(first, key):
                        raise ValueError(f"group {group!r}: {s.name}'s {key} ({getattr(s, key)!r}) differs from "
                                         f"{first.name}'s ({getattr(first, key)!r}); a group's members run in one "
                                         "engine, placed alike")
        return self

    @model_validator(mode="after")
    def _pair_calibration(self):
        problems = []
        for i, s in enumerate(self.specialists):
            unknown = sorted(set(s.calibration) - set(CalibConfig.model_fields) - PAIR_DATA)
            if unknown:
                problems.append(f"specialists[{i}].calibration: {unknown} are not fit settings "
                                f"(scd.settings.CalibConfig) or {sorted(PAIR_DATA)}")
                continue
            try:
                self.calibration_for(s.name)
            except ValidationError as e:
                problems += [f"specialists[{i}].calibration{'.' + _where(err['loc']) if err['loc'] else ''}: "
                             f"{err['msg']}" for err in e.errors()]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _gpu_transports_need_gpus(self):
        if self.transport == "cuda_ipc":
            cpu = [m.name for m in (self.producer, *self.specialists) if m.num_gpus <= 0]
            if cpu:
                raise ValueError(f"transport {self.transport!r} needs num_gpus > 0 for the producer and every "
                                 f"specialist; on CPU: {cpu} (use 'nixl' or 'object_store')")
        return self

    def resolved_transport(self) -> str:
        """`auto` made concrete: nixl when every model has a GPU (the codes then never leave device memory),
        else object_store (on one CPU node the fastest for payloads of a few MB: docs/results/gpu.md)."""
        if self.transport != "auto":
            return self.transport
        return "nixl" if all(m.num_gpus > 0 for m in (self.producer, *self.specialists)) else "object_store"

    def specialist(self, name: str) -> SpecialistSettings:
        for s in self.specialists:
            if s.name == name:
                return s
        raise KeyError(f"no specialist {name!r}; have {[s.name for s in self.specialists]}")

    def calibration_for(self, name: str) -> CalibrationSettings:
        """The calibration settings of the producer -> `name` pair: the section's, with that specialist's own
        `calibration:` fields over them."""
        own = self.specialist(name).calibration
        if not own:
            return self.calibration
        return CalibrationSettings.model_validate({**self.calibration.model_dump(), **own})

    def groups(self) -> dict[str, list[SpecialistSettings]]:
        """LoRA group name -> its members, in the config's order."""
        out: dict[str, list[SpecialistSettings]] = {}
        for s in self.specialists:
            if s.group:
                out.setdefault(s.group, []).append(s)
        return out

    def engines(self) -> list[tuple[SpecialistSettings, list[SpecialistSettings]]]:
        """The specialists' Serve deployments, (the settings that place and scale one, a LoRA group's members or
        []): one per specialist outside a group, one per group (its first member's settings)."""
        groups = self.groups()
        return [(s, groups[s.group] if s.group else []) for s in self.specialists
                if not s.group or groups[s.group][0] is s]

    def pairs(self) -> list[str]:
        return [f"{self.producer.name}:{s.name}" for s in self.specialists]

    def family_refs(self) -> dict[str, str]:
        """family id (PRODUCER:NAME) -> the version it serves ('latest' or a pinned one)."""
        return {f"{self.producer.name}:{f.name}": f.artifact for f in self.families}

    def link_gbps(self) -> dict[str, float]:
        """pair -> the bandwidth of its link, for the pairs whose bandwidth is known."""
        out = {f"{self.producer.name}:{s.name}": s.link_gbps or self.link.bandwidth_gbps for s in self.specialists}
        return {pair: gbps for pair, gbps in out.items() if gbps}


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def parse(raw: dict, base_dir: str | Path = ".") -> DeploymentConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping at the top level, got {type(raw).__name__}")
    try:
        cfg = DeploymentConfig.model_validate(raw)
    except ValidationError as e:
        lines = [f"  {_where(err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ConfigError(f"{len(lines)} problem(s) in the config:\n" + "\n".join(lines)) from None
    base = Path(base_dir)
    problems = []
    for m in [cfg.producer, *cfg.specialists]:
        if shapes.is_shape(m.path):
            try:
                shapes.parse(m.path)
            except shapes.ShapeError as e:
                problems.append(f"  {m.name}.path: {e}")
            continue
        m.path = str((base / Path(m.path).expanduser()).resolve())
        if m.base is not None:
            m.base = str((base / Path(m.base).expanduser()).resolve())
    if problems:
        raise ConfigError(f"{len(problems)} problem(s) in the config:\n" + "\n".join(problems))
    if "://" not in cfg.artifacts.uri:
        cfg.artifacts.uri = str((base / Path(cfg.artifacts.uri).expanduser()).resolve())
    cfg.calibration.work_dir = str((base / Path(cfg.calibration.work_dir).expanduser()).resolve())
    for where, section in [("calibration", cfg.calibration.__dict__),
                           *((f"specialists.{s.name}.calibration", s.calibration or {}) for s in cfg.specialists)]:
        if section.get("text_file"):
            text = (base / Path(section["text_file"]).expanduser()).resolve()
            if not text.is_file():
                raise ConfigError(f"{where}.text_file: {text} is not a file")
            section["text_file"] = str(text)
    return cfg


def load_config(path: str | Path) -> DeploymentConfig:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None
    return parse(raw, p.resolve().parent)
