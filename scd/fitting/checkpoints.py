"""Digests and JSON records of calibration checkpoints: what a stage's checkpoint depends on, and whether a
checkpoint on disk was computed for the same inputs (see scd.fitting.calibrate for the folder layout)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Callable

from scd.online.models import data_digest, weights_digest


# bumped whenever what a checkpoint holds changes shape (e.g. the aligner's layers), so old work directories
# are not resumed into new code
CHECKPOINT_FORMAT = 3
# the CalibConfig fields each stage folder is keyed by (scd.fitting.calibrate's docstring); the plan folder takes the rest
TRACE_FIELDS = ("batch",)
ALIGNER_FIELDS = ("r_h", "ridge", "aligner_width", "aligner_epochs", "aligner_context", "aligner_window",
                  "aligner_tokens", "aligner_loss", "aligner_prefixes", "seed")
TUNE_FIELDS = ("finetune_samples", "finetune_epochs", "finetune_lr", "finetune_encoders", "finetune_tokens")
# fields added after checkpoints existed: left out of the plan folder's key while they keep these values
KEYED_WHEN_SET = {"bigram_table": 0, "bigram_shrink": 16.0, "aligner_prefixes": 0}


def keyed(config: dict, fields) -> dict:
    """The settings among `fields` that a checkpoint folder is keyed by: KEYED_WHEN_SET's only when set."""
    return {k: config[k] for k in fields if not (k in KEYED_WHEN_SET and config[k] == KEYED_WHEN_SET[k])}


def samples_digest(samples) -> str:
    """data_digest of (prefix, continuation) samples, in order."""
    return data_digest([t for s in samples for t in (s.prefix, s.cont)])


def artifact_digest(art, extra: dict | None = None) -> str:
    """sha256 (32 hex) over an artifact's plan, ranks and tensors (names, dtypes, shapes, bytes; sorted by name),
    and `extra` tensors (e.g. entry aligners not inside it): what a held-out evaluation of it depends on, so a
    refitted piece under the same plan (an entry trained anew) is evaluated again, not resumed."""
    desc = {k: v for k, v in art.description().items() if k != "info"}
    tensors = weights_digest({**art.tensors(), **{f"extra.{k}": v for k, v in (extra or {}).items()}})
    return hashlib.sha256(f"{json.dumps(desc, sort_keys=True, default=str)}\n{tensors}".encode()).hexdigest()[:32]


def plan_digest(art) -> str:
    """What a plan's evaluation depends on: artifact_digest, the selector left out unless the plan picks its
    positions by it (tail_rule "learned"), so a refitted selector evaluates only the plans that use it."""
    if art.tail_rule != "learned":
        art = dataclasses.replace(art, selector=None, selector_layers=[])
    return artifact_digest(art)


def key_dir(parent: Path, prefix: str, key: dict) -> Path:
    """parent/<prefix><12 hex of the key>, created, with the key beside its contents (key.json)."""
    d = parent / f"{prefix}{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True))
    return d


def stage_name(path: Path) -> str:
    """What a log line calls the stage of a checkpoint file: its stem, or its folder's name for a record.json."""
    return path.parent.name if path.name == "record.json" else path.stem


def load_record(path: Path, inputs: dict, log: Callable[[str], None] = lambda s: None) -> dict | None:
    """A JSON stage record written by save_record for the same inputs (e.g. sample digests), else None."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    old = record.get("inputs") or {}
    if old != inputs:
        changed = sorted(k for k in set(old) | set(inputs) if old.get(k) != inputs.get(k))
        log(f"stage {stage_name(path)}: checkpoint was computed for other inputs ({', '.join(changed)}); recomputing")
        return None
    return {k: v for k, v in record.items() if k != "inputs"}


def save_record(path: Path, record: dict, inputs: dict) -> dict:
    """Write a JSON stage record with the inputs it depends on, atomically (the file marks the stage done)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**record, "inputs": inputs}, indent=1))
    tmp.replace(path)
    return record
