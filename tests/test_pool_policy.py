"""The producer pool's decisions, without Ray: how busy a producer is, how many producers the load wants, and
what a health report may say about an exception."""
import random
import time

import pytest
import ray

from actors.messages import one_line
from actors.producer_actor import Busy
from actors.producer_pool import Autoscaler
from cluster.config import ProducerAutoscaling


def test_autoscaler_wants_the_load_over_the_target_after_its_delays():
    a = Autoscaler(ProducerAutoscaling(min_replicas=1, max_replicas=3, target_busy=0.5, upscale_delay_s=5,
                                       downscale_delay_s=30))
    assert a.decide(0, 1, 0.4) is None                    # 0.4 / 0.5 -> 1: as is
    assert a.decide(1, 1, 0.9) is None                    # wants 2, not yet 5 s
    assert a.decide(4, 1, 0.9) is None
    assert a.decide(6, 1, 0.95) == 2, "wanted 2 for 5 s"
    assert a.decide(7, 2, 5.0) is None and a.decide(12, 2, 5.0) == 3, "capped at max_replicas"
    assert a.decide(13, 3, 0.0) is None and a.decide(40, 3, 0.0) is None and a.decide(43.5, 3, 0.0) == 1
    assert a.decide(50, 1, 0.0) is None, "min_replicas"
    assert a.decide(51, 1, 0.9) is None and a.decide(52, 1, 0.2) is None and a.decide(57, 1, 0.9) is None, \
        "a dip resets the wait"


def test_busy_is_the_fraction_of_the_window_spent_encoding():
    b = Busy(window_s=0.5)
    assert b.fraction() == 0.0 and b.queue_wait_ms() == 0.0
    b.start(0.004)
    time.sleep(0.2)
    assert 0.3 <= b.fraction() <= 0.6, f"{b.fraction()} while encoding for 0.2 of 0.5 s"
    b.stop()
    time.sleep(0.6)
    assert b.fraction() == 0.0, "nothing in the last window"
    assert b.queue_wait_ms() == pytest.approx(4.0)


def test_busy_keeps_its_sum_as_spans_come_and_go_and_clips_the_one_that_reaches_past_the_window(monkeypatch):
    """Busy's running sum against the fraction summed span by span, on a clock of its own: spans that end in
    the window, one that starts before it, one still open, and the window emptied."""
    import actors.producer_actor as pa
    clock = [0.0]
    monkeypatch.setattr(pa.time, "monotonic", lambda: clock[0])
    b, spans = Busy(window_s=1.0), []

    def summed(now: float, open_since: float | None) -> float:
        lo = now - 1.0
        held = spans + ([(open_since, now)] if open_since is not None else [])
        return min(1.0, sum(max(0.0, e - max(s, lo)) for s, e in held if e >= lo))

    rng = random.Random(0)
    for _ in range(200):
        clock[0] += rng.uniform(0.0, 0.3)
        start = clock[0]
        b.start(None)
        clock[0] += rng.uniform(0.0, 0.2)
        assert abs(b.fraction() - summed(clock[0], start)) < 1e-9, "with an encode running"
        b.stop()
        spans.append((start, clock[0]))
        clock[0] += rng.uniform(0.0, 0.4)
        assert abs(b.fraction() - summed(clock[0], None)) < 1e-9, f"{b.fraction()} != {summed(clock[0], None)}"
    assert len(b.spans) < 20, f"{len(b.spans)} spans kept for a window of 1 s"
    clock[0] += 5.0
    assert b.fraction() == 0.0 and not b.spans


def test_one_line_drops_remote_tracebacks_and_colour_codes():
    try:
        raise ValueError("\x1b[31mno artifact\x1b[0m for base:qa\n  File \"/root/x.py\", line 3\nmore")
    except ValueError as e:
        plain = e
    assert one_line(plain) == "ValueError: no artifact for base:qa"
    wrapped = ray.exceptions.RayTaskError("encode", "Traceback (most recent call last):\n  File ...", plain)
    assert one_line(wrapped) == "ValueError: no artifact for base:qa"
