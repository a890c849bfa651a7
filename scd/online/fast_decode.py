"""One decode step of a Llama-shaped model in plain torch: the serving engines' batched step.

The same operations as transformers' forward over one new token per row (pre-norm RMSNorm, RoPE, grouped-query
attention over the rows' caches, SwiGLU MLP), without what that forward does per call beside them: building
attention masks and cache objects, routing keyword arguments through decorators, filling output containers.
On a CPU a small model's step is mostly that: the demo family's step costs about half of transformers' this way.
Models it does not cover (other architectures, sliding windows, PEFT models that run as themselves, RoPE whose
frequencies depend on the length) get None from `step_for`, and the caller runs transformers' forward.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

SUPPORTED = {"llama", "qwen2"}
STATIC_ROPE = {"default", "linear", "llama3"}          # inverse frequencies fixed at load


class FastStep:
    """Steps one model; built once per model (`step_for`). Holds references to the model's own weights, never to
    the model itself (`step_for`'s table is keyed weakly by it)."""

    def __init__(self, model):
        inner = model.model
        cfg = model.config
        self.embed, self.norm, self.head = inner.embed_tokens, inner.norm, model.lm_head
        self.eps = cfg.rms_norm_eps
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = inner.rotary_emb
        self.inv_freq, self.rope_scale = rope.inv_freq, float(getattr(rope, "attention_scaling", 1.0))
        self.layers = [(layer.input_layernorm.weight, layer.self_attn.q_proj, layer.self_attn.k_proj,
                        layer.self_attn.v_proj, layer.self_attn.o_proj, layer.post_attention_layernorm.weight,
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj) for layer in inner.layers]

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    @staticmethod
    def _rotate(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        return torch.cat([-t[..., half:], t[..., :half]], -1)

    @torch.no_grad()
    def __call__(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, pos: torch.Tensor,
                 tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """keys/values per layer (B, n_kv, T, d) post-RoPE, mask (B, T + 1) with the new column, pos (B,), tokens
        (B,) -> (next-token logits (B, V), keys and values per layer with the new token appended (B, n_kv, T+1, d))."""
        b, d = tokens.shape[0], self.d
        x = self.embed(tokens)[:, None]                                       # (B, 1, H)
        freqs = pos[:, None].float() * self.inv_freq.float()                  # (B, d/2)
        emb = torch.cat([freqs, freqs], -1)
        cos = (emb.cos() * self.rope_scale).to(x.dtype)[:, None, None]       # (B, 1, 1, d)
        sin = (emb.sin() * self.rope_scale).to(x.dtype)[:, None, None]
        allowed = mask.bool()[:, None, None]                                  # (B, 1, 1, T + 1)
        new_keys, new_values = [], []
        for (ln1, q_proj, k_proj, v_proj, o_proj, ln2, gate, up, down), k_cache, v_cache in zip(self.layers, keys,
                                                                                               values):
            h = self._rms(x, ln1)
            q = q_proj(h).view(b, 1, self.n_heads, d).transpose(1, 2)       # (B, heads, 1, d)
            k = k_proj(h).view(b, 1, self.n_kv, d).transpose(1, 2)          # (B, n_kv, 1, d)
            v = v_proj(h).view(b, 1, self.n_kv, d).transpose(1, 2)
            q = q * cos + self._rotate(q) * sin
            k = k * cos + self._rotate(k) * sin
            k_all, v_all = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed,
                                               enable_gqa=self.n_heads != self.n_kv)
            x = x + o_proj(o.transpose(1, 2).reshape(b, 1, self.n_heads * d))
            h = self._rms(x, ln2)
            x = x + down(F.silu(gate(h)) * up(h))
            new_keys.append(k_all)
            new_values.append(v_all)
        logits = self.head(self._rms(x, self.norm.weight))[:, -1]
        return logits, new_keys, new_values


def supported(model) -> bool:
    """Whether `step_for` covers this model (a plain transformers Llama or Qwen2 with a fixed RoPE)."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED or not hasattr(inner, "layers"):
        return False
    if type(model).__name__ not in ("LlamaForCausalLM", "Qwen2ForCausalLM"):       # a PEFT wrapper runs as itself
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return False
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    return getattr(inner.rotary_emb, "rope_type", "default") in STATIC_ROPE


_steps: "weakref.WeakKeyDictionary[object, FastStep | None]" = weakref.WeakKeyDictionary()


def step_for(model) -> FastStep | None:
    """The model's FastStep (made on first use), or None when it is not covered."""
    if model not in _steps:
        _steps[model] = FastStep(model) if supported(model) else None
    return _steps[model]


class StaticStep:
    """Decode steps over preallocated caches, for a GPU: a batch of `batch` rows keeps its keys and values in
    buffers of a fixed capacity per layer (batch, n_kv, capacity, d); each step writes the new token's key and
    value in place at its row's position and attends over the buffer under a mask of the filled positions.
    Nothing is allocated or reshaped between steps, so `capture()` records one step in a CUDA graph and `step`
    replays it: one launch per token instead of one per kernel, and no copy of the cache per token (FastStep's
    torch.cat). Without `capture()` (on a CPU) the same step runs eagerly.

    Grouped-query attention reads each KV head once: the query heads of a group attend as that group's rows."""

    def __init__(self, model, batch: int, capacity: int):
        fast = step_for(model)
        if fast is None:
            raise ValueError(f"{type(model).__name__} is not covered by fast_decode (see supported())")
        self.f, self.batch, self.capacity = fast, batch, capacity
        p = next(model.parameters())
        shape = (batch, fast.n_kv, capacity, fast.d)
        self.keys = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in fast.layers]
        self.values = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in fast.layers]
        self.filled = torch.zeros(batch, capacity, dtype=torch.bool, device=p.device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=p.device)        # the next token's position
        self.tokens = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.rows = torch.arange(batch, device=p.device)
        self.ones = torch.ones(batch, dtype=torch.bool, device=p.device)    # a captured step copies nothing in
        self.logits: torch.Tensor | None = None
        self.graph = None

    def load(self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Row `row` continues from this cache: keys/values per layer (1, n_kv, n, d), post-RoPE."""
        n = keys[0].shape[2]
        if n >= self.capacity:
            raise ValueError(f"a cache of {n} tokens does not fit a capacity of {self.capacity}")
        for buf, k in zip(self.keys, keys):
            buf[row, :, :n].copy_(k[0])
        for buf, v in zip(self.values, values):
            buf[row, :, :n].copy_(v[0])
        self.filled[row].zero_()
        self.filled[row, :n] = True
        self.pos[row] = n

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        f, b, d = self.f, self.batch, self.f.d
        group = f.n_heads // f.n_kv
        x = f.embed(self.tokens)[:, None]                                     # (B, 1, H)
        freqs = self.pos[:, None].float() * f.inv_freq.float()
        emb = torch.cat([freqs, freqs], -1)
        cos = (emb.cos() * f.rope_scale).to(x.dtype)[:, None, None]          # (B, 1, 1, d)
        sin = (emb.sin() * f.rope_scale).to(x.dtype)[:, None, None]
        self.filled.index_put_((self.rows, self.pos), self.ones)
        allowed = self.filled[:, None, None]                                  # (B, 1, 1, C)
        for (ln1, q_proj, k_proj, v_proj, o_proj, ln2, gate, up, down), k_buf, v_buf in zip(f.layers, self.keys,
                                                                                           self.values):
            h = f._rms(x, ln1)
            q = q_proj(h).view(b, 1, f.n_heads, d).transpose(1, 2)          # (B, heads, 1, d)
            k = k_proj(h).view(b, 1, f.n_kv, d).transpose(1, 2)             # (B, n_kv, 1, d)
            v = v_proj(h).view(b, 1, f.n_kv, d).transpose(1, 2)
            q = q * cos + f._rotate(q) * sin
            k = k * cos + f._rotate(k) * sin
            k_buf[self.rows, :, self.pos] = k[:, :, 0]
            v_buf[self.rows, :, self.pos] = v[:, :, 0]
            o = F.scaled_dot_product_attention(q.reshape(b, f.n_kv, group, d), k_buf, v_buf, attn_mask=allowed)
            x = x + o_proj(o.reshape(b, 1, f.n_heads * d))
            h = f._rms(x, ln2)
            x = x + down(F.silu(gate(h)) * up(h))
        self.pos.add_(1)
        return f.head(f._rms(x, f.norm.weight))[:, -1]

    def capture(self) -> None:
        """Record one step in a CUDA graph (after warm-up steps on a side stream, as torch requires). The
        warm-up and the recording advance nothing: positions and filled slots are restored after them."""
        pos, filled = self.pos.clone(), self.filled.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
                self.pos.copy_(pos)
                self.filled.copy_(filled)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        self.pos.copy_(pos)
        self.filled.copy_(filled)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row its token (batch,); returns the next logits (batch, V). The captured graph's output
        buffer is overwritten by the next step: copy what must outlive it."""
        self.tokens.copy_(tokens)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits
