"""The store on real S3 semantics (no rename, no conditional writes): moto's S3 server on a free local port."""
from __future__ import annotations

import socket
import uuid

import pytest
import torch

from artifacts_store import ArtifactStore, ChecksumMismatch
from tests.artifacts_store.conftest import fingerprints, publish, tiny_artifacts
from tests.artifacts_store.test_concurrency import run_concurrently

moto = pytest.importorskip("moto", reason="S3 tests need moto: pip install 'moto[server]>=5.2.2'")
pytest.importorskip("flask", reason="moto's server needs its extras: pip install 'moto[server]>=5.2.2'")
boto3 = pytest.importorskip("boto3")

_MOTO = tuple(int(x) for x in moto.__version__.split(".")[:3] if x.isdigit())
if _MOTO < (5, 2, 2):
    # moto 5.2.1 answers CompleteMultipartUpload with the wrong XML root, which pyarrow rejects (getmoto/moto#10055)
    pytest.skip(f"moto {moto.__version__} breaks pyarrow multipart uploads; pip install 'moto[server]>=5.2.2'",
                allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as mp:       # credentials for the URI form, only while these tests run
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        yield f"127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_endpoint):
    name = f"scd-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=f"http://{s3_endpoint}", region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=name)
    return client, name


@pytest.fixture
def s3_store(s3_endpoint, bucket):
    import pyarrow.fs as pafs
    fs = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http", access_key="testing",
                           secret_key="testing", region="us-east-1")
    return ArtifactStore(f"{bucket[1]}/artifacts", filesystem=fs)


def test_publish_list_verify_load_on_s3(s3_store, bucket):
    client, name = bucket
    art = tiny_artifacts(patch=True)
    m1 = publish(s3_store, art, extra_files={"report/summary.md": b"# s3\n"})
    m2 = publish(s3_store, tiny_artifacts(seed=1))
    assert [(r.version, r.latest) for r in s3_store.list()] == [(m1.version, False), (m2.version, True)]
    assert s3_store.show("base:qa@1") == m1 and s3_store.verify("base:qa@1").ok
    loaded, m = s3_store.load("base:qa@1", expect=fingerprints())
    assert m == m1 and all(torch.equal(v, loaded.tensors()[k]) for k, v in art.tensors().items())
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=name)["Contents"]}
    assert f"artifacts/base__qa/{m1.version}/report/summary.md" in keys and "artifacts/base__qa/LATEST" in keys
    assert not any("/.tmp-" in k for k in keys), sorted(keys)

    key = f"artifacts/base__qa/{m2.version}/tensors.safetensors"
    data = bytearray(client.get_object(Bucket=name, Key=key)["Body"].read())
    data[-2] ^= 0x10
    client.put_object(Bucket=name, Key=key, Body=bytes(data))
    assert [(p.name, p.kind) for p in s3_store.verify("base:qa").problems] == [("tensors.safetensors", "bad")]
    with pytest.raises(ChecksumMismatch, match="tensors.safetensors: bad"):
        s3_store.load("base:qa")

    report = s3_store.gc(keep=1)
    assert report.removed_versions == [f"base:qa@{m1.version}"]
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=name)["Contents"]}
    assert not any(m1.version in k for k in keys), sorted(keys)


def test_store_from_an_s3_uri(s3_endpoint, bucket):
    store = ArtifactStore(f"s3://{bucket[1]}/uri-root?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1")
    m = publish(store)
    assert [r.version for r in store.list("base:qa")] == [m.version]
    assert store.verify("base:qa").ok and store.load("base:qa")[1] == m


def test_concurrent_publishers_on_s3(s3_store):
    run_concurrently(s3_store, publishers=3, each=2)


def test_leases_and_pins_on_s3(s3_store, bucket):
    client, name = bucket
    v = [publish(s3_store, tiny_artifacts(seed=i)).version for i in range(4)]
    assert s3_store.lease("base:qa@1", "qa#1", ttl_s=60).version == v[0]
    s3_store.lease("base:qa@latest", "producer-ab12", ttl_s=60)
    assert [(l.version, l.holder) for l in s3_store.leases()] == [(v[0], "qa#1"), (v[3], "producer-ab12")]
    assert [r.version for r in s3_store.list("base:qa")] == v and s3_store.verify("base:qa@1").ok
    report = s3_store.gc(keep=0, protect=[f"base:qa@{v[1]}"])
    assert report.removed_versions == [f"base:qa@{v[2]}"]
    assert [(k.version, k.why, k.by) for k in report.kept] == [(v[1], "pinned", f"base:qa@{v[1]}"),
                                                               (v[0], "leased", "qa#1")]
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=name)["Contents"]}
    assert "artifacts/base__qa/leases/qa#1.json" in keys and not any("/.tmp-" in k for k in keys), sorted(keys)
    s3_store.release("base:qa", "qa#1")
    assert s3_store.gc(keep=0).removed_versions == [f"base:qa@{v[0]}", f"base:qa@{v[1]}"]
    assert [l.holder for l in s3_store.leases("base:qa")] == ["producer-ab12"]
