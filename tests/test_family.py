"""One code for a family: shared-encoder fits against several consumers at once (scd.fitting.family)."""
import dataclasses

import pytest
import torch

from scd.fitting import family
from scd.fitting.gram import JointGram


def _rows(seed: int, n_members: int, n: int = 3000, d: int = 10):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, generator=g) * torch.linspace(0.2, 3, d)
    shared = torch.randn(d, d, generator=g)
    bs = [a @ (shared + 0.3 * torch.randn(d, d, generator=g)) + 0.05 * torch.randn(n, d, generator=g) + j
          for j in range(n_members)]
    return a, bs


@pytest.mark.parametrize("regression", [False, True])
def test_a_one_member_family_is_the_pair_fit(regression):
    a, (b0,) = _rows(0, 1)
    one = JointGram(10, 10)
    one.update(a, b0)
    (alone,) = family.fit_family(one, 1, 4, 1e-4, regression)
    direct = one.fit_regression(4, 1e-4) if regression else one.fit(4, 1e-4)
    err = (alone.decode(alone.encode(a)) - direct.decode(direct.encode(a))).abs().max().item()
    assert err < 1e-4, f"a family of one decodes differently from its pair fit by {err:.2e}"
    (refit,) = family.fit_family(one, 1, 4, 1e-4, regression, own=[one])
    err = ((refit.decode(refit.encode(a)) - direct.decode(direct.encode(a))).norm() / b0.norm()).item()
    # reduced-rank regression's decoder is already the least-squares one for its code (up to the ridge); the
    # joint SVD's is not
    assert not regression or err < 1e-4, f"refitting a regression's decoder on its own rows moved it by {err:.2e}"


@pytest.mark.parametrize("regression", [False, True])
def test_family_members_share_one_encoder_and_cost_little_against_their_own_pair_fits(regression):
    a, bs = _rows(1, 3)
    gram = JointGram(10, 30)
    gram.update(a, torch.cat(bs, 1))
    members = family.fit_family(gram, 3, 6, 1e-4, regression)
    z = members[0].encode(a)
    assert all(m.enc is members[0].enc and m.mu_a is members[0].mu_a for m in members)   # one code for all
    for j, (m, b) in enumerate(zip(members, bs)):
        pair = JointGram(10, 10)
        pair.update(a, b)
        own = family.fit_codec(pair, 6, 1e-4, regression)
        fam_err = ((m.decode(z) - b).norm() / b.norm()).item()
        own_err = ((own.decode(own.encode(a)) - b).norm() / b.norm()).item()
        # the shared code serves all three at once, not far from each member's own fit; reduced-rank regression
        # is the best rank-r predictor of B_j from A, so there the own fit is never worse
        assert fam_err < 2 * own_err + 0.05, (j, fam_err, own_err)
        if regression:
            assert own_err <= fam_err * (1 + 1e-4), (j, fam_err, own_err)
    with pytest.raises(ValueError, match="equal member blocks"):
        family.fit_family(gram, 4, 6, 1e-4, regression)


