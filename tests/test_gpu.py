"""CUDA paths; skipped without a GPU (the CPU suite covers the same code on CPU)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_rebuild_on_cuda_matches_cpu(tmp_path):
    from scd.fitting.calibrate import Calibration
    from scd.online.models import ModelSpec
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    from tests.conftest import fit_settings, perturbed, tiny_llama
    a, b = tiny_llama(0), None
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(2, 97, (20,), generator=g) for _ in range(8)]
    cal = Calibration(a, b, spec, "a:b", prefixes, tmp_path, fit_settings(r_k=4, r_v=4, r_h=16, aligner_epochs=2),
                      progress=False)
    cal.traces()
    art = cal.artifacts_for(["exact", "patch", "reuse"])
    ids = prefixes[0][None]
    kv_cpu, _ = rebuild(b, art, encode(art, capture(a, ids), ids))
    a_gpu, b_gpu, art_gpu = a.cuda(), b.cuda(), art.to("cuda")
    codes = encode(art_gpu, capture(a_gpu, ids.cuda()), ids.cuda())
    kv_gpu, _ = rebuild(b_gpu, art_gpu, codes)
    err = max((k1 - k2.cpu()).abs().max().item() for (k1, _), (k2, _) in zip(kv_cpu, kv_gpu))
    assert err < 1e-3, f"CUDA rebuild differs from CPU by {err:.2e}"


@cuda
def test_static_caches_replayed_from_cuda_graphs_decode_as_the_eager_steps_do(monkeypatch):
    """decode.StaticBatch with graphs: each step shape captured once, in one memory pool, and replayed; the
    tokens and logprobs of rows joining and leaving equal the eager static step's and the left-padded batch's."""
    from scd.online.decode import Decoder, StaticBatch
    from tests.conftest import tiny_llama
    from tests.test_static_batch import _run
    monkeypatch.setattr(StaticBatch, "MIN_LENGTH", 8)
    model = tiny_llama(layers=2).cuda()
    args = ([5, 40, 12, 23], [20, 4, 9, 14], {2: 3})
    want = _run(Decoder(model, eos_id=1, max_batch=4), model, *args)
    graphs = Decoder(model, eos_id=1, max_batch=4, static_capacity=80, graphs=True)
    got = _run(graphs, model, *args)
    for i, (w, g) in enumerate(zip(want, got)):
        assert [t for t, _ in w[:-1]] == [t for t, _ in g[:-1]], (i, w, g)
        err = max(abs(a - b) for (_, a), (_, b) in zip(w[:-1], g[:-1]))
        assert err < 1e-4, f"row {i}: logprobs differ from the left-padded batch's by {err:.2e}"
    shapes = sorted(graphs.batch.st.graphs)
    assert len(shapes) >= 3 and all(n in (1, 2, 4) and length in (8, 16, 32, 64, 80) for n, length in shapes), shapes


@cuda
def test_a_device_payload_is_encoded_checked_and_decoded_in_device_memory():
    """encode_wire on the GPU: the body is a CUDA tensor with a device checksum (sum64), decode reads it without
    a host copy (its codes are CUDA tensors), a flipped byte is refused, and the codes match the host path's
    within one int8 step."""
    from scd.online import codec
    from scd.online.rebuild import dense
    from tests.test_codec import DIMS, PLAN, _codes
    c = _codes()
    wire = codec.encode_wire(c.to("cuda"), "base:qa", "v3", DIMS, "int8")
    assert wire.body.is_cuda and codec.header(wire)["check"][0] == "sum64"
    host = codec.decode(codec.encode(c, "base:qa", "v3", DIMS, "int8"), "base:qa", "v3", PLAN, DIMS)
    dev = codec.decode(wire, "base:qa", "v3", PLAN, DIMS)
    assert dev.token_ids.is_cuda and torch.equal(dev.token_ids.cpu(), c.token_ids)
    for l, fields in host.layers.items():
        for k, x in fields.items():
            d = dense(dev.layers[l][k])
            assert d.is_cuda, f"layer {l} {k} decoded to {d.device}"
            step = c.layers[l][k].abs().amax(-1, keepdim=True) / 127
            err = ((d.cpu() - dense(x)).abs() / step).max().item()
            assert err <= 1.01, f"layer {l} {k}: device and host decodes differ by {err:.2f} int8 steps"
    with pytest.raises(codec.PayloadError, match="checksum"):
        codec.decode(codec.corrupted(wire), "base:qa", "v3", PLAN, DIMS)


@cuda
def test_a_klt_exact_plan_encoded_and_rebuilt_on_the_gpu_matches_the_host_path():
    """klt on the GPU: the symbols are made, zigzagged and laid out in device memory (encode_wire), decoded there,
    and the rebuilt cache (the sink computed on the GPU) matches the host path's."""
    from scd.fitting import exact
    from scd.online import codec
    from scd.online.models import ModelSpec
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    from tests.conftest import tiny_llama
    base = tiny_llama(0, layers=4)
    spec = ModelSpec.from_config(base.config)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(2, 97, (40,), generator=g) for _ in range(6)]
    art = exact.artifact("a:b", spec, 3, "klt", klt_codes=exact.klt_codecs(base, prefixes, spec.num_layers, 0.1))
    ids = prefixes[0][None]
    dims = codec.artifact_dims(art)
    host = codec.decode(codec.encode(encode(art, capture(base, ids, want_hidden=True), ids), "a:b", "v1", dims, "klt"),
                        "a:b", "v1", art.plan, [dims])
    kv_host, _ = rebuild(base, art, host)
    gpu, art_gpu = base.cuda(), art.to("cuda")
    wire = codec.encode_wire(encode(art_gpu, capture(gpu, ids.cuda(), want_hidden=True), ids.cuda()), "a:b", "v1",
                             dims, "klt")
    assert wire.body.is_cuda
    dev = codec.decode(wire, "a:b", "v1", art.plan, [dims])
    assert dev.layers[1]["k"].is_cuda
    kv_dev, _ = rebuild(gpu, art_gpu, dev)
    err = max((a - b.cpu()).abs().max().item() for kv1, kv2 in zip(kv_host, kv_dev) for a, b in zip(kv1, kv2))
    step = max(float(c.dec.norm(dim=1).max()) for c in [*art.klt_k.values(), *art.klt_v.values()])
    assert err <= 1.01 * step + 1e-3, f"klt rebuilt on the GPU differs from the host path by {err:.2e} (step {step:.2e}: " \
                                      f"float noise may move a symbol by one)"


