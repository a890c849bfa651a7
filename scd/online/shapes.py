"""Timing families: models of a real architecture's shape with random weights, built where they run.

Weights cannot reach every machine the project is timed on (a GPU machine may reach no package index), and
timing does not depend on the weights' values. A model path `shape://NAME` (optionally `?seed=N`) names a
shape of SHAPES instead of a folder: `scd.online.models.load` builds it on the device it will run on, in the
shape's dtype there (bf16 on a GPU, fp32 on the CPU), with no host copy and nothing on disk, and gives it the
demo family's tokenizer (its ids fit every shape's vocabulary). Every answer served from such a model says
`timing_only`: its figures are timings, never quality.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from urllib.parse import parse_qs, urlparse

SCHEME = "shape://"
TOKENIZER = Path(__file__).resolve().parents[2] / "demo_models" / "base"   # 2048 ids


def _llama3(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


# The published configs' shapes (layers, widths, heads, vocabulary, RoPE); `tiny` is the same architecture
# small enough for CI, so that whatever runs at size has run on the CPU first.
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=2048, max_position_embeddings=16384,
                 rope_theta=500000.0, rope_scaling=_llama3(8.0), tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling=_llama3(32.0), tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling=_llama3(8.0), tie_word_embeddings=False),
}


class ShapeError(ValueError):
    """A `shape://` path that names no known shape, or a family that does not fit its device."""


@dataclass(frozen=True)
class ShapeRef:
    name: str
    seed: int = 0


def is_shape(path) -> bool:
    return str(path).startswith(SCHEME)


def parse(path: str) -> ShapeRef:
    """`shape://NAME[?seed=N]` -> ShapeRef; an unknown name or a bad seed is a ShapeError naming the shapes."""
    u = urlparse(str(path))
    name, query = u.netloc or u.path.lstrip("/"), parse_qs(u.query)
    if name not in SHAPES:
        raise ShapeError(f"{path}: no such shape; the shapes are {', '.join(SHAPES)}")
    try:
        seed = int(query.get("seed", ["0"])[0])
    except ValueError:
        raise ShapeError(f"{path}: seed must be an integer") from None
    unknown = set(query) - {"seed"}
    if unknown:
        raise ShapeError(f"{path}: unknown parameter(s) {sorted(unknown)}; only seed")
    return ShapeRef(name, seed)


@lru_cache(maxsize=1)
def _special_ids() -> dict[str, int]:
    """The tokenizer's BOS, EOS and pad ids, which a shape's config takes."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def config(name: str):
    from transformers import LlamaConfig
    return LlamaConfig(**SHAPES[name], rms_norm_eps=1e-5, **_special_ids())


def dtype_on(device: str):
    import torch
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def build(path: str, device: str = "cpu"):
    """(model, tokenizer) of a `shape://` path: random weights drawn on `device` from the path's seed, in
    dtype_on(device). The model carries `scd_weights_digest` (the path itself: the same path, the same
    weights) and `scd_timing_only`."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    ref = parse(path)
    cfg = config(ref.name)
    dtype = dtype_on(device)
    with torch.device(device):
        torch.manual_seed(ref.seed)
        if device != "cpu":
            torch.cuda.manual_seed(ref.seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(default)
    model.eval()
    model.scd_weights_digest = f"shape:{ref.name}:{ref.seed}"
    model.scd_timing_only = True
    tok = AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    tok.padding_side = "left"
    return model, tok


def params(name: str) -> int:
    """The shape's parameter count."""
    s = SHAPES[name]
    h, i, layers, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    return layers * per_layer + v * h * (1 if s["tie_word_embeddings"] else 2) + h


def kv_bytes(name: str, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of one sequence's K and V cache over `tokens` tokens."""
    s = SHAPES[name]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * tokens * dtype_bytes


def need_bytes(models: list[str], prefix_tokens: int, batch: int, dtype_bytes: int = 2) -> int:
    """What a family needs on one device: every model's weights (the producer's and each specialist's), and
    the KV of `batch` sequences of the longest prefix in each."""
    return sum(params(m) * dtype_bytes + batch * kv_bytes(m, prefix_tokens, dtype_bytes) for m in models)


def check_fits(models: list[str], prefix_tokens: int, batch: int, free_bytes: int, where: str,
               dtype_bytes: int = 2) -> None:
    """A ShapeError, in one line, when the family does not fit: what it needs, and what there is."""
    need = need_bytes(models, prefix_tokens, batch, dtype_bytes)
    if need > free_bytes:
        raise ShapeError(f"the timing family ({len(models)} models: {', '.join(sorted(set(models)))}) needs "
                         f"{need / 2**30:.1f} GiB on {where} (weights, and the KV of {batch} x {prefix_tokens} "
                         f"tokens each), and {free_bytes / 2**30:.1f} GiB is free there")


def check_family(cfg, free_bytes: int | None = None) -> None:
    """Refuse (ShapeError, one line) a deployment whose timing models do not fit one device: the producer and
    each specialist's first replicas (`min_replicas`, at least one), each with the KV of the configured batch
    (`limits.specialist_max_ongoing`) of the longest prefix (`limits.max_input_tokens`, else the shape's
    context) and the most tokens a request generates (`limits.max_tokens`): what a GPU engine's static decode
    caches hold (scd.online.decode.StaticBatch). On GPUs: the free memory of this machine's first GPU in
    bf16; on the CPU: the available memory in fp32. `free_bytes` overrides what is measured."""
    models = [(m, 1) for m in [cfg.producer] if is_shape(m.path)]
    models += [(s, max(1, s.autoscaling.min_replicas)) for s in cfg.specialists if is_shape(s.path)]
    if not models:
        return
    names = [parse(m.path).name for m, copies in models for _ in range(copies)]
    gpu = any(m.num_gpus > 0 for m, _ in models)
    tokens = (cfg.limits.max_input_tokens or max(SHAPES[n]["max_position_embeddings"] for n in names)) \
        + cfg.limits.max_tokens
    if free_bytes is None:
        free_bytes = _free_bytes(gpu)
    where = "the GPU" if gpu else "this machine (CPU)"
    check_fits(names, tokens, cfg.limits.specialist_max_ongoing, free_bytes, where, 2 if gpu else 4)


def _free_bytes(gpu: bool) -> int:
    import os
    if gpu:
        import torch
        if not torch.cuda.is_available():
            raise ShapeError("the timing family is placed on GPUs (num_gpus > 0) and this machine shows none")
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