@pytest.mark.parametrize("regression", [False, True])
def test_each_members_decoder_is_the_least_squares_one_on_its_own_rows(regression):
    """Members' rows come from different text (here: shifted, rescaled inputs with their own maps). The
    family's encoder is fitted on all the rows; each member's decoder refitted on its own rows is the
    least-squares decoder of the shared code there, so it fits them at least as well as the decoder split
    from the stacked fit, which was fitted on everybody's rows."""
    g = torch.Generator().manual_seed(3)
    d, n = 10, 2000
    maps = [torch.randn(d, d, generator=g) for _ in range(3)]
    member = lambda k, a: a @ maps[k] + 0.05 * torch.randn(a.shape, generator=g) - k      # noqa: E731
    rows = []
    for j in range(3):
        a = torch.randn(n, d, generator=g) * torch.linspace(0.2, 3, d) * (1 + j) + 2 * j
        rows.append((a, [member(k, a) for k in range(3)]))      # every member's targets on member j's text
    fam, own = JointGram(d, 3 * d), []
    for j, (a, bs) in enumerate(rows):
        fam.update(a, torch.cat(bs, 1))
        mine = JointGram(d, d)
        mine.update(a, bs[j])
        own.append(mine)
    split = family.fit_family(fam, 3, 6, 1e-6, regression)
    refit = family.fit_family(fam, 3, 6, 1e-6, regression, own=own)
    for j, (a, bs) in enumerate(rows):
        b = bs[j]
        assert refit[j].enc is refit[0].enc and torch.equal(refit[j].enc, split[j].enc)   # still one code for all
        z = split[j].encode(a)
        lstsq = torch.linalg.lstsq(torch.cat([z, torch.ones(n, 1)], 1).double(), b.double()).solution
        direct = (torch.cat([z, torch.ones(n, 1)], 1).double() @ lstsq).float()
        err = ((refit[j].decode(z) - direct).norm() / b.norm()).item()
        assert err < 1e-3, f"member {j}'s refitted decoder is off the least-squares one by {err:.2e} (relative)"
        e_split = ((split[j].decode(z) - b).norm() / b.norm()).item()
        e_refit = ((refit[j].decode(z) - b).norm() / b.norm()).item()
        assert e_refit <= e_split + 1e-4, f"member {j}: own decoder {e_refit:.4f} vs split {e_split:.4f}"
    with pytest.raises(ValueError, match="member Grams"):
        family.fit_family(fam, 3, 6, 1e-6, regression, own=own[:2])
    with pytest.raises(ValueError, match="cannot refit"):
        family.refit_decoder(split[0], JointGram(d, 2 * d), 1e-6)


@pytest.fixture(scope="module")
def fitted_family(tmp_path_factory):
    """A two-member family of tiny perturbed consumers (hidden-state codes, from scd.fitting.family) with
    each member's own pair artifact beside it."""
    from jobs.family import artifacts
    from scd.fitting.family import accumulate
    from scd.online.models import ModelSpec
    from tests.conftest import perturbed, tiny_llama
    from tests.conftest import random_samples
    a = tiny_llama(0)
    members = [perturbed(a, 0.3, seed=1), perturbed(a, 0.3, seed=2)]
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(24, 1)]
    grams, own_grams = accumulate(a, members, spec, [prefixes[:12], prefixes[12:]], True, 8, 0)
    fam, own = artifacts(grams, own_grams, spec, ["a:b", "a:c"], {"r_x": 16}, 1e-4, "int8", "a:fam")
    return a, members, fam, own


def test_a_family_artifact_saves_its_shared_encoders_once_and_loads_every_member(fitted_family, tmp_path):
    from safetensors.torch import load_file
    from scd.online.family_artifacts import FamilyArtifacts
    _, _, fam, _ = fitted_family
    fam.save(tmp_path / "f")
    keys = load_file(str(tmp_path / "f" / "tensors.safetensors")).keys()
    assert sum(k.endswith("hidden.1.enc") for k in keys) == 1, sorted(keys)       # once, not per member
    back = FamilyArtifacts.load(tmp_path / "f")
    assert back.family == "a:fam" and list(back.members) == ["a:b", "a:c"]
    for name, art in fam.members.items():
        got = back.members[name]
        assert got.pair == "a:fam" and got.plan == art.plan and got.levels == art.levels
        assert all(torch.equal(got.reuse_x[l].dec, art.reuse_x[l].dec) for l in art.reuse_x)
    with pytest.raises(ValueError, match="share the family"):
        FamilyArtifacts("a:fam", {"a:b": fam.members["a:b"], "a:c": dataclasses.replace(
            fam.members["a:c"], reuse_x={l: dataclasses.replace(c, enc=c.enc + 1) for l, c in fam.members["a:c"].reuse_x.items()})})


