"""Loading producer/consumer models from local paths and checking that a pair can share codes.

SCD needs the two models to agree on everything that shapes a KV cache: architecture family, layer count,
KV head count, head dim, hidden size and the token vocabulary. Weights may differ (that is the point).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


class IncompatiblePairError(ValueError):
    """Producer and consumer cannot share codes; the message names every mismatch."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    rope_theta: float

    @classmethod
    def from_config(cls, cfg) -> "ModelSpec":
        if cfg.model_type not in SUPPORTED_TYPES:
            raise IncompatiblePairError(f"model_type {cfg.model_type!r} is not supported; use one of {SUPPORTED_TYPES}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        return cls(cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                   head_dim, cfg.hidden_size, cfg.vocab_size, float(theta))

    @property
    def kv_bytes_per_token(self) -> int:
        """Raw KV of one token over all layers in bf16 (the payload ratio's denominator)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 2

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def check_pair(producer: ModelSpec, consumer: ModelSpec, tok_a: str | None = None, tok_b: str | None = None) -> None:
    """Raise IncompatiblePairError naming every field that differs (tokenizer fingerprints included if given)."""
    diffs = [f"{k}: producer={v!r} consumer={getattr(consumer, k)!r}"
             for k, v in asdict(producer).items() if k != "rope_theta" and v != getattr(consumer, k)]
    if producer.rope_theta != consumer.rope_theta:
        diffs.append(f"rope_theta: producer={producer.rope_theta} consumer={consumer.rope_theta}")
    if tok_a is not None and tok_b is not None and tok_a != tok_b:
        diffs.append(f"tokenizer: producer={tok_a} consumer={tok_b}")
    if diffs:
        raise IncompatiblePairError("incompatible producer/consumer pair: " + "; ".join(diffs))


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary (token -> id): two tokenizers with equal fingerprints split text identically."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def load(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer, spec) from a local HF folder; never touches the network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token         # else no pad token at all: padding uses any id (masked)
    tokenizer.padding_side = "left"
    return model, tokenizer, ModelSpec.from_config(model.config)


def load_pair(producer_path: str | Path, consumer_path: str | Path, dtype: torch.dtype = torch.float32):
    """Load both models and refuse an incompatible pair before any work is done."""
    a, tok_a, spec_a = load(producer_path, dtype)
    b, tok_b, spec_b = load(consumer_path, dtype)
    check_pair(spec_a, spec_b, tokenizer_fingerprint(tok_a), tokenizer_fingerprint(tok_b))
    return a, b, tok_a, spec_a
