"""`scd artifacts` against a local store holding two versions of one pair."""
from cli.main import main as scd
from tests.artifacts_store.conftest import publish, tiny_artifacts


def test_list_show_verify_gc(tmp_path, capsys):
    from artifacts_store import ArtifactStore
    root = tmp_path / "store"
    store = ArtifactStore(root)
    m1 = publish(store)
    m2 = publish(store, tiny_artifacts(seed=1, patch=True))
    args = ["artifacts", "--store", str(root)]

    assert scd(args + ["list"]) == 0
    out = capsys.readouterr().out
    assert m1.version in out and m2.version in out and "(latest)" in out and "patch=[1]" in out, out

    assert scd(args + ["show", "base:qa@1"]) == 0
    assert f'"version": "{m1.version}"' in capsys.readouterr().out

    assert scd(args + ["verify", "base:qa@latest"]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")

    # flip one byte of the stored tensors: verify names the file and fails
    path = root / "base__qa" / m2.version / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert scd(args + ["verify", "base:qa@latest"]) == 1
    assert "tensors.safetensors" in capsys.readouterr().out

    assert scd(args + ["gc", "--keep", "1"]) == 0
    assert f"removed: base:qa@{m1.version}" in capsys.readouterr().out
    scd(args + ["list"])
    assert m1.version not in capsys.readouterr().out


def test_bad_refs_are_refused_without_a_traceback(tmp_path, capsys):
    args = ["artifacts", "--store", str(tmp_path / "store")]
    assert scd(args + ["show", "../../etc:qa"]) == 1
    assert "error:" in capsys.readouterr().err
    assert scd(args + ["show", "base:qa@7"]) == 1
    assert "error:" in capsys.readouterr().err
