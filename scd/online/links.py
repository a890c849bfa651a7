"""Ranks chosen per link: which of an artifact's nested code sizes (PairArtifacts.levels) to send to a
consumer behind a link of known bandwidth, so that the codes arrive within a time-to-first-token target.

The codes of a level are the leading columns of the full ones (scd.online.reuse), so any level decodes with
the same artifact; a longer code costs more link time and gives a lower KL. The producer asks `choose` once
per request and pair, with what is left of the target after its own prefill and encode.
"""
from __future__ import annotations

from scd.online.artifacts import PairArtifacts
from scd.online.codec import code_bytes


def transfer_ms(nbytes: int, gbps: float) -> float:
    """Milliseconds to carry `nbytes` over a link of `gbps` gigabits per second (bandwidth only)."""
    if gbps <= 0:
        raise ValueError(f"bandwidth must be positive, got {gbps} Gbps")
    return nbytes * 8 / (gbps * 1e6)


def ready_ms(payload_bytes: int, consumer_ms: float, gbps: float, entry_bytes: int = 0,
             block_ms: float = 0.0, tail_ms: float | None = 0.0) -> float:
    """Milliseconds from the payload's first byte on the link to the consumer's cache: the link and the
    consumer's compute (`consumer_ms`, of which `block_ms` runs its own layers and `tail_ms` the positions it
    runs through every layer, its tail or selective recompute). A payload sent whole is computed on after its
    last byte. An E-first one (`entry_bytes`, its entry part, sent first) starts the block once the entry is
    in, and the rest's decode once everything is; the two are modeled side by side (the block is most of the
    compute; the rest's decode, a few per cent here, runs beside it). The tail runs last, over the whole
    rebuilt cache: after both. `tail_ms` None: a tail of unknown time (a record from before it was timed
    apart), counted with nothing beside it."""
    if entry_bytes <= 0 or tail_ms is None:
        return transfer_ms(payload_bytes, gbps) + consumer_ms
    return max(transfer_ms(entry_bytes, gbps) + block_ms,
               transfer_ms(payload_bytes, gbps) + consumer_ms - block_ms - tail_ms) + tail_ms


def level_bytes(art: PairArtifacts, tokens: int, level: dict[str, int]) -> int:
    """The bytes a payload of `tokens` prefix tokens at `level` takes on the wire: as measured on the held-out
    payloads at calibration (info["levels"], compressed as sent), else codec.code_bytes, their size before
    the wire's lossless stage (an upper bound)."""
    for rec in art.info.get("levels", []):
        if "payload_ratio" in rec and {k: rec.get(k) for k in level} == level:
            return int(rec["payload_ratio"] * art.spec.kv_bytes_per_token * tokens)
    return code_bytes(art, tokens, level)


def choose(art: PairArtifacts, tokens: int, gbps: float | None, budget_ms: float | None) -> dict[str, int]:
    """The largest level whose codes of `tokens` prefix tokens cross a `gbps` link within `budget_ms`
    (level_bytes); the smallest level when none does (a late answer beats a prefill); the full ranks when
    the bandwidth or the budget is not known. Only levels that passed the quality gate at calibration are
    chosen (PairArtifacts.servable_levels)."""
    levels = art.servable_levels
    if gbps is None or budget_ms is None:
        return levels[-1]
    fits = [lv for lv in levels if transfer_ms(level_bytes(art, tokens, lv), gbps) <= budget_ms]
    return fits[-1] if fits else levels[0]
