"""The main job (`make demo`): an embedded local Ray, demo artifacts (calibrated through Ray Jobs when
missing), the Serve app, one fan-out and one request per specialist, TTFT next to the oracle's, shutdown.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

from artifacts_store import ArtifactStore, ArtifactStoreError
from cluster.config import load_config
from scd.data import demo_data
from scd.data.samples import domain
from serve_app.schemas import model_compute_ms, overhead_parts_ms

REPO = Path(__file__).resolve().parents[1]
# The demo calibrates missing pairs at a budget of its own: a quarter of the calibration prefixes, half the
# held-out samples, no end-to-end fine-tuning (on the demo family its gain stays within the noise) and shorter
# Patch aligner training. Every demo pair passes the same quality gate at it. `scd calibrate` and
# `ray job submit` keep the config's full budget.
DEMO_BUDGET = ("prefixes=128", "heldout=8", "finetune_samples=0", "aligner_epochs=40")


class Phases:
    """Wall-clock time of the demo's phases, printed as one line at the end."""

    def __init__(self):
        self.spans: dict[str, float] = {}
        self.t = time.time()
        if t0 := os.environ.get("SCD_DEMO_T0"):     # set by `make demo` before it installs
            self.spans["install"] = self.t - float(t0)

    def done(self, name: str) -> None:
        now = time.time()
        self.spans[name] = self.spans.get(name, 0.0) + now - self.t
        self.t = now

    def line(self) -> str:
        total = sum(self.spans.values())
        return (", ".join(f"{k} {v:.0f} s" for k, v in self.spans.items())
                + f"; total {int(total // 60)} min {total % 60:.0f} s")