def test_a_fanout_to_a_family_encodes_once_and_each_member_rebuilds_its_own_cache(fitted_family):
    """The producer sends the family's one payload to every member; each specialist rebuilds with its own
    decoders (what the family artifact's member rebuilds directly); a request for one member alone, or
    for pairs outside the family, gets the pair's own codes."""
    from actors.messages import GenParams
    from engines.producer import ProducerEngine
    from engines.specialist import SpecialistEngine
    from scd.online import codec
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    from tests.test_models import _tokenizer
    a, (b, c), fam, own = fitted_family
    tok = _tokenizer(97)
    producer = ProducerEngine(a, tok, {"a:b": (own[0], "p1"), "a:c": (own[1], "p1")}, cache_bytes=1 << 20)
    producer.set_family(fam, "f1")
    prefix = list(range(5, 29))
    before = producer.prefills
    res = producer.encode(prefix, ["a:b", "a:c"])
    eb, ec = res.per_pair["a:b"], res.per_pair["a:c"]
    assert producer.prefills == before + 1 and eb.payload is ec.payload and eb.family == ec.family == "a:fam"
    solo = producer.encode(prefix, ["a:b"]).per_pair["a:b"]
    assert solo.family is None and solo.version == "p1" and solo.payload != eb.payload
    ids = torch.tensor([prefix])
    trace = capture(a, ids, torch.ones_like(ids))
    for name, model, mine in (("a:b", b, own[0]), ("a:c", c, own[1])):
        engine = SpecialistEngine(name, model, tok, mine, "p1")
        engine.set_family(fam.members[name], "f1")
        _, info, _ = engine.complete(prefix, [11], eb.payload, None, GenParams(max_tokens=2))
        assert info.mode == "scd" and info.family == "a:fam" and info.artifact == "f1", info
        kv, _ = engine._prefix_kv(prefix, eb.payload, None, {})
        want, _ = rebuild(model, fam.members[name], codec.as_received(encode(fam.members[name], trace, ids), "int8"))
        err = max((x - y).abs().max().item() for p, q in zip(kv, want) for x, y in zip(p, q))
        assert err < 1e-5, f"{name}: the family payload rebuilt differently from its member artifact, by {err:.2e}"
        _, info, _ = engine.complete(prefix, [11], solo.payload if name == "a:b" else
                                     producer.encode(prefix, ["a:c"]).per_pair["a:c"].payload, None,
                                     GenParams(max_tokens=2))
        assert info.mode == "scd" and info.family is None and info.artifact == "p1", info
    other = SpecialistEngine("a:b", b, tok, own[0], "p1")          # not told about the family: a stated fallback
    _, info, _ = other.complete(prefix, [11], eb.payload, None, GenParams(max_tokens=2))
    assert info.mode == "fallback" and info.reason == "codec_error", info


def test_a_layers_patch_encoder_is_fitted_on_the_members_that_patch_it():
    """Layer 3 is Patched by members 0 and 1: one encoder for both; layer 5 by member 1 alone: its encoder is
    member 1's own pair fit (the other members' x_norm do not dilute it); member 2 Patches nothing."""
    from scd.fitting.family import patch_encoders
    g = torch.Generator().manual_seed(0)
    rows = {f"xa.{l}": torch.randn(300, 6, generator=g) for l in (3, 5)}
    for j in range(3):
        for l in (3, 5):
            rows[f"xb{j}.{l}"] = rows[f"xa.{l}"] @ torch.randn(6, 6, generator=g) + 0.1 * torch.randn(300, 6, generator=g)
    encs = patch_encoders(rows, [[3], [3, 5], []], rank=3, ridge=1e-4)
    assert sorted(encs[0]) == [3] and sorted(encs[1]) == [3, 5] and encs[2] == {}
    assert torch.equal(encs[0][3].enc, encs[1][3].enc)
    own = JointGram(6, 6)
    own.update(rows["xa.5"], rows["xb1.5"])
    want = own.fit(3, 1e-4)
    err = (encs[1][5].enc - want.enc).abs().max().item()
    assert err < 1e-5, f"layer 5's encoder differs from member 1's own pair fit by {err:.2e}"


