"""A Llama-shaped model's layers over new tokens on top of a cache, in plain torch: the serving engines' batched
decode step and a request's suffix.

The same operations as transformers' forward over new tokens (pre-norm RMSNorm, RoPE, grouped-query
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


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linear maps of the same input: the maps' own parameters become views
    of it, so one matmul computes all their outputs with no second copy of the weights. Made in the mode the
    weights were made in, whatever mode the caller is in (a serving engine builds its FastStep in inference
    mode): trainable parameters stay trainable, and a model built in inference mode keeps inference tensors."""
    with torch.inference_mode(linears[0].weight.is_inference()), torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row:row + n]
        if bias is not None:
            m.bias.data = bias[row:row + n]
        row += n
    return weight, bias


def lora_delta(factors: dict | None, kind: str, h: torch.Tensor) -> torch.Tensor | None:
    """The rows' low-rank terms of one projection kind for inputs h (B, S, in): factors[kind] = (A^T (B, in, r),
    B^T (B, r, out)) gathered by each row's adapter; None where nothing adapts that kind."""
    if factors is None or kind not in factors:
        return None
    a_t, b_t = factors[kind]
    return torch.bmm(torch.bmm(h, a_t), b_t)


def _plus(y: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    return y if delta is None else y + delta


class FastStep:
    """Runs one model's layers over new tokens on top of given caches; built once per model (`step_for`). The
    query, key and value projections run as one matmul, and the MLP's gate and up projections as another
    (`_fuse`: the model's own parameters become views of the fused weights). Holds references to the model's
    weights, never to the model itself (`step_for`'s table is keyed weakly by it)."""

    def __init__(self, model):
        inner = model.model
        cfg = model.config
        self.embed, self.norm, self.head = inner.embed_tokens, inner.norm, model.lm_head
        self.eps = cfg.rms_norm_eps
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = inner.rotary_emb
        self.inv_freq, self.rope_scale = rope.inv_freq, float(getattr(rope, "attention_scaling", 1.0))
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((layer.input_layernorm.weight, *_fuse([a.q_proj, a.k_proj, a.v_proj]), a.o_proj,
                                layer.post_attention_layernorm.weight, _fuse([m.gate_proj, m.up_proj])[0],
                                m.down_proj))

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)

    @staticmethod
    def _rotate(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        return torch.cat([-t[..., half:], t[..., :half]], -1)

    def _rope(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, S, 1, d) at positions (B, S)."""
        freqs = pos[..., None].float() * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], -1)
        return (emb.cos() * self.rope_scale).to(dtype)[:, :, None], (emb.sin() * self.rope_scale).to(dtype)[:, :, None]

    def _qkv(self, x, ln1, w_qkv, b_qkv, cos, sin, lora=None):
        """Queries (B, heads, S, d), keys and values (B, n_kv, S, d) of x (B, S, H), RoPE applied; `lora`: the
        rows' low-rank factors of this layer (lora_delta)."""
        b, s, d = x.shape[0], x.shape[1], self.d
        h = self._rms(x, ln1)
        qkv = _plus(F.linear(h, w_qkv, b_qkv), lora_delta(lora, "qkv", h)).view(b, s, self.n_heads + 2 * self.n_kv, d)
        qk = qkv[:, :, :self.n_heads + self.n_kv]
        qk = qk * cos + self._rotate(qk) * sin
        return (qk[:, :, :self.n_heads].transpose(1, 2), qk[:, :, self.n_heads:].transpose(1, 2),
                qkv[:, :, self.n_heads + self.n_kv:].transpose(1, 2))

    def _mlp(self, x, ln2, w_gate_up, down, lora=None):
        h = self._rms(x, ln2)
        gate, up = _plus(F.linear(h, w_gate_up), lora_delta(lora, "gate_up", h)).chunk(2, -1)
        a = F.silu(gate) * up
        return x + _plus(down(a), lora_delta(lora, "down", a))

    @torch.no_grad()
    def _run(self, keys, values, tokens, pos, allowed, lora: list[dict] | None = None, first: int = 0,
             x: torch.Tensor | None = None, taps: dict[int, torch.Tensor | None] | None = None):
        """tokens (B, S) at positions (B, S) over caches (B, n_kv, T, d) of layers first.. (one per layer),
        `allowed` (B, 1, S, T + S) -> (last position's logits (B, V), those layers' caches with the S tokens
        appended). `lora`: per layer from `first`, the rows' low-rank factors by projection kind
        (scd.online.lora_group.LoraGroup.factors). `x`: the residual entering layer `first` (default: the
        tokens' embeddings, first = 0). `taps`: layer -> None, filled with the residual entering that layer."""
        b, s = tokens.shape
        x = self.embed(tokens) if x is None else x                            # (B, S, H)
        cos, sin = self._rope(pos, x.dtype)
        new_keys, new_values = [], []
        for i, ((ln1, w_qkv, b_qkv, o_proj, ln2, w_gate_up, down), k_cache, v_cache) in enumerate(
                zip(self.layers[first:], keys, values), start=first):
            if taps is not None and i in taps:
                taps[i] = x
            lo = lora[i - first] if lora is not None else None
            q, k, v = self._qkv(x, ln1, w_qkv, b_qkv, cos, sin, lo)
            k_all, v_all = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed,
                                               enable_gqa=self.n_heads != self.n_kv)
            o = o.transpose(1, 2).reshape(b, s, self.n_heads * self.d)
            x = x + _plus(o_proj(o), lora_delta(lo, "o", o))
            x = self._mlp(x, ln2, w_gate_up, down, lo)
            new_keys.append(k_all)
            new_values.append(v_all)
        return self.head(self._rms(x[:, -1], self.norm.weight)), new_keys, new_values

    def empty(self, layers: int | None = None) -> list[torch.Tensor]:
        """Caches of no tokens (1, n_kv, 0, d), one per layer (the last `layers` of them)."""
        w = self.layers[0][1]
        return [w.new_zeros(1, self.n_kv, 0, self.d)] * (len(self.layers) if layers is None else layers)

    def __call__(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, pos: torch.Tensor,
                 tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """One decode step: keys/values per layer (B, n_kv, T, d) post-RoPE, mask (B, T + 1) with the new column,
        pos (B,), tokens (B,) -> (next-token logits (B, V), keys and values per layer with the new token appended
        (B, n_kv, T+1, d))."""
        return self._run(keys, values, tokens[:, None], pos[:, None], mask.bool()[:, None, None])

    def extend(self, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: torch.Tensor, **run
               ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """A suffix (1, S) run on top of one row's unpadded cache (1, n_kv, T, d) per layer (none for an empty
        prefix): (its last position's logits (1, V), the caches with the suffix appended). `run`: _run's
        lora, first, x and taps."""
        if not keys:
            keys = values = self.empty()
        t, s = keys[0].shape[2], tokens.shape[1]
        pos = torch.arange(t, t + s, device=tokens.device)[None]
        allowed = torch.ones(s, t + s, dtype=torch.bool, device=tokens.device).tril(t)[None, None]
        return self._run(keys, values, tokens, pos, allowed, **run)


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
    A step may run the first `n` rows over the first `length` positions only (every row's position below it):
    nothing is allocated or reshaped between steps of one shape, so `capture(n, length)` records that shape's
    step in a CUDA graph and `step` replays it: one launch per token instead of one per kernel, and no copy of
    the cache per token (FastStep's torch.cat). The graphs share one memory pool. Without a captured graph for
    a shape (on a CPU) the same step runs eagerly.

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
        self.graphs: dict[tuple[int, int], tuple] = {}          # (n, length) -> (its CUDA graph, its logits)
        self.pool = None

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

    def move(self, src: int, dst: int, length: int) -> None:
        """Row `dst` takes row `src`'s cache (its first `length` positions) and position."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length].copy_(buf[src, :, :length])
        self.filled[dst].copy_(self.filled[src])
        self.pos[dst] = self.pos[src]

    def clear(self, first: int, stop: int | None = None) -> None:
        """Rows first..stop-1 hold nothing: no filled position, the next at 0 (a step over them then attends to
        its own token alone, and never runs past the buffer)."""
        self.filled[first:stop].zero_()
        self.pos[first:stop].zero_()

    @torch.no_grad()
    def _forward(self, n: int, length: int) -> torch.Tensor:
        f, d = self.f, self.f.d
        group = f.n_heads // f.n_kv
        rows, pos, filled = self.rows[:n], self.pos[:n], self.filled[:n, :length]
        x = f.embed(self.tokens[:n])[:, None]                                 # (n, 1, H)
        cos, sin = f._rope(pos[:, None], x.dtype)
        filled.index_put_((rows, pos), self.ones[:n])
        allowed = filled[:, None, None]                                       # (n, 1, 1, length)
        for (ln1, w_qkv, b_qkv, o_proj, ln2, w_gate_up, down), k_buf, v_buf in zip(f.layers, self.keys,
                                                                                  self.values):
            q, k, v = f._qkv(x, ln1, w_qkv, b_qkv, cos, sin)                 # (n, heads or n_kv, 1, d)
            k_buf, v_buf = k_buf[:n, :, :length], v_buf[:n, :, :length]
            k_buf[rows, :, pos] = k[:, :, 0]
            v_buf[rows, :, pos] = v[:, :, 0]
            o = F.scaled_dot_product_attention(q.reshape(n, f.n_kv, group, d), k_buf, v_buf, attn_mask=allowed)
            x = x + o_proj(o.reshape(n, 1, f.n_heads * d))
            x = f._mlp(x, ln2, w_gate_up, down)
        pos.add_(1)
        return f.head(f._rms(x[:, -1], f.norm.weight))

    def _shape(self, n: int | None, length: int | None) -> tuple[int, int]:
        n, length = n or self.batch, length or self.capacity
        if not (1 <= n <= self.batch and 1 <= length <= self.capacity):
            raise ValueError(f"a step over {n} rows and {length} positions does not fit {self.batch} rows of "
                             f"{self.capacity}")
        return n, length

    def capture(self, n: int | None = None, length: int | None = None) -> None:
        """Record the step over the first n rows (default: all) and `length` positions (default: the capacity)
        in a CUDA graph (after warm-up steps on a side stream, as torch requires). The warm-up and the recording
        advance nothing: positions and filled slots are restored after them."""
        n, length = self._shape(n, length)
        pos, filled = self.pos.clone(), self.filled.clone()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(n, length)
                    self.pos.copy_(pos)
                    self.filled.copy_(filled)
            torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: an engine's other threads (prefills, rebuilds) may use the device meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = self._forward(n, length)
            self.graphs[(n, length)] = (graph, logits)
        finally:
            self.pos.copy_(pos)
            self.filled.copy_(filled)

    def step(self, tokens: torch.Tensor, n: int | None = None, length: int | None = None) -> torch.Tensor:
        """Step the first n rows (default: all) over the first `length` positions (default: the capacity): the
        first len(tokens) of them are fed `tokens`, the rest their last token again (spare rows, whose output
        nobody reads); returns the n rows' next logits (n, V). A captured graph's output buffer is overwritten
        by the next step of any shape (the graphs share their memory): copy what must outlive it."""
        n, length = self._shape(n, length)
        self.tokens[:len(tokens)].copy_(tokens)
        if (n, length) not in self.graphs:
            return self._forward(n, length)
        graph, logits = self.graphs[(n, length)]
        graph.replay()
        return logits
