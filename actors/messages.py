"""Names shared by every process of the request path: a pair's id and why a request fell back to a prefill."""
from __future__ import annotations

from enum import StrEnum


def pair_id(producer: str, consumer: str) -> str:
    """The id of a producer->consumer pair (artifact registry, payload headers, the producer's per-pair answers)."""
    return f"{producer}:{consumer}"


class FallbackReason(StrEnum):
    """Why a specialist prefilled instead of rebuilding from codes; the value is what responses carry."""
    NO_ARTIFACT = "no_artifact"                     # no calibrated artifact for the pair
    ARTIFACT_MISMATCH = "artifact_mismatch"         # producer and specialist hold different artifact versions
    ARTIFACT_UNAVAILABLE = "artifact_unavailable"   # the registry could not be read
    PRODUCER_UNAVAILABLE = "producer_unavailable"   # the producer actor is gone or failed
    PRODUCER_TIMEOUT = "producer_timeout"           # no codes within producer_timeout_s
    TRANSPORT_ERROR = "transport_error"             # the codes did not arrive intact
    CODEC_ERROR = "codec_error"                     # the payload did not parse or did not match the request
    PREFIX_TOO_SHORT = "prefix_too_short"           # nothing shared to rebuild
    QUALITY_GATE = "quality_gate"                   # calibration refused to publish an artifact for the pair
