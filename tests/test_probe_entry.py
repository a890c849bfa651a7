"""The recompute-block probe (tools.probe_entry): its plain entry is DroidSpeak's block, and a fitted aligned
entry brings the producer's residual closer to the consumer's on prefixes it was not fitted on."""
import torch

from scd.evaluation.methods import DroidSpeak
from scd.fitting.gram import JointGram
from scd.online.trace import capture
from tests.conftest import perturbed, random_samples, tiny_llama
from tools.probe_entry import Entry


def _pair():
    a = tiny_llama(0, layers=4)
    return a, perturbed(tiny_llama(0, layers=4), 0.3, seed=1)


def test_a_plain_entry_is_droidspeaks_block_from_there_to_the_top():
    a, b = _pair()
    ids = random_samples(1, 5)[0].prefix[None]
    mask = torch.ones_like(ids)
    tr = capture(a, ids, mask, want_hidden=True)
    got = Entry(2, 4, None, None).build(b, ids, mask, tr).kv
    want = DroidSpeak(2, start=2).build(b, ids, mask, tr).kv
    err = max((x - y).abs().max().item() for g, w in zip(got, want) for x, y in zip(g, w))
    assert err == 0.0, f"the probe's entry at 2 and DroidSpeak's block [2, 4) differ by {err:.2e}"


def _closed_form_entry(a, b, n: int):
    """The entry map at layer 2 fitted in closed form on n calibration prefixes (as the probe's +align)."""
    h = a.config.hidden_size
    gram = JointGram(h, h)
    for s in random_samples(n, 2):
        ta, tb = (capture(m, s.prefix[None], want_hidden=True) for m in (a, b))
        gram.update(ta.hidden[2][0], tb.hidden[2][0] - ta.hidden[2][0])
    return gram.fit_regression(h, 1e-2)


def test_an_aligned_entry_fitted_on_calibration_prefixes_is_closer_to_the_consumers_residual_held_out():
    a, b = _pair()
    align = _closed_form_entry(a, b, 24)
    raw = fitted = 0.0
    for s in random_samples(6, 11):
        ta, tb = (capture(m, s.prefix[None], want_hidden=True) for m in (a, b))
        x, want = ta.hidden[2][0], tb.hidden[2][0]
        raw += (x - want).pow(2).sum().item()
        fitted += (x + align.decode(align.encode(x)) - want).pow(2).sum().item()
    assert fitted < 0.9 * raw, f"aligned entry's squared error {fitted:.3g}, the producer's residual's {raw:.3g}"


def test_an_entry_trained_end_to_end_lowers_the_consumers_kl_below_its_closed_form():
    """train_entry: the closed-form entry map, then trained through the consumer's own layers on its
    next-token KL. Its training KL falls, and the trained map scores lower than the closed form on the
    samples it trained on (what the probe's e<e>+trained row then measures held out)."""
    from scd.evaluation.evaluate import Evaluator
    from scd.fitting.blocks import train_entry
    a, b = _pair()
    closed = Entry(2, 4, _closed_form_entry(a, b, 16), None)
    train = random_samples(6, 7)
    trained, curve = train_entry(a, b, 2, closed.align, lambda ids, tr: closed.below_kv(b, ids, tr), train,
                                 epochs=4, lr=3e-3)
    assert curve[-1] < 0.9 * curve[0], f"training KL by epoch {curve}"
    ev = Evaluator(a, b)
    before = sum(ev.kl(s, closed) for s in train) / len(train)
    after = sum(ev.kl(s, Entry(2, 4, trained, None, name="e2+trained")) for s in train) / len(train)
    assert after < before, f"trained entry KL {after:.4g}, closed form {before:.4g}"


def test_codes_below_are_the_artifacts_rebuilt_cache_as_sent():
    """--below-artifact: below the entry, the published artifact's cache from its codes as the wire rounds them
    (here an exact plan's bf16 K and V): with no block of the probe's own, the probe's cache is the artifact's."""
    from scd.evaluation.methods import SCDMethod
    from scd.fitting import exact
    from scd.online.models import ModelSpec
    from tools.probe_entry import CodesBelow
    a, b = _pair()
    art = exact.artifact("a:b", ModelSpec.from_config(a.config), 2, "bf16")
    ids = random_samples(1, 5)[0].prefix[None]
    mask = torch.ones_like(ids)
    tr = capture(a, ids, mask, want_hidden=True)
    got = Entry(4, 4, None, CodesBelow(art)).build(b, ids, mask, tr).kv
    want = SCDMethod(art).build(b, ids, mask, tr).kv
    err = max((x - y).abs().max().item() for g, w in zip(got, want) for x, y in zip(g, w))
    assert err == 0.0, f"codes below differ from the artifact's rebuilt cache by {err:.2e}"


def test_a_block_with_a_stop_runs_its_layers_and_takes_below_above_it():
    """--stops: the block [1, 3) of 4 layers is the full block's at layers 1-2 (layer 2 reads layer 1's own
    output either way), and the producer's K and V at layer 3, as below the entry."""
    a, b = _pair()
    ids = random_samples(1, 5)[0].prefix[None]
    mask = torch.ones_like(ids)
    tr = capture(a, ids, mask, want_hidden=True)
    mid = Entry(1, 4, None, None, stop=3)
    assert mid.name == "e1-3"
    got = mid.build(b, ids, mask, tr).kv
    full = Entry(1, 4, None, None).build(b, ids, mask, tr).kv
    for l, want in [(1, full[1]), (2, full[2]), (3, (tr.keys[3], tr.values[3])), (0, (tr.keys[0], tr.values[0]))]:
        err = max((x - y).abs().max().item() for x, y in zip(got[l], want))
        assert err == 0.0, f"layer {l} of the block [1, 3) differs from what it should be by {err:.2e}"
    err = max((x - y).abs().max().item() for x, y in zip(got[3], full[3]))
    assert err > 0, "layer 3 above the stop is the consumer's own: the stop did nothing"


def test_an_artifact_holds_a_block_that_ends_below_the_top_and_rebuilds_it_as_the_probe_does():
    """A plan with the block [1, 3) of 4 layers (entry, recompute, then the producer's K and V again) goes
    through the wire and rebuilds to the probe's e1-3: the consumer's layers 1-2 from the producer's residual,
    the producer's K and V at layer 3 (layer 0 is the consumer's own in the plan, the producer's in the probe)."""
    from scd.online import codec
    from scd.online.artifacts import PairArtifacts
    from scd.online.models import ModelSpec
    from scd.online.rebuild import encode, rebuild
    a, b = _pair()
    art = PairArtifacts.exact("a:b", ModelSpec.from_config(a.config), ["exact", "entry", "recompute", "shared"], "bf16")
    assert art.blocks == [(1, 3)] and art.consumer_layers == 2
    ids = random_samples(1, 5)[0].prefix[None]
    mask = torch.ones_like(ids)
    tr = capture(a, ids, mask, want_hidden=True)
    got, _ = rebuild(b, art, codec.as_received(encode(art, tr, ids), "bf16"))
    want = Entry(1, 4, None, None, stop=3).build(b, ids, mask, tr).kv
    for l in range(1, 4):
        err = max((x.float() - y.float()).abs().max().item() for x, y in zip(got[l], want[l]))
        scale = max(y.float().abs().max().item() for y in want[l])
        assert err <= 0.02 * scale, f"layer {l}: the rebuilt block [1, 3) differs from the probe's by {err:.2e}"
