"""What a consumer shares exactly with its producer, found from its structure before any fitting.

A fine-tune that leaves the embeddings and layers [0, s) alone (a LoRA with `layers_to_transform` above s, a
full fine-tune with frozen lower layers) computes, on the same tokens, the producer's own K and V at those
layers and the producer's own residual stream entering layer s. That part of the consumer's cache needs no
translation: it is exact, and the consumer can run layers s..L-1 itself from the residual. An activated LoRA
(aLoRA, `alora_invocation_tokens`) switches on only after its invocation tokens, so the whole prefix before
them is the base's.

Two sources, and a check:
  - the weights: the first layer whose tensors differ (a merged adapter changes exactly the layers it adapts);
  - a PEFT adapter's config: `alora_invocation_tokens` (the weights cannot tell it);
  - `verify`: both models run on the same prefixes, and the shared part must agree to float noise.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from scd.fitting.traces import pad
from scd.online import activated
from scd.online.model_files import invocation_tokens
from scd.online.trace import capture


@dataclass(frozen=True)
class SharedStructure:
    """Layers [0, first_adapted) of the consumer are the producer's, bit for bit; so are the K and V the
    consumer computes there and the residual entering layer first_adapted (num_layers: nothing adapted below
    the head; 0: the embeddings or layer 0 differ). invocation_tokens: an aLoRA's, before which the whole
    prefix's cache is the producer's."""
    first_adapted: int
    num_layers: int
    source: str                                   # how it was found: "weights", "adapter_config"
    invocation_tokens: tuple[int, ...] | None = None
    adapted_until: int | None = None              # layers [adapted_until, L) are the producer's weights again
                                                  # (None: not known, or the adapted block reaches the top)

    @property
    def exact_plan(self) -> bool:
        """Whether it has an exact plan: an entry above shared layers, or an aLoRA's whole prefix."""
        return self.has_entry or self.invocation_tokens is not None

    @property
    def has_entry(self) -> bool:
        """Whether the consumer can enter at first_adapted from the producer's residual: some layers shared,
        some adapted (an aLoRA's prefix needs no entry: all of it is shared)."""
        return self.invocation_tokens is None and 0 < self.first_adapted < self.num_layers

    @property
    def recompute_fraction(self) -> float:
        """The share of the layers the consumer runs itself when it enters at first_adapted: its cost over
        its own prefill, by layer count (an aLoRA's prefix costs none)."""
        if self.invocation_tokens is not None:
            return 0.0
        return (self.num_layers - self.first_adapted) / self.num_layers

    def describe(self) -> str:
        if self.invocation_tokens is not None:
            return (f"activated LoRA: the prefix before its {len(self.invocation_tokens)} invocation tokens is the "
                    f"producer's cache exactly ({self.source})")
        if self.first_adapted == 0:
            return f"nothing shared exactly: the embeddings or layer 0 differ ({self.source})"
        shared = f"layers 0-{self.first_adapted - 1}" if self.first_adapted > 1 else "layer 0"
        return (f"{shared} of {self.num_layers} are the producer's exactly ({self.source}): entering at layer "
                f"{self.first_adapted} costs {self.recompute_fraction:.2f} of a prefill")

    def as_dict(self) -> dict:
        return {"first_adapted": self.first_adapted, "adapted_until": self.adapted_until,
                "num_layers": self.num_layers, "source": self.source,
                "invocation_tokens": list(self.invocation_tokens) if self.invocation_tokens is not None else None,
                "recompute_fraction": self.recompute_fraction}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _layer_tensors(model, l: int) -> dict[str, torch.Tensor]:
    return dict(model.model.layers[l].state_dict())


def from_weights(producer, consumer) -> SharedStructure:
    """The first layer of the consumer whose tensors differ from the producer's (0 when the token embeddings
    do), and the layer above the last that differs. Rotary tables are buffers computed from the config, which
    the pair shares (scd.online.models.check_pair)."""
    n = consumer.config.num_hidden_layers
    if not _same(dict(producer.model.embed_tokens.state_dict()), dict(consumer.model.embed_tokens.state_dict())):
        return SharedStructure(0, n, "weights")
    differ = [l for l in range(n) if not _same(_layer_tensors(producer, l), _layer_tensors(consumer, l))]
    first = differ[0] if differ else n
    until = differ[-1] + 1 if differ and differ[-1] + 1 < n else None
    return SharedStructure(first, n, "weights", adapted_until=until)


def find(producer, consumer, adapter_dir: str | Path | None = None) -> SharedStructure:
    """What the consumer shares with the producer: an aLoRA's invocation (from its adapter config), else the
    layers below the first adapted one (from the weights)."""
    found = from_weights(producer, consumer)
    act = activated.of(consumer)                 # loaded as an aLoRA (scd.online.models.load), else its config's
    tokens = act.invocation if act is not None else invocation_tokens(adapter_dir)
    if tokens is not None:
        return SharedStructure(found.first_adapted, found.num_layers, "adapter_config", tokens, found.adapted_until)
    return found


@torch.no_grad()
def verify(producer, consumer, structure: SharedStructure, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest absolute difference, over prefixes (B, T) with their mask, between what the structure says
    is shared: K and V at layers [0, first_adapted) and the residual entering first_adapted (real tokens
    only). An aLoRA's prefix (no invocation tokens in it) must agree at every layer. Float noise or 0.0 when
    the structure is right."""
    a = capture(producer, ids, mask, want_xnorm=False, want_hidden=True)
    b = capture(consumer, ids, mask, want_xnorm=False, want_hidden=True)
    real = mask.bool()                                         # (B, T)
    s = structure.num_layers if structure.invocation_tokens is not None else structure.first_adapted
    err = 0.0
    for l in range(s):
        for x, y in ((a.keys[l], b.keys[l]), (a.values[l], b.values[l])):     # (B, n_kv, T, d)
            err = max(err, float((x - y).abs().amax(dim=(1, 3))[real].max()))
    if s < structure.num_layers:
        err = max(err, float((a.hidden[s] - b.hidden[s]).abs().amax(-1)[real].max()))   # (B, T, H) entering s
    return err


def measured(producer, consumer, prefixes: list[torch.Tensor], pad_id: int | None,
             adapter_dir: str | Path | None = None, batch: int = 8) -> tuple[SharedStructure, dict]:
    """find(), then verify() on `prefixes` (1-D token id tensors), in batches: (the structure, its record for
    a manifest or a report: the structure's fields, `verified_max_abs` and the number of prefixes)."""
    structure = find(producer, consumer, adapter_dir)
    err = 0.0
    for i in range(0, len(prefixes), batch):
        ids, mask = pad(prefixes[i:i + batch], pad_id)
        err = max(err, verify(producer, consumer, structure, ids, mask))
    return structure, {**structure.as_dict(), "verified_max_abs": err, "verified_on": len(prefixes)}