def test_each_member_is_fitted_on_its_own_prefixes_and_the_encoders_on_everyones():
    """accumulate: member j's own Gram is the pair Gram over its own prefixes alone and the family's Gram
    holds every member's rows; patch_rows: member j's aligner rows (own_rows) are the rows of its own
    prefixes alone, whole sequences, while a Patch encoder sees everyone's."""
    from scd.fitting.family import accumulate, own_rows, patch_rows
    from scd.online.models import ModelSpec
    from tests.conftest import perturbed, tiny_llama
    from tests.conftest import random_samples
    a = tiny_llama(0)
    members = [perturbed(a, 0.3, seed=1), perturbed(a, 0.3, seed=2)]
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(10, 1)]
    mine = [prefixes[:4], prefixes[4:]]
    fam, own = accumulate(a, members, spec, mine, True, 4, 0)
    rows = patch_rows(a, members, mine, [2], 4, 0)
    for j in range(2):
        alone, _ = accumulate(a, [members[j]], spec, [mine[j]], True, 4, 0)
        for l, g in enumerate(own[j]["x"]):
            if g is None:
                continue
            want = alone["x"][l]
            err = (g.g - want.g).abs().max().item() / want.g.abs().max().item()
            assert g.n == want.n and err < 1e-6, f"member {j} layer {l}: own Gram off its pair Gram by {err:.2e}"
        x_a, x_b, pos, x0 = own_rows(rows, j, 2)
        solo = patch_rows(a, [members[j]], [mine[j]], [2], 4, 0)
        err = max((x_b - solo["xb0.2"]).abs().max().item(), (x_a - solo["xa.2"]).abs().max().item(),
                  (x0 - solo["xb0.0"]).abs().max().item())
        assert torch.equal(pos, solo["pos"]) and err < 1e-5, f"member {j}'s aligner rows differ by {err:.2e}"
        assert int((pos == 0).sum()) == len(mine[j])            # whole sequences, each starting at position 0
    assert fam["x"][1].n == own[0]["x"][1].n + own[1]["x"][1].n == rows["pos"].shape[0]


def test_a_members_token_table_decoder_is_the_least_squares_one_and_a_family_of_one_is_its_pair_fit():
    """refit_decoder with per-token sums: the decoder and table are the ridge least-squares fit of B on the
    shared code and one-hot(token) (the one-hot columns shrunk by `shrink`), solved directly; a one-member
    family with tables, refitted on its own rows, decodes as its pair fit with a table does."""
    from scd.fitting.gram import TokenStats
    g = torch.Generator().manual_seed(5)
    n, d, vocab, shrink = 3000, 8, 12, 2.0
    tok = torch.randint(0, vocab, (n,), generator=g)
    a = torch.randn(n, d, generator=g) * torch.linspace(0.5, 2, d)
    b = a @ torch.randn(d, d, generator=g) + 3 * torch.randn(vocab, d, generator=g)[tok] \
        + 0.05 * torch.randn(n, d, generator=g)
    gram, stats = JointGram(d, d), TokenStats(torch.arange(vocab), d, d)
    gram.update(a, b)
    stats.update(tok, a, b)
    shared = family.fit_codec(gram, 5, 1e-6, True)                         # some encoder, no table
    refit = family.refit_decoder(shared, gram, 0.0, stats, shrink)
    z = shared.encode(a).double()
    f = torch.cat([z, torch.ones(n, 1, dtype=torch.float64), torch.nn.functional.one_hot(tok, vocab).double()], 1)
    pen = torch.diag(torch.cat([torch.zeros(6), torch.full((vocab,), shrink)])).double()
    direct = f @ torch.linalg.solve(f.T @ f + pen, f.T @ b.double())
    err = ((refit.decode(z.float(), tok).double() - direct).norm() / direct.norm()).item()
    assert err < 1e-4, f"a refitted decoder with a token table is off the direct fit by {err:.2e} (relative)"
    (alone,) = family.fit_family(gram, 1, 5, 1e-4, True, own=[gram], tokens=stats, own_tokens=[stats], shrink=shrink)
    pair = family.fit_codec(gram, 5, 1e-4, True, stats, shrink)
    err = ((alone.decode(alone.encode(a), tok) - pair.decode(pair.encode(a), tok)).norm() / b.norm()).item()
    assert err < 1e-4, f"a family of one with a table decodes differently from its pair fit by {err:.2e}"
    with pytest.raises(ValueError, match="member Grams"):
        family.fit_family(gram, 1, 5, 1e-4, True, own=[gram], tokens=stats, own_tokens=[stats, stats])


