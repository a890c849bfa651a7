"""A LoRA group's engine (engines/group.py) on the demo base: each adapter answers by name as its merged model
does, rows of different adapters decode in one batch, and a prefix's base layers run once for all of them."""
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from engines.group import GroupEngine
from scd.online.decode import GenParams
from scd.online.lora_group import LoraGroup, read_adapter
from scd.online.selective import POSITION_FEATURES
from tests.conftest import DEMO, fit_settings

ADAPTERS = {                  # name -> PEFT LoraConfig: every layer, a few top layers, an activated LoRA
    "every": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "top": {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"],
            "layers_to_transform": [5, 6, 7]},
    "act": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj"],
            "alora_invocation_tokens": [7, 8]},
}


def _base() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(DEMO / "base", dtype=torch.float32).eval()


def _random_lora(seed: int, cfg: dict):
    """The demo base with a PEFT LoRA of random factors (a zero B would leave the base unchanged)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    peft = get_peft_model(_base(), LoraConfig(task_type="CAUSAL_LM", **cfg))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.normal_(std=0.05)
    return peft


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(folder of the saved adapters, each adapter merged into the base)."""
    root = tmp_path_factory.mktemp("group-engine")
    merged = {}
    for seed, (name, cfg) in enumerate(ADAPTERS.items(), start=1):
        _random_lora(seed, cfg).save_pretrained(str(root / name))
        # merged: the same factors as a plain LoRA (PEFT merges no aLoRA), on for every token
        plain = {k: v for k, v in cfg.items() if k != "alora_invocation_tokens"}
        merged[name] = _random_lora(seed, plain).merge_and_unload().eval()
    return root, merged


def _engine(root, names) -> GroupEngine:
    base = _base()
    group = LoraGroup(base, [read_adapter(n, root / n, base) for n in names])
    return GroupEngine(group, AutoTokenizer.from_pretrained(DEMO / "base"), max_batch=8)


@pytest.fixture(scope="module")
def engine_and_merged(adapters):
    root, merged = adapters
    return _engine(root, ADAPTERS), merged


