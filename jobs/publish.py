"""The calibration job's last stages: the quality gate on a plan's held-out rows, its report, and its
publication to the artifact store (the manifest last), for an exact plan and for a plan over codes. A refused
plan is recorded in the store (serving falls back, saying quality_gate) and ends the job with exit status 3."""
from __future__ import annotations

import json
import resource
import time
from typing import TYPE_CHECKING, Callable

from artifacts_store import CalibrationData, Fingerprints, calibration_digest
from jobs import report
from scd.fitting import blocks, exact, points
from scd.fitting.checkpoints import save_record
from scd.fitting.exact import LOSSLESS_KL

if TYPE_CHECKING:
    from jobs.calibrate import Fitted, PairJob

Log = Callable[[str], None]


def cost(t0: float) -> dict:
    """Wall time of this job so far and the peak resident memory of its process (trace actors, when used,
    hold their models in their own processes and are not counted)."""
    return {"wall_s": round(time.time() - t0, 1),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def quality_gate(by: dict, c) -> dict:
    """The publish decision from the held-out rows: SCD's KL against raw KV reuse (which costs the consumer
    nothing either, at a payload at least SCD's) times calibration.gate_vs_raw_kv unless it is lossless
    (LOSSLESS_KL), and against the absolute calibration.max_kl. Returns the figures, `passed` and the reasons
    it failed."""
    kl, raw = by["scd"]["kl"], by["raw_kv"]["kl"]
    reasons = []
    # a lossless cache passes whatever raw KV scores (an aLoRA's prefix: raw KV is exact too; a compressed
    # plan is then held to max_kl alone, when set)
    if kl > LOSSLESS_KL and c.gate_vs_raw_kv and kl > c.gate_vs_raw_kv * raw and exact.ratio_applies(raw, c.max_kl):
        reasons.append(f"held-out KL {kl:.4f} is worse than {c.gate_vs_raw_kv:g} x raw KV reuse's {raw:.4f} "
                       f"(payload {by['scd']['payload_ratio']:.3f} vs {by['raw_kv']['payload_ratio']:.3f})")
    if c.max_kl is not None and kl > c.max_kl:
        reasons.append(f"held-out KL {kl:.4f} is above calibration.max_kl {c.max_kl:g}")
    return {"passed": not reasons, "reasons": reasons, "kl_scd": kl, "kl_raw_kv": raw,
            "kl_reuse_only": by.get("reuse_only", {}).get("kl"), "payload_ratio": by["scd"]["payload_ratio"],
            "gate_vs_raw_kv": c.gate_vs_raw_kv, "max_kl": c.max_kl}


def exact_gate(job: PairJob, rows: list[dict], log: Log) -> dict:
    """The quality gate on an exact plan's held-out rows; a refusal is recorded and exits 3."""
    gate = quality_gate({r["method"]: r for r in rows}, job.c) | {"job": cost(job.t0)}
    if not gate["passed"]:
        job.store.refuse(job.pair, gate)
        log(f"quality gate: NOT published ({'; '.join(gate['reasons'])})")
        raise SystemExit(3)
    return gate


def codes_gate(job: PairJob, rows: list[dict], log: Log) -> dict:
    """The quality gate on a plan's held-out rows, written to gate.json beside its checkpoints; a refusal is
    recorded and exits 3."""
    gate = quality_gate({r["method"]: r for r in rows}, job.c) | {"job": cost(job.t0)}
    (job.cal.dir / "gate.json").write_text(json.dumps(gate, indent=1))
    if not gate["passed"]:
        job.store.refuse(job.pair, gate)
        log(f"quality gate: NOT published ({'; '.join(gate['reasons'])}); serving falls back with reason "
            f"quality_gate. Figures in {job.cal.dir / 'gate.json'}")
        raise SystemExit(3)
    log(f"quality gate: passed (KL {gate['kl_scd']:.4f} vs raw KV {gate['kl_raw_kv']:.4f})")
    return gate


def publish_exact(job: PairJob, art, chosen: dict, rows: list[dict], gate: dict, found, shared: dict,
                  log: Log) -> str:
    """Report an exact plan (with its quality-against-compute curve), publish it, and record the publication."""
    c, cal, t0 = job.c, job.cal, job.t0
    by = {r["method"]: r for r in rows}
    entry, dtype = chosen["chosen"]["entry"], chosen["chosen"].get("dtype", c.exact_dtype)
    extra = {"plan": f"exact: the producer's K and V below layer {entry}" + (
                         f", entering at layer {entry}: the consumer runs {art.consumer_layers} of "
                         f"{cal.spec.num_layers} layers" if art.blocks else ", no consumer compute") +
                     f"; {dtype} on the wire" + (f" (step {c.exact_step:g})" if dtype == "klt" else ""),
             "quality bound": f"KL <= {c.max_kl_ratio:g} x raw KV, consumer <= {c.max_consumer_prefill_ratio:g} of a "
                              f"prefill; chosen at the least modeled TTFT at {chosen['gbps']:g} Gbps",
             "quality gate": f"passed: KL {gate['kl_scd']:.2e} <= {c.gate_vs_raw_kv:g} x raw KV "
                             f"{gate['kl_raw_kv']:.4f}",
             "shared with the producer": f"{found.describe()} (verified: max |difference| "
                                         f"{shared['verified_max_abs']:.2e})"}
    files = report.build_report(job.pair, None, rows, extra=extra, compute=chosen)
    metrics = {"kl": by["scd"]["kl"], "kl_raw_kv": by["raw_kv"]["kl"],
               "payload_bytes": float(by["scd"]["payload_bytes"]), "payload_ratio": by["scd"]["payload_ratio"],
               "top1": by["scd"]["top1"], "consumer_prefill_ratio": by["scd"]["prefill_ratio"],
               "gate_vs_raw_kv": c.gate_vs_raw_kv, **{f"job_{k}": v for k, v in cost(t0).items()}}
    if by["scd"].get("retained_gain") is not None:
        metrics["retained_gain"] = by["scd"]["retained_gain"]
    if by["scd"]["f1"] is not None:
        metrics.update(f1=by["scd"]["f1"], f1_oracle=by["oracle"]["f1"], f1_raw_kv=by["raw_kv"]["f1"])
    digest = calibration_digest([v.prefix for v in job.val])           # what the plan was chosen on
    manifest = job.store.publish(art, Fingerprints.of(producer=cal.producer, consumer=cal.consumer, tokenizer=job.tok),
                                 CalibrationData(digest=digest, n_prefixes=len(job.val), rows=0), metrics,
                                 {f"report/{k}": v for k, v in files.items()})
    ref = f"{job.pair}@{manifest.version}"
    save_record(job.published, {"ref": ref}, job.publish_key)
    log(f"published {ref} (exact plan, {cost(t0)['wall_s']:.0f} s)")
    return ref


def codes_extra(job: PairJob, art, gate: dict, split: dict[str, float], vs_ds: dict[str, float], found,
                shared: dict) -> dict[str, object]:
    """A plan over codes: the report's items beside its tables (the codes, their data, the gate, where the
    error lives, what is shared, the ranks tried, the wire, the curve against DroidSpeak, the plan)."""
    c, info = job.c, art.info["calibration"]
    ranks = {"r_x": art.r_x} if art.reuse_x else {"r_k": art.r_k, "r_v": art.r_v}
    extra = {"reuse": "hidden-state (x_norm -> K, V of every head)" if art.reuse_x else "per-head K, V", **ranks,
             "r_h": art.r_h, "calibration prefixes": info["prefixes"],
             "trace rows": info["rows"], "data digest": info["data_digest"],
             "quality gate": f"passed: KL {gate['kl_scd']:.4f} <= {c.gate_vs_raw_kv:g} x raw KV {gate['kl_raw_kv']:.4f}"
             + (f" and <= max_kl {c.max_kl:g}" if c.max_kl is not None else ""),
             "where the error lives (validation KL)": "; ".join(f"{k}: {v:.4f}" for k, v in split.items())
             or "not measured (calibration.diagnostics off)",
             "shared with the producer": f"{found.describe()} (verified: max |difference| "
                                         f"{shared['verified_max_abs']:.2e})"}
    if "ranks" in art.info:
        extra["ranks tried"] = "; ".join(
            ", ".join(f"{k} {v}" for k, v in t.items() if k.startswith("r_")) + f": KL {t['kl']:.4f} @ "
            f"{t['payload_ratio']:.3f}" for t in art.info["ranks"]["tried"])
        if "wire_factor" in art.info["ranks"]:
            extra["wire"] = f"sends {art.info['ranks']['wire_factor']:.3f} of the code bytes (zstd), counted in the budget"
    if vs_ds:
        extra["against DroidSpeak at the same compute (held out)"] = "; ".join(
            f"{name}: {v:.2f} x DroidSpeak's KL" for name, v in vs_ds.items())
    if art.blocks:
        entry, stop = art.blocks[0]
        extra["plan"] = (f"codes below layer {entry}, the consumer's own layers {entry}-{stop - 1} from the producer's "
                         f"residual through an aligner (a recompute block)"
                         f"{blocks.codes_above(stop, job.cal.spec.num_layers)}")
    if art.tail_tokens:
        extra["plan"] = extra.get("plan", "the codes") + (
            f"; the consumer runs {points.tail_phrase(art.tail_tokens, art.tail_rule)} itself through every layer"
            + ("" if art.tail_rule == "last" else " (selective recompute)")
            + (f" (that share of a prefix of {art.tail_of}: {art.tail_tokens / art.tail_of:.3g} of its tokens at "
               f"every length)" if art.tail_of else ""))
    return extra


def publish_codes(job: PairJob, fit: Fitted, rows: list[dict], gate: dict, vs_ds: dict[str, float],
                  diagnosed: tuple, found, shared: dict, log: Log) -> str:
    """Report a plan over codes, publish it, and record the publication under the job's publish key."""
    art, c, cal, t0 = fit.art, job.c, job.cal, job.t0
    grid, xn, split = diagnosed
    by = {r["method"]: r for r in rows}
    extra = codes_extra(job, art, gate, split, vs_ds, found, shared)
    files = report.build_report(job.pair, art.info["policy"], rows, grid, xn, extra, compute=art.info.get("blocks"))
    metrics = {"kl": by["scd"]["kl"], "kl_reuse_only": by["reuse_only"]["kl"], "kl_raw_kv": by["raw_kv"]["kl"],
               "payload_bytes": float(by["scd"]["payload_bytes"]), "payload_ratio": by["scd"]["payload_ratio"],
               "top1": by["scd"]["top1"], "gate_vs_raw_kv": c.gate_vs_raw_kv, **{f"job_{k}": v for k, v in cost(t0).items()}}
    if by["scd"]["f1"] is not None:
        metrics.update(f1=by["scd"]["f1"], f1_oracle=by["oracle"]["f1"], f1_raw_kv=by["raw_kv"]["f1"])
    if by["scd"].get("retained_gain") is not None:            # of the specialist's gain over the base alone
        metrics["retained_gain"] = by["scd"]["retained_gain"]
    manifest = job.store.publish(
        art, Fingerprints.of(producer=cal.producer, consumer=cal.consumer, tokenizer=job.tok),
        CalibrationData(digest=calibration_digest(job.calib), n_prefixes=len(job.calib),
                        rows=art.info["calibration"]["rows"]),
        metrics, {f"report/{k}": v for k, v in files.items()})
    ref = f"{job.pair}@{manifest.version}"
    save_record(job.published, {"ref": ref}, job.publish_key)
    spent = cost(t0)
    log(f"published {ref} to {job.store_uri} ({spent['wall_s']:.0f} s, peak memory "
        f"{spent['peak_rss_gib']:.2f} GiB in this process)")
    return ref