def test_a_family_with_token_tables_gives_each_member_its_own_and_saves_them(tmp_path):
    """accumulate(token_table=k): per-token sums beside every Gram; each member's decoders (family and pair)
    get a table of its own prefixes' k most frequent tokens; the family artifact saves and loads them, and a
    member's family code rebuilds the calibration rows no worse than the same family without tables."""
    from jobs.family import artifacts
    from scd.fitting.family import accumulate, load_grams, save_grams
    from scd.fitting.gram import TokenStats
    from scd.online.family_artifacts import FamilyArtifacts
    from scd.online.models import ModelSpec
    from tests.conftest import perturbed, tiny_llama
    from tests.conftest import random_samples
    a = tiny_llama(0)
    members = [perturbed(a, 0.3, seed=1), perturbed(a, 0.3, seed=2)]
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(16, 1)]
    mine = [prefixes[:8], prefixes[8:]]
    grams, own_grams = accumulate(a, members, spec, mine, True, 4, 0, x_group=0, token_table=20)
    save_grams(grams, own_grams, tmp_path / "g.safetensors")
    grams, own_grams = load_grams(tmp_path / "g.safetensors", spec, True, 2, x_group=0)
    every = torch.cat(prefixes)
    assert isinstance(grams["t"][1], TokenStats) and len(grams["t"][1].ids) == 20
    assert grams["t"][1].n.sum() == torch.isin(every, grams["t"][1].ids).sum()     # rows of its tokens only
    fam, own = artifacts(grams, own_grams, spec, ["a:b", "a:c"], {"r_x": 16}, 1e-4, "fp16", "a:fam", x_group=0)
    for j, pair in enumerate(["a:b", "a:c"]):
        want = TokenStats.most_frequent(mine[j], 20, 1, 1).ids
        assert torch.equal(fam.members[pair].reuse_x[1].table_ids, want)
        assert torch.equal(own[j].reuse_x[1].table_ids, want)
    fam.save(tmp_path / "fam")
    back = FamilyArtifacts.load(tmp_path / "fam")
    assert torch.equal(back.members["a:c"].reuse_x[1].table, fam.members["a:c"].reuse_x[1].table)
    plain, _ = artifacts({"x": grams["x"]}, [{"x": o["x"]} for o in own_grams], spec, ["a:b", "a:c"], {"r_x": 16},
                         1e-4, "fp16", "a:fam", x_group=0)
    from tests.test_cross_layer import _calibration_error
    for j, pair in enumerate(["a:b", "a:c"]):
        with_table = _calibration_error(a, members[j], fam.members[pair], mine[j][:4])
        without = _calibration_error(a, members[j], plain.members[pair], mine[j][:4])
        assert with_table < without, f"{pair}: K/V error with tables {with_table:.4f}, without {without:.4f}"


def test_a_family_of_one_with_bigram_tables_decodes_as_its_pair_fit():
    """refit_decoder with per-pair sums backs off to the member's token table exactly as the pair fit does: a
    one-member family refitted on its own rows decodes every key (in the table or not) as its pair fit."""
    from scd.fitting.gram import TokenStats
    from scd.online.reuse import bigram_keys
    g = torch.Generator().manual_seed(6)
    n, d, vocab = 4000, 8, 10
    tok = torch.randint(0, vocab, (1, n), generator=g)
    keys = bigram_keys(tok)[0]
    prev = torch.cat([torch.zeros(1, dtype=torch.long), tok[0, :-1]])
    a = torch.randn(n, d, generator=g) * torch.linspace(0.5, 2, d)
    b = a @ torch.randn(d, d, generator=g) + 3 * torch.randn(vocab, d, generator=g)[tok[0]] \
        + torch.randn(vocab, vocab, d, generator=g)[prev, tok[0]] + 0.05 * torch.randn(n, d, generator=g)
    gram, stats, pairs = JointGram(d, d), TokenStats(torch.arange(vocab), d, d), TokenStats.most_frequent([keys], 60, d, d)
    gram.update(a, b)
    stats.update(tok[0], a, b)
    pairs.update(keys, a, b)
    (alone,) = family.fit_family(gram, 1, 5, 1e-4, True, own=[gram], tokens=stats, own_tokens=[stats], shrink=2.0,
                                 own_bigrams=[pairs], bigram_shrink=8.0)
    pair = family.fit_codec(gram, 5, 1e-4, True, stats, 2.0, pairs, 8.0)
    assert torch.equal(alone.bigram_ids, pairs.ids) and len(pairs.ids) < len(keys.unique())   # some keys back off
    err = ((alone.decode(alone.encode(a), tok[0], keys) - pair.decode(pair.encode(a), tok[0], keys)).norm()
           / b.norm()).item()
    assert err < 1e-4, f"a family of one with bigram tables decodes differently from its pair fit by {err:.2e}"
    no_pairs = family.fit_codec(gram, 5, 1e-4, True, stats, 2.0)
    gain = [((c.decode(c.encode(a), tok[0], keys if c is pair else None) - b).norm() / b.norm()).item()
            for c in (pair, no_pairs)]
    assert gain[0] < 0.9 * gain[1], f"bigram rows: relative error {gain[0]:.4f} against {gain[1]:.4f} without"


