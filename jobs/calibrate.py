"""Ray Job: calibrate one producer->consumer pair and publish it to the artifact store.

    ray job submit --working-dir . -- python -m jobs.calibrate --pair base:qa
    python -m jobs.calibrate --pair base:qa          # same, on an embedded local Ray

Stages (each checkpointed under calibration.work_dir, so a killed job resubmitted for the same pair
resumes): paired traces from a producer and a consumer TraceActor pinned by num_gpus from the config ->
joint Gram matrices -> layer policy with Patch aligners -> held-out evaluation -> (r_K, r_V) Pareto sweep
-> x_norm layer errors -> report -> publish (manifest written last).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
import yaml
from pydantic import ValidationError
from safetensors.torch import load_file

from artifacts_store import ArtifactNotFound, ArtifactStore, calibration_digest
from cluster.calibration_settings import CalibrationSettings
from cluster.config import load_config
from cluster.runtime import actor_options, connect
from jobs import report
from jobs.measures import curve_tried, entry_curve, error_split, pareto, tradeoff, xnorm_profile
from jobs.plans import block_plan, exact_plan, quality_bound, selector_stage
from jobs.publish import codes_gate, exact_gate, publish_codes, publish_exact, quality_gate
from scd.data import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator, profile_droidspeak
from scd.fitting import exact, points, structure
from scd.fitting.calibrate import LEVEL_RULE, CalibConfig, Calibration
from scd.fitting.checkpoints import load_record, plan_digest, samples_digest, save_record
from scd.online.artifacts import level_tag
from scd.online.model_files import is_adapter
from scd.online.models import load_pair

STRUCTURE_NOISE = 1e-3          # the most a shared layer's K, V or residual may differ, run by both models
HELD_OUT_CURVE = "each entry beside droidspeak@entry"   # what a block plan's held-out curve holds (a changed
                                                        # curve publishes again, from the checkpoints)


def log(msg: str) -> None:
    print(f"[calibrate] {msg}", flush=True)


def checkpointed(path: Path, compute, samples_, art_digest: str | None = None):
    """JSON stage checkpoint of a result computed on `samples_` (and, given its digest, of one artifact):
    loaded if present for the same inputs, else computed, written, returned."""
    inputs = {"samples": samples_digest(samples_), **({"artifact": art_digest} if art_digest else {})}
    record = load_record(path, inputs, log)
    if record is not None:
        log(f"stage {path.stem}: resumed from checkpoint")
        return record["value"]
    return save_record(path, {"value": compute()}, inputs)["value"]


@dataclass
class PairJob:
    """What every stage of one pair's calibration reads: its settings, models and samples (in `cal`), the
    store it publishes to, and the key a finished publication is recorded under."""
    pair: str                   # PRODUCER:CONSUMER
    cfg: object                 # the loaded config (cluster.config)
    member: object              # the consumer's settings in it
    c: object                   # the pair's calibration settings
    cal: Calibration            # the models, their spec, the calibration prefixes and the checkpoint folder
    tok: object
    calib: list                 # calibration, validation and held-out samples
    val: list
    held: list
    store: ArtifactStore
    store_uri: str
    publish_key: dict           # what `published` must hold for the pair to count as published
    no_actors: bool             # trace in this process
    t0: float                   # when the job started

    @property
    def published(self) -> Path:
        """The record of this pair's publication to the job's store: one per store, so that jobs publishing
        from the same checkpoints to different stores do not overwrite each other's."""
        return self.cal.dir / f"published-{hashlib.sha256(self.store_uri.encode()).hexdigest()[:12]}.json"


@dataclass
class Fitted:
    """A plan fitted over codes: what the codes stages publish, and the names of its checkpoints."""
    art: object                 # the plan (PairArtifacts)
    codes: object               # the codes alone it was built on (its block's and tails' curve starts there)
    tag: str                    # names its held-out checkpoints: its blocks, tail and level when below its ranks
    digest: str                 # a plan refitted under the same tag is evaluated again


