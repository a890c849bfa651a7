"""The run-time LoRA endpoints' checks (serve_app.adapters), without a cluster: each refusal is an HTTP 400 naming
the field at fault, and a good request resolves to its name, group and adapter folder."""
import json

import pytest

from serve_app.adapters import load_target, unload_check
from serve_app.errors import ApiError
from serve_app.schemas import LoadLoraRequest
from tests.conftest import REPO

BASE = str(REPO / "demo_models" / "base")


def _adapter(tmp_path, base: str = BASE):
    folder = tmp_path / "adapter"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
    return folder


def _refused(call) -> ApiError:
    with pytest.raises(ApiError) as e:
        call()
    assert e.value.status == 400, (e.value.status, e.value.message)
    return e.value


def test_a_load_into_the_only_group_resolves_its_name_group_and_folder(tmp_path):
    folder = _adapter(tmp_path)
    body = LoadLoraRequest(lora_name="legal", lora_path=str(folder))
    assert load_target(body, {"qa", "base", "g"}, ["g"], BASE) == ("legal", "g", str(folder.resolve()))
    named = LoadLoraRequest(lora_name="legal", lora_path=str(folder), group="h")
    assert load_target(named, set(), ["g", "h"], BASE)[1] == "h"


@pytest.mark.parametrize("change, groups, param, words", [
    ({"load_inplace": True}, ["g"], "load_inplace", "not supported"),
    ({"lora_name": "no spaces allowed"}, ["g"], "lora_name", "not a model name"),
    ({"lora_name": "qa"}, ["g"], "lora_name", "already served"),
    ({}, ["g", "h"], "group", "not a LoRA group"),                       # two groups: the request must name one
    ({"group": "x"}, ["g"], "group", "it has ['g']"),
    ({}, [], "group", "no LoRA group is configured"),
])
def test_a_load_is_refused_naming_the_field_at_fault(tmp_path, change, groups, param, words):
    body = LoadLoraRequest(**{"lora_name": "legal", "lora_path": str(_adapter(tmp_path)), **change})
    e = _refused(lambda: load_target(body, {"qa", "base", *groups}, groups, BASE))
    assert e.param == param and words in e.message, e.message


def test_a_load_of_a_folder_that_is_no_adapter_of_the_base_is_refused(tmp_path):
    not_adapter = tmp_path / "plain"
    not_adapter.mkdir()
    e = _refused(lambda: load_target(LoadLoraRequest(lora_name="x", lora_path=str(not_adapter)), set(), ["g"], BASE))
    assert e.param == "lora_path" and "not a PEFT adapter folder" in e.message, e.message
    other = _adapter(tmp_path, str(REPO / "demo_models" / "qa"))             # names another model as its base
    e = _refused(lambda: load_target(LoadLoraRequest(lora_name="x", lora_path=str(other)), set(), ["g"], BASE))
    assert e.param == "lora_path" and "is an adapter of" in e.message, e.message


def test_only_an_adapter_loaded_at_run_time_can_be_unloaded():
    unload_check("legal", {"legal"}, {"qa"})
    for name, why in (("qa", "is configured"), ("nobody", "is not loaded")):
        e = _refused(lambda: unload_check(name, {"legal"}, {"qa"}))
        assert e.param == "lora_name" and why in e.message, e.message