@cuda
def test_an_e_first_device_payload_starts_the_block_on_the_gpu_and_rebuilds_the_whole_payloads_cache():
    """E-first with device payloads: the producer's two parts are CUDA Wires; the specialist's engine on the GPU
    runs its block from the entry part on its thread and rebuilds the cache the whole payload rebuilds."""
    from engines.producer import ProducerEngine
    from engines.specialist import SpecialistEngine
    from scd.fitting import exact
    from scd.online import e_first
    from scd.online.models import ModelSpec
    from tests.conftest import tiny_llama
    from tests.test_exact_plans import _top_adapted
    from tests.test_models import _tokenizer
    base = tiny_llama(0, layers=6)
    art = exact.artifact("a:top", ModelSpec.from_config(base.config), 4, "bf16").to("cuda")
    tok, top = _tokenizer(97), _top_adapted(base, 4).cuda()
    base = base.cuda()
    prefix = torch.randint(2, 97, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    make = lambda split: ProducerEngine(base, tok, {"a:top": (art, "v1")}, 0, "cuda", device_payloads=True,  # noqa: E731
                                        e_first=split).encode(prefix, ["a:top"]).per_pair["a:top"].payload
    parts, whole = make(True), make(False)
    assert isinstance(parts, e_first.Parts) and parts.entry.body.is_cuda and parts.rest.body.is_cuda
    engine = SpecialistEngine("top", top, tok, art, "v1", device="cuda")
    kv_parts, info = engine._prefix_kv(prefix, parts, None, {})
    kv_whole, _ = engine._prefix_kv(prefix, whole, None, {})
    assert info.mode == "scd" and "block_wait" in info.timings, info
    err = max((a - b).abs().max().item() for x, y in zip(kv_parts, kv_whole) for a, b in zip(x, y))
    assert err == 0.0, f"E-first on the GPU differs from the whole payload by {err:.2e}"


@cuda
@pytest.mark.parametrize("kind", ["nixl", "cuda_ipc"])
def test_rdt_moves_a_device_payload_device_to_device(ray_cluster, kind):
    """A payload encoded on the producer's GPU, pulled by two replicas through Ray Direct Transport: it arrives
    in device memory, intact, and decodes there."""
    from tests.test_transport import pull_device_payloads
    arrived = pull_device_payloads(kind, "cuda")
    assert all(a.startswith("cuda") for a in arrived), f"{kind}: bodies arrived on {arrived}"


@cuda
@pytest.mark.parametrize("kind", ["cuda_ipc", "nixl"])
def test_a_fanout_on_one_gpu_is_served_from_device_payloads(ray_cluster, tmp_path_factory, demo_store, demo_work_dir,
                                                            kind):
    """The demo family on one GPU (producer and replicas a quarter of it each), codes over `kind`: a fan-out
    answers from codes (cuda_ipc refuses anything but a payload encoded on the GPU, so `scd` there means the
    codes stayed in device memory)."""
    import ray
    from tests.test_serve import PREFIX, _post
    from tests.test_serve_nixl import serve_family
    served = serve_family(tmp_path_factory, demo_store, demo_work_dir, kind, f"scd-test-gpu-{kind}", gpus=0.25)
    url, producer = next(served)
    try:
        for i in range(2):
            status, out = _post(url + "/v1/fanout", {"prefix": PREFIX + f"Round {i}. ", "requests": [
                {"specialist": "qa", "suffix": "Question: Where does Tilda Vance live?\nAnswer:", "max_tokens": 4},
                {"specialist": "prose", "suffix": "The", "max_tokens": 4}]})
            assert status == 200, out
            assert [r["scd"]["mode"] for r in out["results"]] == ["scd", "scd"], [r["scd"] for r in out["results"]]
        stats = ray.get(producer.stats.remote())
        assert stats["transport"] == kind and stats["staged"] == 0, stats
    finally:
        next(served, None)
