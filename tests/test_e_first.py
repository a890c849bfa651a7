"""E-first payloads (DroidSpeak's pipelining): a plan that enters the consumer's own layers goes on the wire as
the entry part, then the rest. The consumer starts its block from the entry part while the rest arrives, and
the cache it builds is the one the whole payload builds."""
import threading

import pytest
import torch

import engines.specialist as specialist
from actors.messages import FallbackReason, GenParams
from engines.producer import ProducerEngine
from engines.specialist import Arriving, SpecialistEngine
from scd.fitting import exact
from scd.online import codec, e_first
from scd.online.models import ModelSpec
from tests.conftest import tiny_llama
from tests.test_exact_plans import _top_adapted
from tests.test_models import _tokenizer

PAIR = "a:top"


@pytest.fixture(scope="module")
def served():
    """(producer engine with E-first on, the same with it off, the specialist's engine, the exact artifact):
    layers 0-3 shared, the consumer enters at 4 and runs 4-5 itself."""
    base = tiny_llama(0, layers=6)
    art = exact.artifact(PAIR, ModelSpec.from_config(base.config), 4, "bf16")
    tok = _tokenizer(97)
    return (ProducerEngine(base, tok, {PAIR: (art, "v1")}, cache_bytes=0),
            ProducerEngine(base, tok, {PAIR: (art, "v1")}, cache_bytes=0, e_first=False),
            SpecialistEngine("top", _top_adapted(base, 4), tok, art, "v1"), art)


def _prefix(n: int = 24, seed: int = 0) -> list[int]:
    return torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_part_plans_put_each_entry_in_the_first_part_and_everything_else_in_the_rest():
    plan = ["exact", "shared", "shared", "entry", "recompute", "hidden", "entry", "recompute"]
    entry, rest = e_first.part_plans(plan)
    assert entry == ["recompute", "recompute", "recompute", "entry", "recompute", "recompute", "entry", "recompute"]
    assert rest == ["exact", "shared", "shared", "recompute", "recompute", "hidden", "recompute", "recompute"]
    assert e_first.part_plans(["exact", "hidden", "patch"]) is None
    assert e_first.part_plans(["shared", "shared_entry", "recompute"]) is None     # a family's payload goes whole


def test_the_parts_decode_to_the_codes_the_whole_payload_carries(served):
    producer, whole_producer, _, art = served
    prefix = _prefix()
    parts = producer.encode(prefix, [PAIR]).per_pair[PAIR].payload
    whole = whole_producer.encode(prefix, [PAIR]).per_pair[PAIR].payload
    assert isinstance(parts, e_first.Parts) and isinstance(whole, bytes)
    dims = codec.level_dims(art)
    got = e_first.decode_parts(parts, PAIR, "v1", art.payload_plan, dims)
    want = codec.decode(whole, PAIR, "v1", art.payload_plan, dims)
    assert got.plan == want.plan and sorted(got.layers) == sorted(want.layers)
    for l, fields in want.layers.items():
        for name, x in fields.items():
            assert torch.equal(got.layers[l][name], x), f"layer {l} {name} differs"
    # the entry part is the residual entering layer 4 in bf16 (and the ids and mask, which both parts carry)
    t, h = len(prefix), art.spec.hidden_size
    assert codec.body_bytes(parts.entry) == 5 * t + 2 * t * h, codec.body_bytes(parts.entry)
    assert codec.body_bytes(parts.entry) + codec.body_bytes(parts.rest) == codec.body_bytes(whole) + 5 * t
    entry_plan, rest_plan = e_first.part_plans(art.payload_plan)
    with pytest.raises(codec.PayloadError, match="plan"):          # each part checked against its own plan
        codec.decode(parts.entry, PAIR, "v1", rest_plan, dims)


def test_an_e_first_payload_rebuilds_the_cache_the_whole_payload_rebuilds(served):
    producer, whole_producer, engine, _ = served
    prefix = _prefix(seed=1)
    parts = producer.encode(prefix, [PAIR]).per_pair[PAIR].payload
    whole = whole_producer.encode(prefix, [PAIR]).per_pair[PAIR].payload
    kv_parts, info_parts = engine._prefix_kv(prefix, parts, None, {})
    kv_whole, info_whole = engine._prefix_kv(prefix, whole, None, {})
    assert info_parts.mode == info_whole.mode == "scd", (info_parts, info_whole)
    assert info_parts.payload_bytes == len(parts)
    err = max((a - b).abs().max().item() for (ka, va), (kb, vb) in zip(kv_parts, kv_whole) for a, b in ((ka, kb), (va, vb)))
    assert err == 0.0, f"E-first cache differs from the whole payload's by {err:.2e}"
    assert {"decode_entry", "transfer_rest", "recompute", "block_wait"} <= set(info_parts.timings)
    text_parts = engine.complete(prefix, [11], parts, None, GenParams(max_tokens=8))[0]
    assert text_parts == engine.complete(prefix, [11], None, "oracle", GenParams(max_tokens=8))[0]


def test_the_block_starts_before_the_rest_is_received(served, monkeypatch):
    producer, _, engine, _ = served
    prefix = _prefix(seed=2)
    parts = producer.encode(prefix, [PAIR]).per_pair[PAIR].payload
    started = threading.Event()
    run_blocks = specialist.run_blocks

    def watched(*args):
        started.set()
        return run_blocks(*args)
    monkeypatch.setattr(specialist, "run_blocks", watched)
    seen = []

    def receive():                      # the rest "arrives" only once the block has begun (or 30 s pass)
        seen.append(started.wait(30))
        return parts.rest, None, 1.0
    _, info = engine._prefix_kv(prefix, Arriving(parts.entry, receive), None, {})
    assert info.mode == "scd" and seen == [True], (info, seen)


@pytest.mark.parametrize("rest, reason", [("lost", FallbackReason.TRANSPORT_ERROR),
                                          ("damaged", FallbackReason.CODEC_ERROR),
                                          ("other prefix", FallbackReason.CODEC_ERROR)])
def test_a_rest_that_fails_falls_back_to_the_prefill_with_its_reason(served, rest, reason):
    producer, _, engine, _ = served
    prefix = _prefix(seed=3)
    parts = producer.encode(prefix, [PAIR]).per_pair[PAIR].payload
    other = producer.encode(_prefix(seed=4), [PAIR]).per_pair[PAIR].payload
    got = {"lost": (None, FallbackReason.TRANSPORT_ERROR, 5.0), "damaged": (codec.corrupted(parts.rest), None, 1.0),
           "other prefix": (other.rest, None, 1.0)}[rest]
    kv, info = engine._prefix_kv(prefix, Arriving(parts.entry, lambda: got), None, {})
    assert info.mode == "fallback" and info.reason == reason, info
    own, _ = engine._prefix_kv(prefix, None, "oracle", {})
    assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(kv, own) for a, b in ((ka, kb), (va, vb)))


def test_a_damaged_entry_part_falls_back_and_the_rest_is_still_taken(served):
    producer, _, engine, _ = served
    prefix = _prefix(seed=5)
    parts = producer.encode(prefix, [PAIR]).per_pair[PAIR].payload
    taken = []
    arriving = Arriving(codec.corrupted(parts.entry), lambda: taken.append(1) or (parts.rest, None, 1.0))
    _, info = engine._prefix_kv(prefix, arriving, None, {})
    assert info.mode == "fallback" and info.reason == FallbackReason.CODEC_ERROR, info
    arriving.close()                    # what the replica does when the engine is done with a request
    arriving.close()
    assert taken == [1], "the rest must be taken exactly once, so that a staged payload is released"