def main(argv: list[str] | None = None) -> str:
    t0 = time.time()
    job = prepare(parse_args(argv), t0)
    if ref := already_published(job):
        return ref
    capture_pair = tracers(job)
    found, shared = shared_layers(job)
    if ref := exact_stage(job, found, shared):
        return ref
    fit = fit_codes(job, capture_pair, shared)
    rows = evaluate_held_out(job, fit)
    gate = codes_gate(job, rows, log)
    rows, vs_ds = weigh(job, fit, rows)
    rate_levels(job, fit.art, rows)
    diagnosed = diagnose(job, fit)
    return publish_codes(job, fit, rows, gate, vs_ds, diagnosed, found, shared, log)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jobs.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", required=True, help="PRODUCER:CONSUMER, names from the config")
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--store", help="artifact store URI (default: the config's artifacts.uri)")
    p.add_argument("--work-dir", help="checkpoint folder (default: the config's calibration.work_dir)")
    p.add_argument("--prefixes", type=int, help="override calibration.prefixes (e.g. a reduced test budget)")
    p.add_argument("--heldout", type=int, help="override calibration.heldout")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override one calibration setting (a key of the config's calibration: section, the value "
                        "as YAML), e.g. --set finetune_samples=0; repeatable")
    p.add_argument("--no-actors", action="store_true", help="trace in this process instead of two Ray actors")
    p.add_argument("--adapter", metavar="PATH",
                   help="the consumer is this PEFT adapter of the producer's model, named by --pair, instead of a "
                        "specialist of the config (an adapter loaded into a LoRA group at run time); it takes the "
                        "config's calibration settings")
    args = p.parse_args(argv)
    for flag in ("prefixes", "heldout"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    return args


def with_overrides(c: CalibrationSettings, overrides: list[str]) -> CalibrationSettings:
    """The settings with each KEY=VALUE of --set over them, validated as the config's are."""
    update = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in CalibrationSettings.model_fields:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY a calibration setting "
                             f"(docs/config-reference.md), e.g. --set finetune_samples=0")
        update[key] = yaml.safe_load(value)
    try:
        return CalibrationSettings.model_validate({**c.model_dump(), **update})
    except ValidationError as e:
        raise SystemExit(f"--set: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None


def with_adapter(cfg, name: str, path: str):
    """The config with one more specialist, `name`, the PEFT adapter of the producer's model at `path`."""
    from cluster.config import SpecialistSettings
    from scd.online.model_files import adapter_problem
    if name in [s.name for s in cfg.specialists]:
        raise SystemExit(f"--adapter: {name!r} is a specialist of the config already; leave --adapter out")
    if problem := adapter_problem(path, cfg.producer.path):
        raise SystemExit(f"--adapter: {problem}")
    member = SpecialistSettings(name=name, path=str(Path(path).expanduser().resolve()))
    return cfg.model_copy(update={"specialists": [*cfg.specialists, member]})


def prepare(args: argparse.Namespace, t0: float) -> PairJob:
    """The pair's settings from the config (a pair it does not name is refused), its models, its samples, its
    checkpoint folder, and the key its publication is recorded under."""
    cfg = load_config(args.config)
    if args.pair.count(":") != 1:
        raise SystemExit(f"--pair must look like PRODUCER:CONSUMER, got {args.pair!r}")
    prod_name, cons_name = args.pair.split(":")
    if prod_name != cfg.producer.name:
        raise SystemExit(f"producer {prod_name!r} is not the config's producer {cfg.producer.name!r}")
    if args.adapter:
        cfg = with_adapter(cfg, cons_name, args.adapter)
    try:
        member = cfg.specialist(cons_name)
    except KeyError as e:
        raise SystemExit(str(e.args[0])) from None
    c = with_overrides(cfg.calibration_for(cons_name), args.overrides)
    n_prefixes, n_held = args.prefixes or c.prefixes, args.heldout or c.heldout
    store = ArtifactStore(args.store or cfg.artifacts.uri)

    torch.manual_seed(0)
    producer, consumer, tok, spec = load_pair(cfg.producer.path, member.path, consumer_base=member.base)
    calib, val, held = samples.pair_data(cons_name, tok, n_prefixes, c.val, n_held, c.prefix_tokens,
                                         text_file=c.text_file)
    ccfg = CalibConfig.of(c)
    cal = Calibration(producer, consumer, spec, args.pair, calib, args.work_dir or c.work_dir, ccfg,
                      pad_id=tok.pad_token_id, log=log)
    log(f"pair {args.pair}: {len(calib)} calibration prefixes, {len(val)} validation, {len(held)} held-out; "
        f"checkpoints in {cal.dir}")
    store_uri = args.store or cfg.artifacts.uri
    # published to this store after an evaluation on these held-out samples: nothing left (another store or
    # other held-out samples: evaluate and publish again, from the checkpoints)
    # (and served at the level the level stage chooses now: a changed rule publishes again; a changed quality
    # bound chooses the plan again from the checkpointed curves and publishes what it chooses)
    publish_key = {"store": store_uri, "heldout": samples_digest(held), "level": ccfg.choose_level and LEVEL_RULE,
                   "bound": vars(quality_bound(c)), "curve": HELD_OUT_CURVE,
                   **({"entries": c.entries} if c.entries else {}), **({"tails": c.tails} if c.tails else {})}
    return PairJob(args.pair, cfg, member, c, cal, tok, calib, val, held, store, store_uri, publish_key,
                   args.no_actors, t0)


def already_published(job: PairJob) -> str | None:
    """The ref this pair was published as under the job's publish key, if it was and the store still holds it
    (a version removed since, or a store emptied at the same URI, is published again from the checkpoints)."""
    ref = (load_record(job.published, job.publish_key) or {}).get("ref")
    if not ref:
        return None
    try:
        job.store.resolve(ref)
    except ArtifactNotFound:
        log(f"published as {ref}, which the store no longer holds: publishing again")
        return None
    log(f"already published as {ref}; nothing to do")
    return ref


def tracers(job: PairJob):
    """capture_pair backed by two TraceActors on the config's cluster, or None: trace in this process
    (--no-actors)."""
    if job.no_actors:
        return None
    connect(job.cfg.ray, logging_level="WARNING")      # not Ray's two lines on joining the cluster in the job's log
    return actor_capture(job.cfg.producer.path, job.member.path, (job.cfg.producer.num_gpus, job.member.num_gpus),
                         job.member.base)


def actor_capture(producer_path: str, consumer_path: str, gpus: tuple[float, float], consumer_base: str | None = None):
    """capture_pair backed by two TraceActors; both models run on each batch concurrently. The actors start
    at the first capture: a job whose traces are checkpointed already starts none."""
    from actors.tracer import TraceActor
    actors = []

    def capture_pair(ids, mask):
        if not actors:
            actors.extend([TraceActor.options(**actor_options(gpus[0])).remote(producer_path, "a"),
                           TraceActor.options(**actor_options(gpus[1])).remote(consumer_path, "b", consumer_base)])
            log(f"trace actors on {ray.get(actors[0].where.remote())} (producer) and "
                f"{ray.get(actors[1].where.remote())} (consumer)")
        a, b = actors
        return tuple(ray.get([a.rows.remote(ids, mask), b.rows.remote(ids, mask)]))
    return capture_pair


def shared_layers(job: PairJob):
    """What the consumer shares exactly with the producer (scd.fitting.structure), verified on the validation
    prefixes: (the finding, its record with the largest difference seen)."""
    found, shared = structure.measured(job.cal.producer, job.cal.consumer, [v.prefix for v in job.val],
                                       job.tok.pad_token_id, job.member.path if is_adapter(job.member.path) else None)
    log(f"structure: {found.describe()}; verified on {len(job.val)} validation prefixes, max |difference| "
        f"{shared['verified_max_abs']:.2e}")
    return found, shared


def exact_stage(job: PairJob, found, shared: dict) -> str | None:
    """Where the consumer shares layers with the producer (within STRUCTURE_NOISE), the exact plan chosen under
    the bound, evaluated, gated and published: its ref. None where there is none, or none meets the bound
    (then codes are fitted)."""
    c, cal = job.c, job.cal
    if not (c.exact_plans and found.exact_plan and shared["verified_max_abs"] <= STRUCTURE_NOISE):
        return None
    codes = exact.klt_codecs(cal.producer, cal.prefixes, cal.spec.num_layers, c.exact_step) \
        if "klt" in exact.wire_forms(c.exact_dtype) else None
    chosen = exact_plan(cal, job.tok, found, job.val, c, job.cfg.link_gbps().get(job.pair), log, codes)
    if chosen is None:
        log("fitting codes instead")
        return None
    art = exact_artifact(job, chosen, shared, codes)
    rows = evaluate_exact(job, art, chosen)
    gate = exact_gate(job, rows, log)
    return publish_exact(job, art, chosen, rows, gate, found, shared, log)


def exact_artifact(job: PairJob, chosen: dict, shared: dict, klt_codes=None):
    """The chosen exact plan as an artifact (scd.fitting.exact.artifact), with what it was chosen on."""
    c, val = job.c, job.val
    digest = calibration_digest([v.prefix for v in val])           # what the plan was chosen on
    dtype = chosen["chosen"].get("dtype", c.exact_dtype)
    art = exact.artifact(job.pair, job.cal.spec, chosen["chosen"]["entry"], dtype,
                         {"structure": shared, "exact": chosen, "calibration": {
                             "prefixes": len(val), "rows": 0, "data_digest": digest, "config": c.model_dump()}},
                         whole_prefix=shared["invocation_tokens"] is not None, klt_codes=klt_codes)
    log(f"plan {art.plan}")
    return art


def evaluate_exact(job: PairJob, art, chosen: dict) -> list[dict]:
    """The exact plan's held-out rows beside the oracle, the base alone, raw KV and DroidSpeak at its best
    block (chosen on the validation samples)."""
    c, cal = job.c, job.cal
    producer, consumer = cal.producer, cal.consumer
    ds = methods.DroidSpeak()

    def evaluate():
        ds.start = profile_droidspeak(ds, producer, consumer, job.val)
        ms = [methods.Oracle(), methods.BaseAlone(producer), methods.RawKV(), ds, methods.SCDMethod(art)]
        return Evaluator(producer, consumer, job.tok).run(job.held, ms, desc=f"held-out {job.pair}")
    dtype, entry = chosen["chosen"].get("dtype", c.exact_dtype), chosen["chosen"]["entry"]
    rows = checkpointed(cal.trace_dir / f"exact-{dtype}{c.exact_step:g}-e{entry}-eval.json", evaluate, job.held)
    by = {r["method"]: r for r in rows}
    log("held-out: " + ", ".join(f"{m} kl={r['kl']:.4f} ratio={r['payload_ratio']:.3f}" for m, r in by.items()))
    return rows


def fit_codes(job: PairJob, capture_pair, shared: dict) -> Fitted:
    """Codes fitted on the calibration prefixes (traces, Grams, ranks, the layer policy and its fine-tuning:
    scd.fitting.calibrate), then, with calibration.recompute_blocks, a recompute block or a tail over them
    where they alone miss the bound (jobs.plans.block_plan)."""
    c, cal, tok = job.c, job.cal, job.tok
    cons_name = job.pair.split(":")[1]
    tune = samples.tune_samples(cons_name, tok, c.finetune_samples, c.prefix_tokens, c.finetune_tokens,
                                text_file=c.text_file)
    art = codes = cal.run(job.val, capture_pair, tune)
    art.info["structure"] = shared
    art = codes = selector_stage(cal, art, tok, c, tune, log, c.text_file)
    if c.recompute_blocks:
        art = block_plan(cal, art, tok, job.calib, job.val, c, job.cfg.link_gbps().get(job.pair), log, tune)
    log(f"plan {art.plan}")
    return Fitted(art, codes, held_out_tag(art), plan_digest(art))


def held_out_tag(art) -> str:
    """The held-out checkpoints' suffix of a plan with a block or a tail, or served at a level below its
    fitted ranks; "" for the codes at their full ranks."""
    mark = {"last": "t", "attention": "s", "learned": "l", "suffix": "r"}[art.tail_rule]
    tag = "".join(f"-e{e}" + (f"s{s}" if s < art.spec.num_layers else "") for e, s in art.blocks)
    tag += f"-{mark}{art.tail_tokens}" if art.tail_tokens else ""
    level = art.info.get("level")
    if level and level["chosen"] != {k: level["tried"][-1][k] for k in level["chosen"]}:
        tag += "-" + level_tag(level["chosen"])
    return tag


def evaluate_held_out(job: PairJob, fit: Fitted) -> list[dict]:
    """The plan's held-out rows beside the oracle, the base alone, raw KV and its Reuse-only codes."""
    cal, art = job.cal, fit.art

    def evaluate():
        ms = [methods.Oracle(), methods.BaseAlone(cal.producer), methods.RawKV(), methods.reuse_only(art),
              methods.SCDMethod(art)]
        return Evaluator(cal.producer, cal.consumer, job.tok).run(job.held, ms, desc=f"held-out {job.pair}")
    rows = checkpointed(cal.dir / f"eval{fit.tag}.json", evaluate, job.held, fit.digest)
    by = {r["method"]: r for r in rows}
    log("held-out: " + ", ".join(f"{m} kl={r['kl']:.4f} ratio={r['payload_ratio']:.3f}"
                                 + (f" f1={r['f1']:.3f}" if r["f1"] is not None else "") for m, r in by.items()))
    return rows


def weigh(job: PairJob, fit: Fitted, rows: list[dict]) -> tuple[list[dict], dict[str, float]]:
    """What the plan is weighed against, held out: the baselines and its own lower levels, and where the block
    stage measured a curve, that curve beside DroidSpeak at the same consumer compute. Returns every held-out
    row, and per curve point SCD's KL over DroidSpeak's."""
    cal, c, n = job.cal, job.c, job.cal.spec.num_layers
    rows = rows + checkpointed(cal.dir / f"tradeoff{fit.tag}.json",
                               lambda: tradeoff(cal, fit.art, job.tok, job.val, job.held), job.held, fit.digest)
    chosen = points.chosen_name(fit.art.info.get("blocks", {}).get("chosen"), n)
    tried = curve_tried(fit.art.info.get("blocks", {}), n)
    if not tried:
        return rows, {}
    entries = load_file(str(cal.dir / "entry-aligners.safetensors")) if any(p["entry"] < n for p in tried) else {}
    rows += entry_curve(cal, fit.codes, entries, tried, job.tok, job.held, chosen, cal.dir / f"curve{fit.tag}.json",
                        log)
    vs_ds = report.against_droidspeak(rows, chosen, n, c.prefix_tokens)
    log("held-out curve, SCD's KL over DroidSpeak's at the same consumer compute: "
        + ", ".join(f"{name} {v:.2f}" for name, v in vs_ds.items()))
    return rows, vs_ds


def rate_levels(job: PairJob, art, rows: list[dict]) -> None:
    """Every level's held-out figures into art.info["levels"], and whether it passes the same quality gate (a
    link never gets a level known to be worse than raw KV reuse; the full code passed it to be published)."""
    by = {r["method"]: r for r in rows}
    art.info["levels"] = [{**level, "payload_ratio": r["payload_ratio"], "kl": r["kl"],
                           "servable": quality_gate({**by, "scd": r}, job.c)["passed"]}
                          for level, r in ((lv, by[methods.level_name(art, lv)]) for lv in art.levels)]


def diagnose(job: PairJob, fit: Fitted) -> tuple[list[dict] | None, dict | None, dict[str, float]]:
    """With calibration.diagnostics: (the rank Pareto sweep, the x_norm error per layer, where the error
    lives); else (None, None, {})."""
    if not job.c.diagnostics:
        return None, None, {}
    cal, art, val, held = job.cal, fit.art, job.val, job.held
    grid = checkpointed(cal.dir / "pareto.json", lambda: pareto(cal, val), val)
    xn = checkpointed(cal.dir / f"xnorm{fit.tag}.json", lambda: xnorm_profile(cal, art, held[:8]), held[:8], fit.digest)
    split = checkpointed(cal.dir / f"split{fit.tag}.json", lambda: error_split(cal, art, val), val, fit.digest)
    return grid, xn, split


if __name__ == "__main__":
    main()
    sys.exit(0)
