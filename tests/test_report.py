"""jobs.report: file set, valid PNGs, summary content, input validation (synthetic inputs, no models)."""
from __future__ import annotations

import copy
import io

import matplotlib.image as mpimg
import pytest

from jobs.report import build_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METHODS = ["oracle", "raw_kv", "int4_kv", "droidspeak", "reuse_only", "scd"]


def _policy() -> dict:
    curve = [0.40, 0.22, 0.15, 0.12, 0.11]
    return {"base_kl": 0.40, "sensitivity": {str(l): 0.02 * ((l * 7) % 5) - 0.01 for l in range(1, 12)},
            "pool": [3, 5, 8, 10], "order": [5, 8, 3, 10], "curve": curve, "k_star": 2,
            "efficiency": [0.0, 0.18, 0.125, 0.093, 0.072], "chosen": [5, 8]}


def _rows() -> list[dict]:
    return [{"method": m, "payload_bytes": 1000 * (i + 1), "payload_ratio": 0.1 * i, "kl": 0.01 * i, "tv": 0.02 * i,
             "top1": 1 - 0.05 * i, "greedy": 1 - 0.04 * i, "ppl": 10 + i, "f1": None if i % 2 else 0.5,
             "em": None, "consumer_ms": 3.5 * (i + 1), "prefill_ratio": 0.2 * i, "samples": 8}
            for i, m in enumerate(METHODS)]


def _pareto() -> list[dict]:
    return [{"r_k": rk, "r_v": rv, "payload_ratio": (rk + rv) / 256, "kl": 2.0 / (rk + 0.5 * rv)}
            for rk in (8, 16, 32) for rv in (16, 32, 64)]


def _xnorm() -> dict[str, list[float]]:
    reuse = [0.0] + [0.05 * l for l in range(1, 12)]
    scd = [e if l < 5 else (0.01 if l in (5, 8) else e * 0.4) for l, e in enumerate(reuse)]
    return {"reuse_only": reuse, "scd": scd}


def _check_png(data: bytes) -> None:
    assert data.startswith(PNG_MAGIC)
    img = mpimg.imread(io.BytesIO(data), format="png")
    assert img.ndim == 3 and img.shape[1] > 200


def test_full_report():
    extra = {"r_k": 16, "r_v": 32, "calib_prefixes": 128, "data_digest": "sha256:abc123"}
    files = build_report("base:qa", _policy(), _rows(), pareto=_pareto(), xnorm=_xnorm(), extra=extra)
    assert set(files) == {"summary.md", "sensitivity.png", "greedy.png", "pareto.png", "xnorm_error.png"}
    for name, data in files.items():
        if name.endswith(".png"):
            _check_png(data)
    md = files["summary.md"].decode()
    assert "base:qa" in md
    for m in METHODS:
        assert f"| {m} |" in md
    assert "Patch layers: 5, 8 (k* = 2)" in md
    assert "sha256:abc123" in md and "calib_prefixes" in md
    for name in ("sensitivity.png", "greedy.png", "pareto.png", "xnorm_error.png"):
        assert f"![]({name})" in md
    assert "| - |" in md  # None F1/EM rendered as "-"


def test_rows_with_code_levels_add_the_held_out_tradeoff_figure():
    levels = [{**_rows()[-1], "method": f"scd@r_x={r}", "payload_ratio": 0.06 * i, "kl": 0.3 / i}
              for i, r in ((1, 72), (2, 144), (3, 216))]
    files = build_report("base:qa", _policy(), _rows() + levels)
    assert "tradeoff.png" in files and "![](tradeoff.png)" in files["summary.md"].decode()
    _check_png(files["tradeoff.png"])
    assert "| scd@r_x=144 |" in files["summary.md"].decode()


def test_optional_inputs_absent():
    files = build_report("base:code", _policy(), _rows()[-2:])
    assert set(files) == {"summary.md", "sensitivity.png", "greedy.png"}
    md = files["summary.md"].decode()
    assert "pareto.png" not in md and "xnorm_error.png" not in md
    assert "reuse_only" in md and "scd" in md
    _check_png(files["greedy.png"])


