"""vLLM's run-time LoRA endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter) beside the router: what they
accept (pure checks of a request against what the deployment serves, each refusal an HTTP 400 naming the field),
and the calibration an adapter loaded at run time gets in the background (docs/lora-groups.md)."""

import logging
import re
from pathlib import Path

import ray

from actors.messages import one_line, pair_id
from cluster.config import NAME
from scd.online.model_files import adapter_problem
from serve_app.errors import ApiError
from serve_app.schemas import LoadLoraRequest

log = logging.getLogger(__name__)


def load_target(body: LoadLoraRequest, served: set[str], groups: list[str], base_folder: str) -> tuple[str, str, str]:
    """(name, group, adapter folder resolved) of a load request, or the ApiError that refuses it. `served`: every
    model name the deployment answers to now (specialists, the base, the groups); `groups`: its LoRA groups, the
    one a request need not name when there is only one; `base_folder`: the producer's model, every group's base."""
    name = body.lora_name
    if body.load_inplace:
        raise ApiError(400, "load_inplace: replacing a loaded adapter is not supported; unload it first",
                       "load_inplace")
    if not re.fullmatch(NAME, name):
        raise ApiError(400, f"lora_name: {name!r} is not a model name ({NAME})", "lora_name")
    if name in served:
        raise ApiError(400, f"lora_name: {name!r} is already served", "lora_name")
    groups = sorted(groups)
    group = body.group or (groups[0] if len(groups) == 1 else None)
    if group not in groups:
        raise ApiError(400, f"group: {body.group!r} is not a LoRA group of this deployment; it has {groups}"
                       if body.group or groups else "no LoRA group is configured (a specialist's `group:`)", "group")
    if problem := adapter_problem(body.lora_path, base_folder):
        raise ApiError(400, f"lora_path: {problem}", "lora_path")
    return name, group, str(Path(body.lora_path).expanduser().resolve())


def unload_check(name: str, loaded: set[str], configured: set[str]) -> None:
    """Refuse (ApiError 400) unloading `name` unless it was loaded at run time (`loaded`); `configured`: the
    specialists of the deployment's config, which stay."""
    if name not in loaded:
        why = "is configured in the deployment's config" if name in configured else "is not loaded"
        raise ApiError(400, f"lora_name: {name!r} {why}; only adapters loaded at run time can be unloaded",
                       "lora_name")


def calibrate(cfg, book, name: str, path: str, timeout_s: float) -> None:
    """Calibrate an adapter loaded at run time as a Ray Job, followed to its end (the group's replicas switch it
    to its artifact once published); the adapter book (`book`, an actor) keeps its job's status, or why there is
    none, for every router's /healthz. Runs in a thread of the router's."""
    from cluster.jobs import calibrate_adapter

    def report(note: str) -> None:
        try:
            ray.get(book.note.remote(name, note), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            log.warning("the adapter book did not take %s's note: %s", name, note)
    try:
        status = calibrate_adapter(cfg, name, path, report)
        log.info("calibrating %s: %s", pair_id(cfg.producer.name, name), status)
    except Exception as e:                  # noqa: BLE001 - the adapter is served all the same, by its own prefill
        report(f"not calibrated: {one_line(e)}")
        log.warning("%s is served by its own prefill, not calibrated: %s", name, one_line(e))