def _greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    """The model's greedy tokens after ids."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos)
    return out[0, len(ids):].tolist()


PREFIX = list(range(40, 140))
SUFFIX = [300, 301, 302, 303]
PARAMS = GenParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("name", ["every", "top"])
def test_each_adapter_answers_as_its_merged_model(engine_and_merged, name):
    engine, merged = engine_and_merged
    _, info, _ = engine.complete(name, PREFIX, SUFFIX, PARAMS)
    want = _greedy(merged[name], PREFIX + SUFFIX, PARAMS.max_tokens, engine.tok.eos_token_id)
    assert info.ids == want, f"{name}: the group's greedy tokens {info.ids} differ from the merged model's {want}"


def test_an_activated_lora_answers_from_the_bases_cache_up_to_its_invocation(engine_and_merged):
    """The aLoRA shares the base's whole prefix cache (nothing computed for it); its suffix invokes it at its
    second token. Reference: the base's own forward up to the invocation, then the adapter merged (always on)
    from there, greedy, on that cache."""
    from transformers import DynamicCache
    engine, merged = engine_and_merged
    suffix = [300, 7, 8, 301]
    _, info, _ = engine.complete("act", PREFIX, suffix, PARAMS)
    assert info.mode == "scd" and info.group["adapter_share"] == 0.0, info.as_dict()
    cache, want = DynamicCache(), []
    with torch.no_grad():
        _base()(input_ids=torch.tensor([PREFIX + suffix[:1]]), past_key_values=cache, use_cache=True)
        logits = merged["act"](input_ids=torch.tensor([suffix[1:]]), past_key_values=cache, use_cache=True).logits
        for _ in range(PARAMS.max_tokens):
            want.append(int(logits[0, -1].argmax()))
            logits = merged["act"](input_ids=torch.tensor([want[-1:]]), past_key_values=cache, use_cache=True).logits
    assert info.ids == want, f"aLoRA: the group's answer {info.ids} differs from the reference {want}"


def test_a_fan_out_prefills_the_base_once_and_says_how_each_adapter_was_served(engine_and_merged):
    engine, _ = engine_and_merged
    prefix = list(range(500, 620))
    results: dict[str, object] = {}

    def ask(name):
        results[name] = engine.complete(name, prefix, SUFFIX, PARAMS)[1]
    threads = [threading.Thread(target=ask, args=(n,)) for n in ADAPTERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cached = sorted(info.group["base_cached"] for info in results.values())
    assert cached == [False, True, True], f"the base prefilled the prefix more than once: {cached}"
    every, top, act = (results[n] for n in ("every", "top", "act"))
    assert (every.mode, every.reason) == ("fallback", "no_artifact"), every.as_dict()
    assert [engine.status(n)["unavailable_reason"] for n in ("every", "top", "act")] == ["no_artifact", None, None]
    assert top.mode == "scd" and top.group["adapter_share"] == pytest.approx(3 / 8), top.as_dict()
    assert act.mode == "scd" and act.group["adapter_share"] == 0.0, act.as_dict()


def test_rows_of_different_adapters_decode_in_one_batch_and_answer_as_alone(engine_and_merged):
    engine, merged = engine_and_merged
    alone = {n: engine.complete(n, PREFIX, SUFFIX, PARAMS)[1].ids for n in ("every", "top")}
    steps0, rows0 = engine.decoder.decoder.steps, engine.decoder.decoder.rows_stepped
    got: dict[str, list[int]] = {}
    gate = threading.Barrier(4)

    def ask(i, name):
        gate.wait()
        got[f"{name}{i}"] = engine.complete(name, PREFIX, SUFFIX, PARAMS)[1].ids
    threads = [threading.Thread(target=ask, args=(i, n)) for i in range(2) for n in ("every", "top")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, ids in got.items():
        assert ids == alone[key[:-1]], f"{key}: in a mixed batch {ids}, alone {alone[key[:-1]]}"
    steps = engine.decoder.decoder.steps - steps0
    rows = engine.decoder.decoder.rows_stepped - rows0
    assert rows / steps > 1.0, f"the four requests never shared a decode step ({rows} rows in {steps} steps)"


def test_a_name_not_in_the_group_is_refused(engine_and_merged):
    engine, _ = engine_and_merged
    with pytest.raises(ValueError, match="not an adapter of this group"):
        engine.complete("qa", PREFIX, SUFFIX, PARAMS)


def test_an_adapter_loaded_at_run_time_answers_as_merged_and_the_others_keep_theirs(adapters):
    root, merged = adapters
    engine = _engine(root, ["every", "act"])
    before = engine.complete("every", PREFIX, SUFFIX, PARAMS)[1].ids          # its base prefill is kept
    engine.load(read_adapter("top", root / "top", _base()))
    _, info, _ = engine.complete("top", PREFIX, SUFFIX, PARAMS)
    want = _greedy(merged["top"], PREFIX + SUFFIX, PARAMS.max_tokens, engine.tok.eos_token_id)
    assert info.ids == want, f"loaded at run time: {info.ids}, merged: {want}"
    assert engine.complete("every", PREFIX, SUFFIX, PARAMS)[1].ids == before, "a load changed another's answer"


def test_an_unload_lets_running_requests_finish_and_refuses_new_ones(adapters):
    root, _ = adapters
    engine = _engine(root, ["every", "top"])
    long = GenParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = engine.complete("top", PREFIX, SUFFIX, long)[1].ids
    got, unloaded = {}, threading.Event()

    def ask():
        got["answer"] = engine.complete("top", PREFIX, SUFFIX, long)[1]
    t = threading.Thread(target=ask)
    t.start()
    while not engine.active.get("top"):
        time.sleep(0.01)
    threading.Thread(target=lambda: (engine.unload("top"), unloaded.set())).start()
    t.join()
    assert unloaded.wait(30), "the unload did not end after its last request"
    assert got["answer"].ids == alone, f"the running request's answer changed under the unload: {got['answer'].ids}"
    with pytest.raises(ValueError, match="not an adapter of this group"):
        engine.complete("top", PREFIX, SUFFIX, PARAMS)
    assert engine.names == ["every"] and engine.complete("every", PREFIX, SUFFIX, PARAMS)[1].tokens == 12


@pytest.fixture(scope="module")
def every_artifacts(adapters, tmp_path_factory):
    """Artifacts of the pair (the demo base, "every" merged), fitted on a few random prefixes: codes alone
    (Reuse, one Patch layer), the same with a block of the consumer's own top three layers, and with selective
    recompute of the positions the prefix's last attend to most, that a selector picks, or that the request's
    suffix reads most."""
    import dataclasses

    from scd.fitting.calibrate import Calibration
    from scd.online.models import ModelSpec
    _, merged = adapters
    base = _base()
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(2, 2048, (48,), generator=g) for _ in range(12)]
    cal = Calibration(base, merged["every"], ModelSpec.from_config(base.config), "base:every", prefixes,
                      tmp_path_factory.mktemp("every-cal"), fit_settings(r_k=8, r_v=8, r_h=16, aligner_epochs=2,
                                                                         batch=8), progress=False)
    cal.traces()
    codes = cal.artifacts_for(["exact", "reuse", "reuse", "patch", "reuse", "reuse", "reuse", "reuse"])
    block = dataclasses.replace(codes, plan=codes.plan[:5] + ["entry", "recompute", "recompute"])
    width = base.config.num_key_value_heads * (base.config.hidden_size // base.config.num_attention_heads)
    picking = dataclasses.replace(codes, selector=torch.linspace(-1, 1, 2 * width + POSITION_FEATURES),
                                  selector_layers=[1, 5])
    return {"codes": codes, "block": block, "selective": codes.with_tail(6, len(PREFIX), "attention"),
            "learned": picking.with_tail(6, len(PREFIX), "learned"), "suffix": codes.with_tail(6, len(PREFIX), "suffix")}


@pytest.mark.parametrize("kind, share", [("codes", 0.0), ("block", 3 / 8), ("selective", None), ("learned", None),
                                         ("suffix", None)])
def test_an_every_layer_adapter_with_an_artifact_is_rebuilt_from_codes_of_the_bases_prefill(
        adapters, every_artifacts, kind, share):
    """Its cache is the artifact's rebuild from the base's own trace, on its view of the base (nothing merged),
    the same tensors as the rebuild on the merged model; the base prefills once for it and the others."""
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    from scd.settings import SELECT_WINDOW
    root, merged = adapters
    engine = _engine(root, ["every", "top"])
    art = every_artifacts[kind]
    engine.set_artifact("every", art, "v1")
    _, info, _ = engine.complete("every", PREFIX, SUFFIX, PARAMS)
    if share is None:       # the suffix's first pass counted; the attention rule's 6 lie within its window, which
        share = {"selective": SELECT_WINDOW, "suffix": 6 + SELECT_WINDOW, "learned": 6}[kind] / len(PREFIX)  # runs alone
    assert (info.mode, info.artifact) == ("scd", "v1") and info.group["adapter_share"] == pytest.approx(share), \
        info.as_dict()
    assert engine.complete("top", PREFIX, SUFFIX, PARAMS)[1].group["base_cached"], "the base prefilled twice"

    ids = torch.tensor([PREFIX])
    want, _ = rebuild(merged["every"], art, encode(art, capture(_base(), ids, want_hidden=True), ids),
                      reader=torch.tensor([SUFFIX]))
    row, _ = engine._row("every", PREFIX, SUFFIX, PARAMS, {})
    for layer, (k, v) in enumerate(want):
        for got, ref, what in ((row.keys[layer], k, "K"), (row.values[layer], v, "V")):
            err = (got[:, :, :len(PREFIX)] - ref).abs().max().item()
            assert err < 1e-4, f"{kind}: layer {layer} {what} differs from the rebuild on the merged model by {err:.2e}"


def test_exact_makes_an_adapter_with_an_artifact_prefill_and_answer_as_merged(adapters, every_artifacts):
    root, merged = adapters
    engine = _engine(root, ["every"])
    engine.set_artifact("every", every_artifacts["codes"], "v1")
    _, info, _ = engine.complete("every", PREFIX, SUFFIX, PARAMS, exact=True)
    want = _greedy(merged["every"], PREFIX + SUFFIX, PARAMS.max_tokens, engine.tok.eos_token_id)
    assert (info.mode, info.reason) == ("fallback", "group_own_prefill") and info.ids == want, \
        (info.as_dict(), want)
    engine.set_artifact("every", None)                  # dropped: its own prefill again, stated
    _, info, _ = engine.complete("every", PREFIX, SUFFIX, PARAMS)
    assert (info.mode, info.reason) == ("fallback", "no_artifact") and info.ids == want, info.as_dict()