@pytest.mark.parametrize("mutate, needle", [
    (lambda p: p["curve"].pop(), "curve"),
    (lambda p: p.pop("order"), "order"),
    (lambda p: p["efficiency"].append(0.0), "efficiency"),
    (lambda p: p.update(k_star=9), "k_star"),
    (lambda p: p["sensitivity"].update(x=1.0), "sensitivity"),
])
def test_malformed_policy(mutate, needle):
    policy = copy.deepcopy(_policy())
    mutate(policy)
    with pytest.raises(ValueError, match=needle):
        build_report("base:qa", policy, _rows())


def test_malformed_rows_and_xnorm():
    rows = _rows()
    del rows[1]["kl"]
    with pytest.raises(ValueError, match=r"eval_rows\[1\].*kl"):
        build_report("base:qa", _policy(), rows)
    with pytest.raises(ValueError, match="xnorm"):
        build_report("base:qa", _policy(), _rows(), xnorm={"reuse_only": [0.1, 0.2], "scd": [0.1]})


def _curve() -> dict:
    """A block plan's curve of 10 layers at 100 tokens: codes, codes + tails / attention / learned shares,
    blocks at 8 and 5, one block with a learned share; the block at 5 chosen."""
    def pt(entry, kl, tail=0, rule="last"):
        from scd.fitting.points import consumer_ratio
        return {"entry": entry, "tail": tail, **({"rule": rule} if tail and rule != "last" else {}),
                "consumer_ratio": consumer_ratio(entry, tail, 10, 100, rule), "kl": kl}
    pts = [pt(10, 0.7), pt(10, 0.5, 10), pt(10, 0.35, 30), pt(10, 0.55, 10, "attention"),
           pt(10, 0.4, 10, "learned"), pt(10, 0.3, 30, "learned"), pt(8, 0.6), pt(5, 0.18), pt(8, 0.32, 10, "learned")]
    return {"points": pts, "raw_kv": {"kl": 1.0}, "chosen": pts[7], "bound": {"max_kl_ratio": 0.2,
            "max_consumer_ratio": 0.75}, "num_layers": 10, "prefix_tokens": 100}


def test_a_qa_pairs_compute_figure_draws_each_held_out_plans_f1_beside_the_oracles():
    """jobs.report._fig_compute: with held-out rows that carry F1 (a QA pair's curve), a second panel holds one
    point per held-out plan with an answer (SCD's; DroidSpeak's, raw KV at 0), the chosen plan circled, and the oracle's
    F1 and 0.95 of it as lines; without F1 one panel."""
    from jobs.report import _fig_compute
    c = _curve()
    row = lambda m, kl, f1: {"method": m, "kl": kl, "f1": f1}                 # noqa: E731
    held = [row("oracle", 0.0, 0.9), row("raw_kv", 1.0, 0.3), row("scd", 0.2, 0.88), row("codes+lsel30", 0.35, 0.8),
            row("enter@8", 0.6, 0.5), row("droidspeak@8", 0.9, 0.4), row("droidspeak@5", 0.5, 0.6)]
    fig = _fig_compute("base:qa", c, held)
    assert len(fig.axes) == 2, fig.axes
    fx = fig.axes[1]
    drawn = sorted(tuple(map(float, xy)) for coll in fx.collections for xy in coll.get_offsets())
    want = sorted([(0.3, 0.8), (0.2, 0.5), (0.5, 0.88), (0.5, 0.88),      # SCD's, the chosen (enter@5) circled
                   (0.0, 0.3), (0.2, 0.4), (0.5, 0.6)])                     # raw KV at 0, DroidSpeak's
    assert drawn == pytest.approx(want), drawn
    assert sorted(line.get_ydata()[0] for line in fx.lines) == pytest.approx([0.855, 0.9])
    no_f1 = _fig_compute("base:code", c, [{**r, "f1": None} for r in held])
    assert len(no_f1.axes) == 1, no_f1.axes


