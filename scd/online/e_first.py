"""E-first payloads (`Parts`, from `split`): a plan that enters the consumer's own layers from a residual stream
goes on the wire as two payloads of the wire format (scd.online.codec), the entry part first (the residuals
entering its blocks: its plan has "entry" there and "recompute" everywhere else) and then the rest (the plan
with "recompute" at the entry layers). The consumer starts its blocks as soon as the entry part is in, while
the rest streams (DroidSpeak's E-first pipelining); each part is checked on its own, against its own part plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from scd.online import codec
from scd.online.rebuild import Codes


@dataclass(frozen=True)
class Parts:
    """An E-first payload: the entry part, sent first, and the rest (`part_plans`), each a payload of its own."""
    entry: "bytes | codec.Wire"
    rest: "bytes | codec.Wire"

    def __len__(self) -> int:
        return len(self.entry) + len(self.rest)


def part_plans(plan: list[str]) -> tuple[list[str], list[str]] | None:
    """(the entry part's plan, the rest's) of a payload laid out by `plan`, or None when it enters no block
    (nothing to start early). "shared_entry" (a family's wire kind) is not split: a family's payload goes whole."""
    if "entry" not in plan:
        return None
    return (["entry" if k == "entry" else "recompute" for k in plan],
            ["recompute" if k == "entry" else k for k in plan])


def split(codes: Codes) -> tuple[Codes, Codes]:
    """`codes` as the entry part's codes and the rest's (`part_plans`); `merged` undoes it."""
    plans = part_plans(codes.plan)
    if plans is None:
        raise ValueError("these codes enter no block: there is no entry part to send first")
    entry = {l for l, k in enumerate(codes.plan) if k == "entry"}
    return (Codes(codes.token_ids, codes.mask, plans[0], {l: {"z_e": codes.layers[l]["z_e"]} for l in entry}),
            Codes(codes.token_ids, codes.mask, plans[1], {l: f for l, f in codes.layers.items() if l not in entry},
                  codes.level))


def merged(entry: Codes, rest: Codes, plan: list[str]) -> Codes:
    """The codes of a payload laid out by `plan` from its entry part's and its rest's (decoded apart)."""
    return Codes(rest.token_ids, rest.mask, list(plan), {**rest.layers, **entry.layers}, rest.level)


def encode_parts(codes: Codes, pair: str, artifact: str, dims: dict[str, int], dtype: str = "fp16",
                 wire: bool = False) -> Parts:
    """The E-first payload of `codes` (`split`): two payloads, as `encode` makes them (`wire`: `encode_wire`)."""
    enc = codec.encode_wire if wire else codec.encode
    return Parts(*(enc(c, pair, artifact, dims, dtype) for c in split(codes)))


def decode_parts(payload: Parts, pair: str, artifact: str, plan: list[str],
                 dims: "dict[str, int] | list[dict[str, int]]", x_codes: list[int] | None = None) -> Codes:
    """`decode` of an E-first payload whose parts are both in hand: each part checked against its part plan."""
    entry_plan, rest_plan = part_plans(plan) or (None, None)
    if entry_plan is None:
        raise codec.PayloadError(f"an E-first payload came for a plan that enters no block: {plan}")
    return merged(codec.decode(payload.entry, pair, artifact, entry_plan, dims),
                  codec.decode(payload.rest, pair, artifact, rest_plan, dims, x_codes), plan)
