"""tools.bench_concurrency's table: a level's failed requests are shown beside its rate (fast failures would
otherwise pass for throughput)."""
from tools.bench_concurrency import row, table


def _side(rps: float, errors: int) -> dict:
    return {"requests_per_s": rps, "errors": errors, "modes": {"scd": 10, "fallback:x": 1},
            "first_token_ms": {"p50": 100.0, "p99": 200.0}}


def test_each_levels_errors_are_a_column_beside_its_rate():
    rows = [row(1, {"scd": _side(5.0, 0), "oracle": _side(5.0, 0), "scd_over_oracle": {"requests_per_s": 1.0}}),
            row(16, {"scd": _side(10.0, 16), "oracle": _side(7.0, 2), "scd_over_oracle": {"requests_per_s": 1.43}})]
    lines = table(rows).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    last = [c.strip() for c in lines[-1].strip("|").split("|")]
    assert len(head) == len(last), lines
    assert last[head.index("errors SCD / oracle")] == "16 / 2" and last[head.index("SCD fallbacks")] == "1", lines
