"""CUDA paths; skipped without a GPU (the CPU suite covers the same code on CPU)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_rebuild_on_cuda_matches_cpu(tmp_path):
    from scd.fitting.calibrate import CalibConfig, Calibration
    from scd.online.models import ModelSpec
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    from tests.conftest import perturbed, tiny_llama
    a, b = tiny_llama(0), None
    b = perturbed(a, 0.3)
    spec = ModelSpec.from_config(a.config)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(2, 97, (20,), generator=g) for _ in range(8)]
    cal = Calibration(a, b, spec, "a:b", prefixes, tmp_path, CalibConfig(r_k=4, r_v=4, r_h=16, aligner_epochs=2),
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
def test_cupy_nccl_communicator_available():
    cupy = pytest.importorskip("cupy")
    from actors.transport import cupy_nccl
    make_comm, new_uid = cupy_nccl()
    assert new_uid() and cupy.cuda.runtime.getDeviceCount() >= 1
