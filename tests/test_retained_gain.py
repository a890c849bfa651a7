"""Retained specialist gain: how much of what a specialist adds over its base model a method keeps."""
import math

import pytest
import torch

from scd.evaluation.evaluate import Evaluator, Sample, retained_gain
from scd.evaluation.methods import BaseAlone, Oracle, RawKV
from tests.conftest import perturbed, tiny_llama


def test_retained_gain_is_the_share_of_the_task_gain_over_the_base():
    qa = retained_gain([{"method": "oracle", "f1": 0.9, "ppl": 3.0}, {"method": "base", "f1": 0.3, "ppl": 9.0},
                        {"method": "scd", "f1": 0.75, "ppl": 4.0}])
    assert [r["retained_gain"] for r in qa] == pytest.approx([1.0, 0.0, 0.75])          # F1 decides for QA
    lm = retained_gain([{"method": "oracle", "f1": None, "ppl": 4.0}, {"method": "base", "f1": None, "ppl": 16.0},
                        {"method": "scd", "f1": None, "ppl": 8.0}])
    assert lm[2]["retained_gain"] == pytest.approx(0.5), lm    # log-perplexity: 8 is half way from 16 to 4
    none = retained_gain([{"method": "oracle", "f1": None, "ppl": 4.0}, {"method": "scd", "f1": None, "ppl": 5.0}])
    assert none[1]["retained_gain"] is None                     # no base row: nothing to measure from


def _pair_and_samples(seed: int, cont: int):
    """A tiny pair and two random samples of 20 prefix tokens and `cont` continuation tokens."""
    producer = tiny_llama(0)
    g = torch.Generator().manual_seed(seed)
    samples = [Sample(torch.randint(2, 97, (20,), generator=g), torch.randint(2, 97, (cont,), generator=g))
               for _ in range(2)]
    return producer, perturbed(producer, 0.3), samples


def test_the_base_alone_is_the_producer_answering_and_scores_no_gain():
    producer, consumer, samples = _pair_and_samples(4, 10)
    rows = {r["method"]: r for r in Evaluator(producer, consumer).run(samples, [Oracle(), BaseAlone(producer),
                                                                                RawKV()])}
    assert rows["oracle"]["retained_gain"] == pytest.approx(1.0) and rows["base"]["retained_gain"] == 0.0, rows
    # the base row is the producer's own prediction: its perplexity is the producer's on the continuation
    with torch.no_grad():
        seq = torch.cat([samples[0].prefix, samples[0].cont])[None]
        logits = producer(input_ids=seq).logits[0, len(samples[0].prefix):-1]
        nll = torch.nn.functional.cross_entropy(logits, samples[0].cont[1:]).item()
    one = Evaluator(producer, consumer).run(samples[:1], [BaseAlone(producer)])[0]
    assert abs(math.log(one["ppl"]) - nll) < 1e-4, (math.log(one["ppl"]), nll)
    assert rows["base"]["kl"] > 1e-3, "the base must differ from the specialist, or this test proves nothing"


def test_cost_times_every_method_on_one_prefix_of_the_asked_length_beside_the_oracles_prefill():
    producer, consumer, samples = _pair_and_samples(5, 6)
    seen = []

    class Recording(RawKV):
        def build(self, consumer, ids, mask, producer_trace):
            seen.append(tuple(ids.shape))
            return super().build(consumer, ids, mask, producer_trace)

    rows = {r["method"]: r for r in Evaluator(producer, consumer, greedy_tokens=2).run(
        samples, [Oracle(), BaseAlone(producer), Recording()], cost_tokens=50, cost_repeats=2)}
    # 2 held-out builds, then 2 timed builds on one 50-token prefix (the 20-token prefixes end to end, repeated)
    assert seen == [(1, 20), (1, 20), (1, 50), (1, 50)], seen
    assert rows["oracle"]["cost_ratio"] == 1.0 and rows["base"]["cost_ratio"] is None, rows
    assert rows["raw_kv"]["cost_tokens"] == 50 and rows["raw_kv"]["cost_ratio"] > 0, rows["raw_kv"]
    # without cost_tokens the rows carry no cost column
    assert "cost_ratio" not in Evaluator(producer, consumer, greedy_tokens=2).run(samples[:1], [RawKV()])[0]
