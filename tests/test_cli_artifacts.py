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


def _config(tmp_path, root, **artifacts) -> str:
    """A deployment config whose specialists qa and code use the given artifacts (default: latest)."""
    import yaml
    specialists = [{"name": n, "path": "m/" + n, **({"artifact": artifacts[n]} if n in artifacts else {})}
                   for n in ("qa", "code")]
    path = tmp_path / "ray_config.yaml"
    path.write_text(yaml.safe_dump({"producer": {"name": "base", "path": "m/base"}, "specialists": specialists,
                                    "artifacts": {"uri": str(root)}}))
    return str(path)


def test_gc_keeps_config_pins_and_leases_and_says_why(tmp_path, capsys):
    from artifacts_store import ArtifactStore
    root = tmp_path / "store"
    store = ArtifactStore(root)
    v = [publish(store, tiny_artifacts(seed=i)).version for i in range(4)]
    code = publish(store, tiny_artifacts(pair="base:code")).version
    store.lease(f"base:qa@{v[1]}", "producer-ab12", ttl_s=120)
    cfg = _config(tmp_path, root, qa=v[0], code="v20990101T000000000000-abcdef")

    assert scd(["artifacts", "--config", cfg, "leases"]) == 0
    out = capsys.readouterr().out
    assert f"base:qa@{v[1]}: leased by producer-ab12 until 20" in out and "s left)" in out, out

    assert scd(["artifacts", "--config", cfg, "gc", "--keep", "0"]) == 0
    out = capsys.readouterr().out
    assert f"pins from {cfg}: base:qa@{v[0]}, base:code@v20990101T000000000000-abcdef" in out, out
    assert f"kept base:qa@{v[0]}: pinned by base:qa@{v[0]}" in out
    assert f"kept base:qa@{v[1]}: leased by producer-ab12 until 20" in out
    assert "note: pin base:code@v20990101T000000000000-abcdef ignored: " in out
    assert f"removed: base:qa@{v[2]}" in out and "gc done: 1 versions removed, 2 kept for pins or leases" in out
    assert [r.version for r in store.list()] == [code, v[0], v[1], v[3]]

    assert scd(["artifacts", "--config", cfg, "leases", "base:code"]) == 0
    assert capsys.readouterr().out == "no live leases\n"


def test_gc_from_store_without_a_readable_config_has_no_pins_and_says_so(tmp_path, capsys):
    from artifacts_store import ArtifactStore
    root = tmp_path / "store"
    store = ArtifactStore(root)
    v = [publish(store, tiny_artifacts(seed=i)).version for i in range(3)]
    store.lease(f"base:qa@{v[0]}", "qa#1")
    args = ["artifacts", "--store", str(root), "--config", str(tmp_path / "missing.yaml")]
    assert scd(args + ["gc", "--keep", "0"]) == 0
    out = capsys.readouterr().out
    assert "no pins: no readable config" in out and "missing.yaml" in out, out
    assert f"kept base:qa@{v[0]}: leased by qa#1" in out and f"removed: base:qa@{v[1]}" in out
    cfg = _config(tmp_path, root)                           # every specialist on latest: no pins either
    assert scd(["artifacts", "--config", cfg, "gc", "base:qa"]) == 0
    assert f"no pins: every specialist in {cfg} serves latest" in capsys.readouterr().out


def test_gc_refuses_a_negative_keep_and_no_store_is_a_clear_error(tmp_path, capsys):
    import pytest
    with pytest.raises(SystemExit):
        scd(["artifacts", "--store", str(tmp_path), "gc", "--keep", "-1"])
    assert "expected a count >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="does not exist"):
        scd(["artifacts", "--config", str(tmp_path / "missing.yaml"), "list"])