def test_a_family_with_bigram_tables_gives_each_member_its_own_and_saves_them(tmp_path):
    """accumulate(bigram_table=k): each member's own Grams hold its per-pair sums (the family's shared Grams
    none); each member's decoders (family and pair) get a bigram table of its own prefixes' k most frequent
    pairs; the family artifact saves and loads them, and they rebuild the calibration rows better than the
    token tables alone."""
    from jobs.family import artifacts
    from scd.fitting.family import accumulate, load_grams, save_grams
    from scd.fitting.gram import TokenStats
    from scd.online.family_artifacts import FamilyArtifacts
    from scd.online.models import ModelSpec
    from scd.online.reuse import bigram_keys
    from tests.conftest import perturbed, tiny_llama
    from tests.test_cross_layer import _calibration_error
    from tests.conftest import random_samples
    a = tiny_llama(0)
    members = [perturbed(a, 0.3, seed=1), perturbed(a, 0.3, seed=2)]
    spec = ModelSpec.from_config(a.config)
    prefixes = [s.prefix for s in random_samples(16, 1)]
    mine = [prefixes[:8], prefixes[8:]]
    grams, own_grams = accumulate(a, members, spec, mine, True, 4, 0, x_group=0, token_table=20, bigram_table=40)
    save_grams(grams, own_grams, tmp_path / "g.safetensors")
    grams, own_grams = load_grams(tmp_path / "g.safetensors", spec, True, 2, x_group=0)
    assert "p" not in grams and all(isinstance(o["p"][1], TokenStats) for o in own_grams)
    fam, own = artifacts(grams, own_grams, spec, ["a:b", "a:c"], {"r_x": 16}, 1e-4, "fp16", "a:fam", x_group=0)
    for j, pair in enumerate(["a:b", "a:c"]):
        keys = [bigram_keys(p) for p in mine[j]]
        want = TokenStats.most_frequent(keys, 40, 1, 1).ids
        assert torch.equal(fam.members[pair].reuse_x[1].bigram_ids, want)
        assert torch.equal(own[j].reuse_x[1].bigram_ids, want)
        assert own_grams[j]["p"][1].n.sum() == torch.isin(torch.cat(keys), want).sum()     # rows of its pairs only
    fam.save(tmp_path / "fam")
    back = FamilyArtifacts.load(tmp_path / "fam")
    assert torch.equal(back.members["a:c"].reuse_x[1].bigram, fam.members["a:c"].reuse_x[1].bigram)
    tables, _ = artifacts(grams, [{k: o[k] for k in "xt"} for o in own_grams], spec, ["a:b", "a:c"], {"r_x": 16},
                          1e-4, "fp16", "a:fam", x_group=0)
    for j, pair in enumerate(["a:b", "a:c"]):
        with_pairs = _calibration_error(a, members[j], fam.members[pair], mine[j][:4])
        without = _calibration_error(a, members[j], tables.members[pair], mine[j][:4])
        assert with_pairs < without, f"{pair}: K/V error with bigram rows {with_pairs:.4f}, without {without:.4f}"