def _call(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode() if body else None,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def demo_prompts(tok=None) -> tuple[str, dict[str, str]]:
    """A shared prefix (a fact document) and one suffix per specialist domain. For a family with a chat
    template the prefix is the rendered system turn holding a ~550-token document, and each suffix a
    rendered user turn plus the assistant header; otherwise (the demo family's template is its plain QA text)
    the tiny family's plain text forms."""
    if tok is None or not demo_data.instruct_chat(tok):
        ex = demo_data.qa_examples("heldout", 1, seed=7)[0]
        return ex.document, {"qa": ex.question, "prose": "\nIn short, the", "code": "\ndef "}
    ex = demo_data.qa_examples("heldout", 1, seed=7, people=(15, 15))[0]
    system = [{"role": "system", "content": demo_data.qa_system_prompt(ex.document)}]
    prefix = tok.apply_chat_template(system, tokenize=False)
    asks = {"qa": demo_data.bare_question(ex.question),
            "code": "Write a Python dict that maps each person in the notes to their city."}
    return prefix, {n: tok.apply_chat_template(system + [{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True)[len(prefix):] for n, q in asks.items()}


def breakdown(scd: dict) -> tuple[float, str]:
    """(end-to-end time to first token including the producer's share, the phases as text)."""
    t = scd["timings_ms"]
    keys = ("prefill", "encode", "transfer_put", "transfer", "decode", "rebuild", "patch", "recompute", "tail",
            "first_token")
    e2e = sum(t.get(k, 0.0) for k in ("prefill", "encode", "transfer_put", "transfer")) + t["first_token"] \
        if scd["mode"] == "scd" else t["first_token"]
    return e2e, "  ".join(f"{k}={t[k]:.1f}" for k in keys if k in t)


def overhead(url: str, name: str, prefix: str, prompt: str, n: int = 8) -> str:
    """Medians over n sequential one-token completions of their latency minus their model work, and of
    its parts (serve_app.schemas.overhead_parts_ms), as a line of text."""
    body = {"model": name, "prefix": prefix, "prompt": prompt, "max_tokens": 1}
    total, parts = [], []
    for _ in range(n):
        t = time.perf_counter()
        scd = _call(url + "/v1/completions", body)["scd"]
        latency = (time.perf_counter() - t) * 1e3
        total.append(latency - model_compute_ms([scd]))
        parts.append(overhead_parts_ms(latency, scd))
    return f"median {statistics.median(total):.1f} ms = " + " + ".join(
        f"{k} {statistics.median(p[k] for p in parts):.1f}" for k in parts[0]) + " (medians of each)"


def build_missing_producer(path: str) -> None:
    """A real family's producer folder that is not built yet is built now (`scd fetch-family`), once."""
    from jobs import fetch_family
    from scd.online import shapes
    p = Path(path)
    if shapes.is_shape(path) or (p / "config.json").is_file():
        return
    for name, fam in fetch_family.FAMILIES.items():
        if p.name == fam.folder:
            print(f"building the {name} producer into {p.parent} (first run only)")
            fetch_family.main([name, "--cache", str(p.parent)])
            return
    raise SystemExit(f"producer folder {p} does not exist")


def usable(store: ArtifactStore, pair: str) -> bool:
    """Whether the pair's latest artifact loads in this build (absent, damaged or old-format ones do not)."""
    try:
        store.load(f"{pair}@latest")
    except ArtifactStoreError:
        return False
    return True


def calibrate_missing(cfg, args, jobs_address: str, phases: Phases) -> bool:
    """Calibrate the pairs without a usable artifact (and not refused by the gate) as Ray Jobs, at the demo's
    budget unless --full-budget; say which pairs the gate refused. False when a calibration failed."""
    from cluster.jobs import submit_and_follow
    store = ArtifactStore(cfg.artifacts.uri)
    missing = [pair for pair in cfg.pairs() if not usable(store, pair) and store.refusal(pair) is None]
    if missing:
        budget = [] if args.full_budget else DEMO_BUDGET
        print(f"calibrating {missing} as Ray Jobs (first run only; checkpoints in {cfg.calibration.work_dir}) "
              + (f"at the demo's budget: {', '.join(budget)} over the config's calibration settings "
                 "(`scd calibrate` and `ray job submit` use the config's full budget)" if budget else
                 "at the config's budget"))
        submit_and_follow(jobs_address, missing, args.config, str(REPO),
                          extra=[a for b in budget for a in ("--set", b)])
        phases.done("calibration")
    for pair in cfg.pairs():
        if usable(store, pair):
            continue
        refusal = store.refusal(pair)
        if refusal is None:
            print(f"calibration of {pair} failed; see the job logs above")
            return False
        print(f"{pair}: not published, it failed the quality gate ({'; '.join(refusal['reasons'])}); "
              "its specialist answers with its own prefill (fallback reason quality_gate)")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scd demo", description=__doc__)
    p.add_argument("--config", default=str(REPO / "ray_config.yaml"))
    p.add_argument("--full-budget", action="store_true",
                   help="calibrate missing pairs at the config's budget, not the demo's (" + " ".join(DEMO_BUDGET) + ")")
    args = p.parse_args(argv)
    phases = Phases()
    cfg = load_config(args.config)
    build_missing_producer(cfg.producer.path)
    from scd.online.model_files import load_tokenizer
    tok = load_tokenizer(cfg.producer.path)

    from ray import serve

    from cluster.runtime import connect, name_for_jobs, shutdown, start_local
    from serve_app.app import deploy, wait_healthy

    ctx = start_local(num_cpus=cfg.ray.num_cpus or 8, include_dashboard=True, namespace=cfg.ray.namespace,
                      log_to_driver=False, logging_level=cfg.ray.log_level)
    name_for_jobs()
    phases.done("cluster start")
    try:
        connect(cfg.ray)
        if not calibrate_missing(cfg, args, "http://" + ctx.dashboard_url, phases):
            return 1
        deploy(cfg)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
        wait_healthy(url)
        phases.done("serve start")
        prefix, by_domain = demo_prompts(tok)
        # a specialist asks what its domain's does (code_few: the code request)
        suffixes = {s.name: by_domain[domain(s.name)] for s in cfg.specialists if domain(s.name) in by_domain}
        names = list(suffixes)
        print(f"\nshared prefix ({len(prefix)} chars):\n{prefix}")
        fan = _call(url + "/v1/fanout", {"prefix": prefix, "requests": [
            {"specialist": n, "suffix": suffixes[n], "max_tokens": 16, "stop": ["\n"] if domain(n) == "qa" else []}
            for n in names]})
        print(f"fan-out to {names}: one producer prefill (prefilled={fan['prefilled']})")
        for r in fan["results"]:
            why = f":{r['scd']['reason']}" if r["scd"].get("reason") else ""
            print(f"  {r['specialist']:<6} [{r['scd']['mode']}{why}] {r['text']!r}")
        if demo_data.instruct_chat(tok) and "qa" in names:
            ex = demo_data.qa_examples("heldout", 1, seed=7, people=(15, 15))[0]
            chat = _call(url + "/v1/chat/completions", {"model": "qa", "max_tokens": 16, "messages": [
                {"role": "system", "content": demo_data.qa_system_prompt(ex.document)},
                {"role": "user", "content": demo_data.bare_question(ex.question)}]})
            print(f"\nPOST /v1/chat/completions (qa): {demo_data.bare_question(ex.question)!r} -> "
                  f"{chat['choices'][0]['message']['content']!r} [{chat['scd']['mode']}"
                  f"{':' + chat['scd']['reason'] if chat['scd']['reason'] else ''}] (gold {ex.answer.strip()!r})")
        print("\nper specialist, time to first token (ms): SCD vs the specialist's own prefill (oracle);\n"
              "the SCD requests reuse the prefix's codes from the producer's cache (prefill=0: no new prefill)")
        for n in names:
            body = {"model": n, "prefix": prefix, "prompt": suffixes[n], "max_tokens": 16,
                    "stop": ["\n"] if domain(n) == "qa" else None}
            s, o = _call(url + "/v1/completions", body), _call(url + "/v1/completions", {**body, "oracle": True})
            (se, sp), (oe, op) = breakdown(s["scd"]), breakdown(o["scd"])
            print(f"  {n:<6} scd    ttft={se:7.1f}  {sp}  payload={s['scd']['payload_bytes']}B\n"
                  f"  {'':<6} oracle ttft={oe:7.1f}  {op}\n"
                  f"  {'':<6} answers: scd={s['choices'][0]['text']!r} oracle={o['choices'][0]['text']!r}")
        print(f"\nserving overhead (HTTP in to answer out, minus the model work the answer reports) of "
              f"one-token completions:\n  {overhead(url, names[0], prefix, suffixes[names[0]])}")
        phases.done("fan-out and requests")
        return 0
    finally:
        serve.shutdown()
        shutdown()
        phases.done("shutdown")
        print(f"shut down cleanly\nphases: {phases.line()}")


if __name__ == "__main__":
    raise SystemExit(main())
