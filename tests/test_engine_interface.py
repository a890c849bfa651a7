"""The answering engines' one interface (engines/interface.py): built from an EngineConfig, each answers a
request, reports its status and stops, a specialist's and a LoRA group's alike."""
import queue
import threading

import pytest

from actors.messages import SpecialistRequest
from engines.interface import EngineConfig, build
from scd.online.decode import GenParams
from tests.conftest import DEMO

PREFIX, SUFFIX = list(range(40, 100)), [300, 301]


def _answer(engine, req: SpecialistRequest) -> tuple[list, tuple]:
    """The request's token events and its last event."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    engine.answer(req, events.put, threading.Event())
    tokens = []
    while (ev := events.get(timeout=120))[0] == "token":
        tokens.append(ev)
    return tokens, ev


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from tests.test_group_engine import ADAPTERS, _random_lora
    folder = tmp_path_factory.mktemp("interface") / "top"
    _random_lora(2, ADAPTERS["top"]).save_pretrained(str(folder))
    return folder


def test_a_specialist_and_a_group_are_built_from_a_config_and_answer_alike(adapter):
    params = GenParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    specialist = build(EngineConfig("specialist", "qa", str(DEMO / "qa")), "cpu")
    group = build(EngineConfig("group", "g", str(DEMO / "base"), members={"top": str(adapter)}), "cpu")
    try:
        tokens, last = _answer(specialist, SpecialistRequest(PREFIX, SUFFIX, params, reason="no_artifact"))
        assert last[0] == "done" and last[2] == "length" and tokens[-1][3] == 5, last
        assert (last[1].mode, last[1].reason) == ("fallback", "no_artifact"), last[1].as_dict()
        tokens, last = _answer(group, SpecialistRequest(PREFIX, SUFFIX, params, model="top"))
        assert last[0] == "done" and tokens[-1][3] == 5 and last[1].mode == "scd", last
        assert last[1].group["adapter_share"] == pytest.approx(3 / 8), last[1].as_dict()
        st = specialist.status()
        assert st["unavailable_reason"] == "no_artifact" and st["decode"]["steps"] > 0, st
        st = group.status("top")
        assert st["members"] == ["top"] and st["adapter_share"] == pytest.approx(3 / 8) and st["running"] == 0, st
    finally:
        specialist.stop()
        group.stop()


def test_stop_ends_the_rows_running_with_an_error_event(adapter):
    group = build(EngineConfig("group", "g", str(DEMO / "base"), members={"top": str(adapter)}), "cpu")
    events: queue.SimpleQueue = queue.SimpleQueue()
    group.answer(SpecialistRequest(PREFIX, SUFFIX, GenParams(max_tokens=2000, ignore_eos=True), model="top"),
                 events.put, threading.Event())
    assert events.get(timeout=120)[0] == "token"            # decoding
    group.stop()
    while (ev := events.get(timeout=60))[0] == "token":
        pass
    assert ev == ("error", "error: the engine stopped"), ev
    assert group.active.get("top") == 0, "the stopped row still counts as running"


def test_a_gpu_specialist_decodes_from_static_caches_sized_for_its_longest_request_and_answers_as_on_the_cpu(
        caplog):
    """static_capacity: on a GPU (the device's name is all it reads) a model fast_decode covers gets static caches
    of its longest input and answer; on a CPU none. A specialist given them (run eagerly here) answers token for
    token as the one that grows its batch per step, exact mode included."""
    from engines.interface import static_capacity
    from engines.specialist import SpecialistEngine
    from scd.online.models import load
    model, tok, _ = load(str(DEMO / "qa"))
    config = EngineConfig("specialist", "qa", str(DEMO / "qa"), max_input_tokens=100, max_tokens=20)
    assert static_capacity(model, config, "cpu") is None
    assert static_capacity(model, config, "cuda:0", free_bytes=1 << 30) == 121
    context = model.config.max_position_embeddings
    assert static_capacity(model, EngineConfig("specialist", "qa", "x"), "cuda", 1 << 30) == context + 512 + 1
    # caches over half the free memory: none, and the log says what would make them fit
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    need = config.max_batch * 121 * per_token                                      # fp32 on the CPU
    assert static_capacity(model, config, "cuda:0", free_bytes=2 * need) == 121
    with caplog.at_level("WARNING"):
        assert static_capacity(model, config, "cuda:0", free_bytes=2 * need - 1) is None
    assert "set limits.max_input_tokens to fit them" in caplog.text, caplog.text
    engines = [SpecialistEngine("qa", model, tok), SpecialistEngine("qa", model, tok, static_capacity=121)]
    params = GenParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        for exact in (False, True):
            answers = [_answer(e, SpecialistRequest(PREFIX, SUFFIX, params, reason="no_artifact", exact=exact))
                       for e in engines]
            (dynamic, last_d), (static, last_s) = answers
            assert [t[1] for t in dynamic] == [t[1] for t in static] and len(static) == 8, (exact, dynamic, static)
            assert last_d[0] == last_s[0] == "done" and last_s[2] == "length", (last_d, last_s)
        assert engines[1].decoder.decoder.batch.st.capacity == 121
    finally:
        for e in engines:
            e.stop()
