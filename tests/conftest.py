"""Shared fixtures: tiny random Llama pairs (seconds on a CPU) and the committed demo family."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo_models"


# the fit settings the tiny models' tests are written for: per-head codes at the given ranks, in fp16, a code per
# layer, no payload budget, Patch codes of rank 32. CalibConfig's defaults are a 100M+ pair's (hidden-state codes
# over groups of 6 layers, ranks chosen under a budget), which a 3-layer model of width 32 has no room for.
TINY_FIT = {"reuse_source": "kv", "payload_budget": 0.0, "code_dtype": "fp16", "x_group": 1, "r_h": 32,
            "patch_cost": 0.25}


TINY_FIT_FLAGS = [f for k, v in TINY_FIT.items() for f in (f"--{k.replace('_', '-')}", str(v))]   # scd eval/bench


def fit_settings(**given):
    """CalibConfig at TINY_FIT, with what `given` sets."""
    from scd.settings import CalibConfig
    return CalibConfig(**{**TINY_FIT, **given})


def tiny_llama(seed: int = 0, layers: int = 3, vocab: int = 97) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return LlamaForCausalLM(cfg).eval()


def perturbed(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A 'fine-tuned' copy: same architecture, every weight moved by relative noise of size `scale`."""
    other = LlamaForCausalLM(model.config).eval()
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    return other


@pytest.fixture(scope="session")
def tiny_pair():
    a = tiny_llama(0)
    return a, perturbed(a, 0.3)


def left_padded_batch(vocab: int = 97, lengths=(12, 7, 9), seed: int = 3):
    """Token ids (B, T) left-padded with 0 and the matching 0/1 mask."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, t - n:] = torch.randint(2, vocab, (n,), generator=g)
        mask[i, t - n:] = 1
    return ids, mask


def random_samples(n: int, seed: int, t: int = 24, c: int = 6):
    """n evaluation samples of random ids below the tiny vocabulary: a prefix of t tokens and a continuation of c."""
    from scd.evaluation.evaluate import Sample
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(2, 97, (t,), generator=g), torch.randint(2, 97, (c,), generator=g)) for _ in range(n)]


def cache_of(model, ids, mask) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A model's own cache of a batch: per layer (K post-RoPE, V), each (B, n_kv, T, d)."""
    from scd.online.trace import capture
    tr = capture(model, ids, mask, want_xnorm=False)
    return list(zip(tr.keys, tr.values))


def largest_diff(kv, want, mask=None, columns=slice(None)) -> float:
    """Largest |difference| over every layer's K and V at `columns` (padded columns left out with `mask`)."""
    worst = 0.0
    for (gk, gv), (wk, wv) in zip(kv, want):
        for g, w in ((gk, wk), (gv, wv)):
            d = (g - w).abs()[..., columns, :]
            if mask is not None:
                d = d * mask[:, None, columns, None]
            worst = max(worst, d.max().item())
    return worst


def send_json(handler, status: int, body: dict) -> None:
    """A JSON answer from an http.server request handler (the tests' stand-in servers)."""
    import json
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Serve on the session's cluster: its handles and replicas push the autoscaling metrics every second (Serve's
# default: every 10 s), so that the autoscaling drills scale within seconds of the load they make, and its
# controller's loop runs every 0.25 s (Serve's default: 0.1 s; its idle CPU is the suite's CPU)
SERVE_ON_THE_SESSION_CLUSTER = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
                                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
                                "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25"}


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """The session's cluster (_session_cluster) with SERVE_ON_THE_SESSION_CLUSTER's settings (set for this
    process too, whose configs are checked against Serve's metrics interval)."""
    with pytest.MonkeyPatch.context() as env:           # the cluster's processes inherit them
        for name, value in SERVE_ON_THE_SESSION_CLUSTER.items():
            env.setenv(name, value)
        yield from _session_cluster()


