"""Loading producer/consumer models from local paths and checking that a pair can share codes.

SCD needs the two models to agree on everything that shapes a KV cache: architecture family, layer count,
KV head count, head dim, hidden size and the token vocabulary. Weights may differ (that is the point).
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from scd.online import activated, shapes
from scd.online.model_files import adapter_base, invocation_tokens, is_adapter, model_problem, named_base

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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
    rope_scaling: str = ""      # the RoPE variant beyond theta (e.g. llama3 scaling) as sorted JSON; "" = plain

    @classmethod
    def from_config(cls, cfg) -> "ModelSpec":
        if cfg.model_type not in SUPPORTED_TYPES:
            raise IncompatiblePairError(f"model_type {cfg.model_type!r} is not supported; use one of {SUPPORTED_TYPES}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if isinstance(rope, dict) else {}
        if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1:
            scaling = {}
        return cls(cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                   head_dim, cfg.hidden_size, cfg.vocab_size, float(theta),
                   json.dumps(scaling, sort_keys=True) if scaling else "")

    @property
    def kv_bytes_per_token(self) -> int:
        """Raw KV of one token over all layers in bf16 (the payload ratio's denominator)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 2

    def fingerprint(self) -> str:
        fields = asdict(self)
        if not fields["rope_scaling"]:       # plain RoPE hashes without the field: artifacts stay valid
            del fields["rope_scaling"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


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


def folder_digest(path: str | Path) -> str:
    """sha256 over the names and bytes of a model folder's weight files (*.safetensors), streamed, 32 hex."""
    h = hashlib.sha256()
    files = sorted(Path(path).expanduser().glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    for f in files:
        h.update(f"{f.name}\n".encode())
        with open(f, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()[:32]


def weights_digest(model: "torch.nn.Module | dict[str, torch.Tensor]") -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every state_dict entry in sorted name order, 32 hex."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        # a uint8 view is a zero-copy byte image that works for every dtype (bf16 included)
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:32]


def model_digest(model: torch.nn.Module) -> str:
    """A loaded model's identity: `scd_weights_digest` for an adapter merged at load (see load), else
    weights_digest of its state_dict."""
    return getattr(model, "scd_weights_digest", None) or weights_digest(model)


def data_digest(prefixes) -> str:
    """sha256 over the token ids of the calibration prefixes, in order (same data -> same digest), 32 hex.
    Keys the checkpoint folder, and the registry records it in each manifest (as calibration_digest)."""
    h = hashlib.sha256()
    for p in prefixes:
        t = torch.as_tensor(p).detach().to("cpu", torch.int64).contiguous()
        h.update(f"{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:32]


def merged_digest(base: str | Path, adapter: str | Path) -> str:
    """The identity of an adapter merged into its base (`scd_weights_digest`, see load), from the two folders:
    the same wherever and however the merge is computed (a LoRA group holds it unmerged)."""
    return hashlib.sha256(f"{folder_digest(base)}+{adapter_digest(adapter)}".encode()).hexdigest()[:32]


def adapter_digest(path: str | Path) -> str:
    """sha256 over an adapter's config and weights (what decides the merged model), 32 hex."""
    p = Path(path).expanduser()
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        f = p / name
        if not f.is_file():
            raise FileNotFoundError(f"{p} is not a PEFT adapter folder (no {name})")
        h.update(f"{name}\n".encode() + f.read_bytes())
    return h.hexdigest()[:32]


def load(path: str | Path, dtype: torch.dtype = torch.float32, base: str | Path | None = None, device: str = "cpu"):
    """(model, tokenizer, spec) from a local HF folder, or from a PEFT adapter folder merged into its base
    (`base`, or the one the adapter names); never touches the network. A `shape://` path (scd.online.shapes)
    is a timing model built with random weights on `device`, in that device's dtype; a folder's model is
    loaded on the CPU in `dtype` (the caller moves it).

    A merged model carries `scd_weights_digest` = sha256(base folder digest + adapter digest): its identity
    for artifact fingerprints, which the float rounding of a merge on another machine cannot change."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not sys.stderr.isatty():      # a log (a job's, an actor's) keeps each update of transformers' loading bar
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    if shapes.is_shape(path):
        model, tokenizer = shapes.build(str(path), device)
        return model, tokenizer, ModelSpec.from_config(model.config)
    p = Path(path).expanduser()
    if (problem := model_problem(p, base)) is not None:
        raise FileNotFoundError(problem)
    adapter = is_adapter(p)
    src = adapter_base(p, base) if adapter else p
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=True)
    if adapter:
        from peft import PeftModel
        invocation = invocation_tokens(p)
        base_weights = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=True).eval() \
            if invocation else None
        config = None
        if invocation:                           # PEFT cannot merge an aLoRA: merged as the LoRA it is once on
            from peft import PeftConfig
            config = PeftConfig.from_pretrained(str(p))
            config.alora_invocation_tokens = None
        model = PeftModel.from_pretrained(model, str(p), config=config, is_trainable=False).merge_and_unload()
        model.scd_weights_digest = merged_digest(src, p)
        if invocation:                           # an activated LoRA: merged for the tokens it adapts only
            model.scd_activation = activated.Activation(base_weights, invocation)
    model.eval()
    tok_dir = p if adapter and (p / "tokenizer_config.json").is_file() else src
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token         # else no pad token at all: padding uses any id (masked)
    tokenizer.padding_side = "left"
    return model, tokenizer, ModelSpec.from_config(model.config)


def load_pair(producer_path: str | Path, consumer_path: str | Path, dtype: torch.dtype = torch.float32,
              consumer_base: str | Path | None = None, log=print):
    """Load both models and refuse an incompatible pair before any work is done. The consumer may be a PEFT
    adapter folder, merged into `consumer_base`, else the base it names; an adapter that names a hub model
    (as most do) instead of a local folder is merged into the producer, and `log` says so (a base of another
    architecture is refused when the adapter's weights do not fit it)."""
    a, tok_a, spec_a = load(producer_path, dtype)
    if consumer_base is None and is_adapter(consumer_path):
        try:
            adapter_base(consumer_path)
        except FileNotFoundError:
            consumer_base = producer_path
            log(f"adapter {consumer_path} names base {named_base(consumer_path)!r}, not a local folder: merging it "
                f"into the producer {producer_path} (--consumer-base picks another)")
    try:
        b, tok_b, spec_b = load(consumer_path, dtype, base=consumer_base)
    except RuntimeError as e:                     # PEFT: the adapter's weights do not fit the base's shapes
        raise IncompatiblePairError(f"adapter {consumer_path} does not fit base {consumer_base}: "
                                    f"{str(e).splitlines()[0]}") from None
    check_pair(spec_a, spec_b, tokenizer_fingerprint(tok_a), tokenizer_fingerprint(tok_b))
    return a, b, tok_a, spec_a
