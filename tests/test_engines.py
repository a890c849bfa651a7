"""Producer and specialist engines (no Ray): one prefill for many pairs, the code cache, every fallback."""
import pytest
import torch

from engines.producer import ProducerEngine
from actors.messages import GenParams
from engines.specialist import SpecialistEngine
from scd.fitting.calibrate import Calibration
from scd.online.models import ModelSpec
from tests.conftest import fit_settings, perturbed, tiny_llama
from tests.test_models import _tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    a = tiny_llama(0)
    b, c = perturbed(a, 0.3, seed=1), perturbed(a, 0.3, seed=2)
    spec = ModelSpec.from_config(a.config)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(2, 97, (20,), generator=g) for _ in range(16)]
    cfg = fit_settings(r_k=4, r_v=4, r_h=16, aligner_epochs=2, batch=8)
    arts = {}
    for name, m in (("b", b), ("c", c)):
        cal = Calibration(a, m, spec, f"a:{name}", prefixes, tmp_path_factory.mktemp(name), cfg, progress=False)
        cal.traces()
        arts[name] = cal.artifacts_for(["exact", "patch", "reuse"])
    tok = _tokenizer(97)
    producer = ProducerEngine(a, tok, {f"a:{n}": (arts[n], "v1") for n in arts}, cache_bytes=1 << 20)
    specialists = {n: SpecialistEngine(n, m, tok, arts[n], "v1") for n, m in (("b", b), ("c", c))}
    return producer, specialists, tok


PREFIX = [5, 9, 14, 3, 22, 40, 41, 7, 8, 19, 60, 2]


def test_one_prefill_serves_every_pair_and_the_cache_serves_repeats(setup):
    producer, specialists, _ = setup
    before = producer.prefills
    res = producer.encode(PREFIX, ["a:b", "a:c"])
    assert producer.prefills == before + 1 and res.prefilled
    assert all(e.payload and not e.cache_hit for e in res.per_pair.values())
    again = producer.encode(PREFIX, ["a:b", "a:c"])
    assert producer.prefills == before + 1 and not again.prefilled
    assert all(e.cache_hit and e.payload == res.per_pair[p].payload for p, e in again.per_pair.items())
    for name in ("b", "c"):
        text, info, finish = specialists[name].complete(PREFIX, [11], res.per_pair[f"a:{name}"].payload, None,
                                                        GenParams(max_tokens=5))
        assert info.mode == "scd" and info.reason is None and info.payload_bytes == len(res.per_pair[f"a:{name}"].payload)
        assert {"decode", "rebuild", "patch", "first_token"} <= set(info.timings), info.timings
        assert finish in ("stop", "length")


def test_unknown_pair_has_no_artifact(setup):
    producer, _, _ = setup
    assert producer.encode(PREFIX, ["a:zzz"]).per_pair["a:zzz"].error == "no_artifact"


@pytest.mark.parametrize("case", ["corrupt", "other_prefix", "given_reason", "no_artifact"])
def test_fallbacks_prefill_say_why_and_match_the_oracle(setup, case):
    producer, specialists, _ = setup
    spec_b = specialists["b"]
    payload = producer.encode(PREFIX, ["a:b"]).per_pair["a:b"].payload
    reason = None
    if case == "corrupt":
        payload = payload[:-1] + bytes([payload[-1] ^ 1])
    elif case == "other_prefix":
        payload = producer.encode(PREFIX[::-1], ["a:b"]).per_pair["a:b"].payload
    elif case == "given_reason":
        payload, reason = None, "producer_timeout"
    params = GenParams(max_tokens=6)
    if case == "no_artifact":
        engine = SpecialistEngine("b", spec_b.model, spec_b.tok, None, None)
    else:
        engine = spec_b
    text, info, _ = engine.complete(PREFIX, [11], payload, reason, params)
    want = {"corrupt": "codec_error", "other_prefix": "codec_error", "given_reason": "producer_timeout",
            "no_artifact": "no_artifact"}[case]
    assert info.mode == "fallback" and info.reason == want and "prefill" in info.timings, info
    # a fallback is the consumer's own prefill: exactly the oracle's greedy output
    oracle = SpecialistEngine("b", spec_b.model, spec_b.tok).complete(PREFIX, [11], None, "no_artifact", params)[0]
    assert text == oracle


def test_stop_strings_and_max_tokens(setup):
    producer, specialists, tok = setup
    payload = producer.encode(PREFIX, ["a:b"]).per_pair["a:b"].payload
    eng = specialists["b"]
    full, _, finish = eng.complete(PREFIX, [11], payload, None, GenParams(max_tokens=8, ignore_eos=True))
    words = full.split()                                   # one word per token (the tiny tokenizer's words)
    assert finish == "length" and len(words) == 8, (finish, full)
    # the stop string: the first word from the third on that the text before it does not already hold
    j = next((i for i in range(2, 8) if words[i] not in " ".join(words[:i])), None)
    assert j is not None, f"no usable stop word in {full!r}"
    cut, _, finish = eng.complete(PREFIX, [11], payload, None, GenParams(max_tokens=8, stop=[words[j]],
                                                                         ignore_eos=True))
    assert finish == "stop" and words[j] not in cut and cut.strip() == " ".join(words[:j]), (cut, words[j], full)
    short, _, finish = eng.complete(PREFIX, [11], payload, None, GenParams(max_tokens=3, ignore_eos=True))
    assert finish == "length" and short.split() == words[:3], (short, full)
    streamed = [v for k, v in eng.stream(PREFIX, [11], payload, None, GenParams(max_tokens=8, ignore_eos=True))
                if k == "token"]
    assert "".join(streamed) == full
    with pytest.raises(ValueError, match="suffix"):
        eng.complete(PREFIX, [], payload, None, GenParams())


def test_empty_prefix_decodes_the_suffix_alone(setup):
    """No prefix: the specialist decodes its suffix as the whole input, which is the model's own greedy
    continuation of those tokens (a plain loop over the full sequence, no cache), detokenized."""
    _, specialists, tok = setup
    suffix, n = [11, 12], 3
    text, info, finish = specialists["b"].complete([], suffix, None, "prefix_too_short",
                                                   GenParams(max_tokens=n, ignore_eos=True))
    assert info.mode == "fallback" and info.reason == "prefix_too_short" and finish == "length"
    model, seq = specialists["b"].model, torch.tensor([suffix])
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=seq).logits[0, -1]
            logits[tok.eos_token_id] = float("-inf")          # as ignore_eos masks it
            seq = torch.cat([seq, logits.argmax()[None, None]], 1)
    oracle = tok.decode(seq[0, len(suffix):].tolist())
    assert text == oracle, (text, oracle)


def test_incremental_detokenizer_pieces_join_to_the_whole_decode_even_through_multibyte_characters():
    from pathlib import Path

    from transformers import AutoTokenizer

    from engines.specialist import IncrementalDetokenizer
    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "demo_models" / "base")
    text = "héllo wörld 🎉 naïve café — 日本語 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the sample must split characters across tokens"
    g = torch.Generator().manual_seed(0)
    for seq in (ids, torch.randint(0, tok.vocab_size, (200,), generator=g).tolist()):
        d = IncrementalDetokenizer(tok)
        pieces = [d.add(i) for i in seq]
        joined = "".join(pieces) + d.flush()
        assert joined == tok.decode(seq), (joined, tok.decode(seq))
        if seq is ids:
            assert "\ufffd" not in "".join(pieces), "a piece was emitted in the middle of a character"