def _session_cluster():
    """One Ray cluster for the test session (each pytest-xdist worker has its own); yields its dashboard URL (the
    Jobs API). 4 logical CPUs so two calibration jobs (two model actors each) can run side by side. Its dashboard
    agent listens on a free port, not Ray's fixed 52365: the Jobs API of a cluster that `scd serve` starts in
    another test (which takes 52365) works alongside it. Its temporary folder is its own, and names it in its
    address file: a job's driver joins the cluster that its supervisor's folder names (Ray resolves "auto"
    there), and with no name there, any cluster running on the machine (another worker's, a `scd serve`'s).
    Ray's test Cluster would write the name into /tmp/ray as well, where the clusters `scd serve` starts in other
    tests keep theirs (a job submitted to one of them meanwhile would join this one): it is kept from doing so."""
    import shutil
    import tempfile
    from unittest import mock

    import ray
    from ray.cluster_utils import Cluster
    from ray._common.utils import get_ray_address_file
    temp_dir = tempfile.mkdtemp(prefix="scd-ray-", dir="/tmp")       # short: Ray's socket paths live under it
    with mock.patch.object(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None):
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 4, "include_dashboard": True, "dashboard_port": free_port(),
            "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port(), "temp_dir": temp_dir})
    Path(get_ray_address_file(temp_dir)).write_text(cluster.address)
    ctx = ray.init(address=cluster.address, namespace="scd-test", log_to_driver=False)
    yield "http://" + ctx.dashboard_url
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder every pytest-xdist worker of this run sees (the parent of the workers' own temp folders); a
    folder of this worker's own without xdist."""
    import os
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def demo_work_dir(tmp_path_factory) -> str:
    """One calibration work dir for the run, shared by the xdist workers: the tests that calibrate the demo
    family at the same reduced budget resume each other's checkpoints (written atomically, so two workers
    computing one stage at once each leave a whole file); each still evaluates and publishes into its own
    store."""
    return str(shared_dir(tmp_path_factory, "demo-calibration"))


SERVE_BUDGET = {"prefixes": 8, "val": 2, "heldout": 1, "aligner_epochs": 2, "pool": 1}   # the serving tests' pairs


@pytest.fixture(scope="session")
def demo_store(tmp_path_factory, demo_work_dir) -> Path:
    """A store with the demo family's three pairs and the family "fam" (qa, prose), calibrated once for the
    run at SERVE_BUDGET (resuming demo_work_dir's checkpoints; the first xdist worker to ask builds it while
    the other waits on a lock), copied for this worker (the serving tests each take a further copy,
    `serving_config`, instead of publishing their own)."""
    import fcntl
    import shutil

    from jobs.calibrate import main as calibrate
    from jobs.family import main as family_job
    shared = shared_dir(tmp_path_factory, "demo-store")
    with open(shared / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "built").is_file():
            cfg = write_config(shared, **SERVE_BUDGET, work_dir=demo_work_dir)
            for pair in ("base:qa", "base:prose", "base:code"):
                calibrate(["--pair", pair, "--config", str(cfg), "--no-actors"])
            family_job(["--config", str(cfg), "--members", "qa,prose", "--name", "fam", "--publish", "--repeats",
                        "1", "--out", str(shared / "family")])
            (shared / "built").write_text("ok")
    mine = tmp_path_factory.mktemp("demo-store") / "store"
    shutil.copytree(shared / "store", mine)
    return mine


def serving_config(tmp_path, demo_store: Path, demo_work_dir: str) -> Path:
    """write_config at SERVE_BUDGET for a serving test, its store a copy of the session's `demo_store`."""
    import shutil
    shutil.copytree(demo_store, tmp_path / "store")
    return write_config(tmp_path, **SERVE_BUDGET, work_dir=demo_work_dir)


def write_config(tmp_path, **calibration) -> Path:
    """A ray_config.yaml for the demo family with a reduced calibration budget and stores under tmp_path.
    The quality gates are off, and so are the recompute-block stage, the selector of positions to recompute and
    the report's diagnostics: a budget this small fits artifacts that may well lose to raw KV reuse, and these
    tests are about the mechanics (the gates, the blocks, the selector and the report have their own tests)."""
    import yaml
    cal = {**TINY_FIT, "prefixes": 16, "val": 3, "heldout": 2, "aligner_epochs": 3, "pool": 2, "prefix_tokens": 96,
           "finetune_samples": 8, "finetune_epochs": 1, "gate_vs_raw_kv": 0, "family_vs_pair": 0,
           "recompute_blocks": False, "diagnostics": False, "serving_tokens": 256, "selector_samples": 0,
           "work_dir": str(tmp_path / "work"),
           **calibration}
    cfg = {"producer": {"name": "base", "path": str(DEMO / "base")},
           "specialists": [{"name": n, "path": str(DEMO / n)} for n in ("qa", "prose", "code")],
           "artifacts": {"uri": str(tmp_path / "store")}, "calibration": cal}
    path = tmp_path / "ray_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="session")
def real_family() -> Path:
    """The real family's producer folder (`scd fetch-family smollm2`); tests that need it skip without it."""
    from jobs.fetch_family import built
    folder = built("smollm2")
    if folder is None:
        pytest.skip("the real family is not built here (run `scd fetch-family smollm2`)")
    return folder


# The modules whose tests use the session's Ray cluster (`ray_cluster`, Serve apps on it) or the jobs that run
# on it: under pytest-xdist they all go to one worker, in order. On a small machine two workers each running
# such a cluster with model actors oversubscribe the cores.
RAY_MODULES = {"test_bad_input.py", "test_calibrate_job.py", "test_cli_calibrate.py", "test_exact_plans.py",
               "test_faults.py", "test_gpu.py", "test_producer_pool.py", "test_serve.py", "test_serve_group.py",
               "test_serve_nixl.py", "test_shapes.py"}
# The modules on a session cluster that start no Serve app and no Ray Job (actors and transports only): a group of
# their own, which the worker that is free near the end runs on a session cluster of its own.
RAY_ACTOR_MODULES = {"test_bench_tools.py", "test_registry.py", "test_transport.py"}
# The modules whose tests start Ray clusters of their own (`scd serve` as a user runs it, the multi-node
# drill), in /tmp/ray, one at a time: one group, beside the session cluster's (whose folder is its own).
OWN_CLUSTER_MODULES = {"test_byom.py", "test_cli_serve.py", "test_multinode.py", "test_quickstart.py"}
# The groups that take a minute or more, longest first (the Ray groups take most of the run): xdist hands out
# groups in collection order (`--no-loadscope-reorder`), so these start first and the workers end together,
# not one of them on a long module after the other has finished.
LONG_GROUPS = ["ray", "ray-own", "test_jobs", "test_family_job", "test_real_family", "test_blocks", "test_tail",
               "test_selective", "test_selector", "ray-actors"]


@pytest.hookimpl(tryfirst=True)              # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`--dist loadgroup`) the tests of RAY_MODULES are one group, which one worker runs in
    order, those of OWN_CLUSTER_MODULES another, those of RAY_ACTOR_MODULES a third, and every other module is
    a group of its own (its tests share module fixtures and may read what an earlier test wrote); LONG_GROUPS
    come first."""
    rank = {}
    for item in items:
        name = item.path.name
        group = ("ray" if name in RAY_MODULES else "ray-own" if name in OWN_CLUSTER_MODULES else
                 "ray-actors" if name in RAY_ACTOR_MODULES else item.path.stem)
        item.add_marker(pytest.mark.xdist_group(group))
        rank[item] = LONG_GROUPS.index(group) if group in LONG_GROUPS else len(LONG_GROUPS)
    items.sort(key=rank.__getitem__)                 # stable: within a group, and for the rest, as collected


def pytest_configure(config):
    """Under pytest-xdist each worker's torch runs on one thread: two workers share the machine's cores."""
    import os
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 2))))
