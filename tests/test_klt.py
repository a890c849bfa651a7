"""klt: an exact plan's shared K and V transform coded (scd.online.klt). The symbols cross the wire exactly; the
rebuilt K and V are within half a step of the producer's along each principal axis; each row's first token
(the attention sink) is the producer's exactly, computed by the consumer; the codes survive an artifact's
save and load."""
import pytest
import torch

from scd.fitting import exact
from scd.online import codec, klt
from scd.online.artifacts import PairArtifacts
from scd.online.family_artifacts import FamilyArtifacts
from scd.online.models import ModelSpec
from scd.online.rebuild import encode, rebuild
from scd.online.reuse import LinearCodec
from scd.online.trace import capture
from tests.conftest import tiny_llama


@pytest.fixture(scope="module")
def tiny():
    base = tiny_llama(0, layers=4)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(2, 97, (int(n),), generator=g) for n in (40, 56, 33, 64, 48, 50)]
    return base, ModelSpec.from_config(base.config), prefixes


def _payload_codes(art, tr, ids):
    payload = codec.encode(encode(art, tr, ids), art.pair, "v1", codec.artifact_dims(art), "klt")
    return payload, codec.decode(payload, art.pair, "v1", art.plan, codec.level_dims(art))


def test_symbols_cross_the_wire_exactly_in_zigzag_planes(tiny):
    base, spec, _ = tiny
    one = LinearCodec(torch.zeros(16), torch.eye(16), torch.zeros(16), torch.eye(16))
    art = PairArtifacts.exact("a:b", spec, ["exact", "shared", "entry", "recompute"], "klt",
                              klt=({1: one}, {1: one}))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 97, (1, 20), generator=g)
    tr = capture(base, ids, torch.ones_like(ids), want_hidden=True)
    sent = encode(art, tr, ids)
    sent.layers[1]["k"] = torch.randint(-40000, 40000, sent.layers[1]["k"].shape, generator=g).float()
    sent.layers[1]["v"] = torch.randint(-3, 4, sent.layers[1]["v"].shape, generator=g).float()
    payload = codec.encode(sent, "a:b", "v1", codec.artifact_dims(art), "klt", compress="none")
    got = codec.decode(payload, "a:b", "v1", art.plan, codec.level_dims(art))
    for name in ("k", "v"):
        want = sent.layers[1][name].clamp(-klt.SYMBOL_MAX, klt.SYMBOL_MAX)
        assert torch.equal(got.layers[1][name], want), f"{name}: symbols changed on the wire"
    n = sent.layers[1]["k"].numel()
    assert codec.body_bytes(payload) == 5 * 20 + 2 * (2 * n) + 20 * spec.hidden_size * 2, codec.body_bytes(payload)
    small = codec.encode(sent, "a:b", "v1", codec.artifact_dims(art), "klt")          # zstd: V's symbols are small
    assert codec.body_bytes(small) < codec.body_bytes(payload)


@pytest.mark.parametrize("left_pad", [0, 7])
def test_rebuilt_kv_is_within_half_a_step_per_axis_and_the_sink_is_the_producers(tiny, left_pad):
    base, spec, prefixes = tiny
    kc, vc = exact.klt_codecs(base, prefixes, spec.num_layers, step=0.25)
    art = exact.artifact("a:b", spec, 3, "klt", klt_codes=(kc, vc))
    assert art.plan == ["exact", "shared", "shared", "entry"]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 97, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :left_pad] = 0
    tr = capture(base, ids, mask, want_hidden=True)
    _, codes = _payload_codes(art, tr, ids)
    kv, _ = rebuild(base, art, codes)
    first = klt.first_real(mask)
    for l in (1, 2):
        for name, got, want, c in (("K", klt.rows(codes_content(kv[l][0], base, mask)), klt.rows(tr.content[l]), kc[l]),
                                   ("V", klt.rows(kv[l][1]), klt.rows(tr.values[l]), vc[l])):
            step = float(c.dec.norm(dim=1).mean())               # each axis's row of dec is step x a unit vector
            err = (got - want) @ c.enc                            # the error along each axis, in steps
            keep = mask.bool().clone()
            keep[torch.arange(2), first] = False
            worst = float(err[keep].abs().max())
            assert worst <= 0.5 + 1e-3, f"layer {l} {name}: an axis is {worst:.3f} steps off (step {step:.3g})"
            sink = (got - want)[torch.arange(2), first].abs().max()
            assert float(sink) < 1e-4, f"layer {l} {name}: the sink is {float(sink):.2e} off the producer's"


def codes_content(k: torch.Tensor, model, mask) -> torch.Tensor:
    """Rebuilt keys (post-RoPE) back before RoPE, to compare with the trace's content."""
    from scd.online.rope import cos_sin, positions_from_mask, remove_rope
    cos, sin = cos_sin(model, positions_from_mask(mask))
    return remove_rope(k, cos, sin)


def test_a_finer_step_costs_bytes_and_buys_accuracy(tiny):
    base, spec, prefixes = tiny
    ids = torch.randint(2, 97, (1, 64), generator=torch.Generator().manual_seed(3))
    tr = capture(base, ids, torch.ones_like(ids), want_hidden=True)
    out = []
    for step in (0.05, 0.2, 0.8):
        art = exact.artifact("a:b", spec, 3, "klt", klt_codes=exact.klt_codecs(base, prefixes, spec.num_layers, step))
        payload, codes = _payload_codes(art, tr, ids)
        kv, _ = rebuild(base, art, codes)
        err = max(float((kv[l][1] - tr.values[l]).abs().max()) for l in (1, 2))
        out.append((codec.body_bytes(payload), err))
    (b1, e1), (b2, e2), (b3, e3) = out
    assert b1 > b2 > b3 and e1 < e2 < e3, f"(bytes, max |V error|) at steps 0.05, 0.2, 0.8: {out}"


def test_klt_codes_survive_save_and_load_and_families_refuse_them(tiny, tmp_path):
    base, spec, prefixes = tiny
    codes = exact.klt_codecs(base, prefixes, spec.num_layers, 0.1)
    art = exact.artifact("a:b", spec, 3, "klt", klt_codes=codes)
    art.save(tmp_path / "a")
    back = PairArtifacts.load(tmp_path / "a")
    assert sorted(back.klt_k) == [1, 2] and torch.equal(back.klt_v[2].dec, art.klt_v[2].dec)
    with pytest.raises(ValueError, match="layers \\[1, 2\\] have none"):
        PairArtifacts.exact("a:b", spec, art.plan, "klt")
    with pytest.raises(ValueError, match="an exact plan sent as klt needs"):
        exact.artifact("a:b", spec, 3, "klt")
    with pytest.raises(ValueError, match="fitted per pair"):
        FamilyArtifacts("a:fam", {m: exact.artifact("a:fam", spec, e, "klt", klt_codes=codes)
                                  for m, e in (("a:b", 3), ("a:c", 2))})


def test_the_engines_serve_a_klt_plan_and_answer_as_the_oracle_at_a_fine_step(tiny):
    from tests.test_exact_plans import _top_adapted, answers_as_the_oracle
    base, spec, prefixes = tiny
    art = exact.artifact("a:top", spec, 3, "klt", klt_codes=exact.klt_codecs(base, prefixes, spec.num_layers, 0.02))
    same = answers_as_the_oracle(base, _top_adapted(base, 3), art, seed=4, grow=6)
    assert same >= 5, f"klt at step 0.02 should answer as the oracle: {same} of 6 greedy answers equal"