def test_a_qa_pairs_compute_figure_draws_the_validation_curves_f1_by_plan_kind():
    """With F1 on the validation points and no held-out curve yet, the F1 panel holds every validation plan
    at its compute and F1, the chosen one circled."""
    from jobs.report import _fig_compute
    c = _curve()
    c["points"] = [{**p, "f1": 0.5 + 0.05 * i} for i, p in enumerate(c["points"])]
    c["chosen"] = c["points"][7]
    fig = _fig_compute("base:qa", c, [])
    assert len(fig.axes) == 2, fig.axes
    drawn = sorted((round(float(x), 6), round(float(y), 6)) for coll in fig.axes[1].collections
                   for x, y in coll.get_offsets())
    want = sorted([(round(p["consumer_ratio"], 6), round(p["f1"], 6)) for p in c["points"]] + [(0.5, 0.85)])
    assert drawn == want, (drawn, want)                                    # + the chosen, circled


def test_a_curve_reads_by_plan_kind_at_each_budget_of_compute():
    from scd.fitting.points import BUDGETS, best_by_kind, kind
    c = _curve()
    got = best_by_kind(c["points"], 10)
    assert list(got) == ["codes", "codes + its last tokens", "codes + selective, learned",
                         "codes + selective, attention", "block", "block + selective, learned"], list(got)   # by compute
    assert BUDGETS == (0.1, 0.2, 0.35, 0.5)
    kls = {k: [None if p is None else p["kl"] for p in best] for k, best in got.items()}
    assert kls["codes"] == [0.7] * 4                                       # costs nothing
    assert kls["codes + its last tokens"] == [0.5, 0.5, 0.35, 0.35]        # 0.1 and 0.3 of a prefill
    assert kls["codes + selective, learned"] == [0.4, 0.4, 0.3, 0.3]
    assert kls["codes + selective, attention"] == [None, 0.55, 0.55, 0.55]  # 10 within its window: 16 / 100
    assert kls["block"] == [None, 0.6, 0.6, 0.18]                           # entering at 8: 0.2, at 5: 0.5
    assert kls["block + selective, learned"] == [None, None, 0.32, 0.32]
    assert kind(c["chosen"], 10) == "block"

    files = build_report("base:code", None, _rows(), compute=c)
    _check_png(files["compute.png"])
    md = files["summary.md"].decode()
    assert "## Plans by consumer compute (validation)" in md, md
    assert "| codes + selective, learned | 0.400 (0.10) | 0.400 (0.10) | 0.300 (0.30) | 0.300 (0.30) |" in md, md
    assert "Chosen: block, enter@5: 0.180 x raw KV at 0.50 of a prefill" in md, md
    assert "retained share" not in md, "no F1 table for a pair without answers"


def test_a_qa_pairs_curve_reads_its_highest_f1_by_plan_kind_at_each_budget():
    """With F1 on every point, the summary has a second table: per plan kind the highest F1 within each budget
    (the lower KL among equal F1), with its retained gain and compute."""
    c = _curve()
    f1 = [0.6, 0.7, 0.7, 0.65, 0.8, 0.75, 0.5, 0.9, 0.85]              # in _curve's order
    c["points"] = [{**p, "f1": f, "retained_gain": f - 0.1} for p, f in zip(c["points"], f1)]
    md = build_report("base:qa", None, _rows(), compute=c)["summary.md"].decode()
    table = md.split("F1 and the retained share")[1]
    assert "| codes + its last tokens | 0.700, 0.60 (0.10) | 0.700, 0.60 (0.10) | 0.700, 0.60 (0.30) |" in table, table
    assert "| codes + selective, learned | 0.800, 0.70 (0.10) | 0.800, 0.70 (0.10) | 0.800, 0.70 (0.10) |" in table, table
    assert "| block | - | 0.500, 0.40 (0.20) | 0.500, 0.40 (0.20) | 0.900, 0.80 (0.50) |" in table, table
