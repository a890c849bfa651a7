"""The decode loop: continuous batching of decode steps (nano-vllm's scheduler loop, reduced to one model),
and the sampler. Serving engines run it on a thread (engines/batching.py); `generate` runs it to the end for
`scd eval` and the tests. There is no other.

Each request first gets its own cache: its prefix rebuilt from codes or prefilled, then its suffix (the
prompt's own tokens) run on top, which gives its first next-token logits. From then on it is a row of one
left-padded batch: every decode step is one forward pass for all running requests, whatever their lengths
(per-row positions, padding masked out). Requests join between steps, up to `max_batch` rows; a longer
one re-pads the batch on the left, and the columns nobody needs any more are trimmed when rows leave. On a GPU
a model fast_decode covers decodes from preallocated caches instead (StaticBatch: the same interface, each
step shape replayed from a CUDA graph).

The loop deals in token ids only: each request's `on_token` callback gets every token it generates, with its
logprobs when the request asked for them (detokenizing and stop strings are the caller's), and says whether to
go on. The end-of-sequence token ends a row unless the request masks it (`min_tokens`, `ignore_eos`).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from scd.online import fast_decode
from scd.online.api import GenParams, TokenLogprobs
from scd.online.cache import assemble, cache_arg, extend
from scd.online.lora_group import LoraGroup

log = logging.getLogger(__name__)


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """logits (V,) of one position -> the TokenLogprobs of `token` with the k most likely alternatives."""
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(k) if k > 0 else None
    return TokenLogprobs(float(lp[token]), tuple(zip(top.indices.tolist(), top.values.tolist())) if top else ())


@torch.no_grad()
def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution (B, V) that sampling at `temperature` (> 0) with nucleus `top_p` draws from."""
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p                 # always keeps the top token
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    return probs / probs.sum(-1, keepdim=True)


@torch.no_grad()
def pick(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """The next token of each row of logits (B, V): greedy at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=generator).squeeze(-1)


def eos_masked(params: GenParams, n_out: int) -> bool:
    """Whether a row that has generated n_out tokens may not end now: `min_tokens` not reached, or `ignore_eos`."""
    return params.ignore_eos or n_out < params.min_tokens


def mask_eos(logits: torch.Tensor, params: GenParams, n_out: int, eos_id: int | None) -> torch.Tensor:
    """A row's next-token logits (V,) as the sampler sees them, (1, V) float, once it has generated n_out
    tokens: eos masked out where `eos_masked`."""
    logits = logits[None].float()
    if eos_id is not None and eos_masked(params, n_out):
        logits[0, eos_id] = float("-inf")
    return logits


@torch.no_grad()
def verify(drafts: list[int], draft_probs: list[torch.Tensor] | None, target_logits: torch.Tensor,
           params: GenParams, eos_id: int | None, generator=None) -> tuple[int, int | None]:
    """Speculative decoding's check of drafted tokens against the target model: target_logits (k+1, V) are
    the target's next-token logits before each of the k drafts and after the last one. Returns (how many
    drafts are accepted, the token that follows them: the target's correction of the first rejected draft, or
    its next token after all k; None when all k are accepted and k reached max_tokens).

    Greedy (temperature 0): a draft is accepted while it is the target's argmax, so the output is the
    target's greedy output token for token. Sampled: draft x_i, drawn from draft_probs[i] (q), is accepted
    with probability min(1, p(x_i) / q(x_i)) under the target's distribution p (same temperature, top-p and
    eos mask); the first rejected one is replaced by a draw from max(0, p - q), normalised. Then every token
    emitted is distributed as the target's own sampling would be (Leviathan et al. 2023, Chen et al. 2023)."""
    greedy = params.temperature <= 0
    for i, x in enumerate(drafts):
        logits = mask_eos(target_logits[i], params, i, eos_id)
        if greedy:
            best = int(logits.argmax(-1)[0])
            if x != best:
                return i, best
            continue
        p = sampling_probs(logits, params.temperature, params.top_p)[0]
        q = draft_probs[i]
        if float(torch.rand((), generator=generator)) * float(q[x]) < float(p[x]):
            continue
        residual = (p - q.to(p.device)).clamp(min=0)
        residual = residual / residual.sum() if float(residual.sum()) > 0 else p
        return i, int(torch.multinomial(residual, 1, generator=generator)[0])
    k = len(drafts)
    if k >= params.max_tokens or (k and drafts[-1] == eos_id):
        return k, None
    logits = mask_eos(target_logits[k], params, k, eos_id)
    return k, int(pick(logits, params.temperature, params.top_p, generator)[0])


@dataclass
class Row:
    """One running request."""
    keys: list[torch.Tensor]                    # per layer (1, n_kv, L, d): its whole cache so far
    values: list[torch.Tensor]
    logits: torch.Tensor                        # (V,) its next token's logits
    params: GenParams
    on_token: Callable[[int, TokenLogprobs | None], bool] | None = None   # a generated token -> go on?
    on_done: Callable[[str, int], None] | None = None     # (finish reason "stop" | "length", tokens generated)
    generator: torch.Generator | None = None
    n_out: int = 0
    draft_probs: list[torch.Tensor] | None = None   # a draft row (exact mode, sampled): each pick's distribution
    feed: int | None = None                     # a token already emitted, fed at the row's first step instead of
                                                # a pick (exact mode: the token after the verified drafts)
    adapter: int = 0                            # a LoRA group's row: its adapter's index (0: the base)


@dataclass
class Batch:
    """The running rows' caches as one left-padded batch: keys/values per layer (B, n_kv, T, d), mask (B, T),
    next position of each row (B,), and each row's adapter in a LoRA group (B,)."""
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    mask: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    adapters: torch.Tensor | None = None
    rows: list[Row] = field(default_factory=list)

    def join(self, row: Row) -> None:
        n = row.keys[0].shape[2]
        mask = torch.ones(1, n, dtype=torch.long, device=row.logits.device)
        pos = torch.tensor([n], device=row.logits.device)
        adapter = torch.tensor([row.adapter], device=row.logits.device)
        if not self.rows:
            self.keys, self.values, self.mask, self.pos = list(row.keys), list(row.values), mask, pos
            self.adapters = adapter
        else:
            t = self.mask.shape[1]
            pad_old, pad_new = max(0, n - t), max(0, t - n)
            left = lambda x, p: F.pad(x, (0, 0, p, 0)) if p else x          # noqa: E731  (B, n_kv, T, d)
            self.keys = [torch.cat([left(a, pad_old), left(b, pad_new)]) for a, b in zip(self.keys, row.keys)]
            self.values = [torch.cat([left(a, pad_old), left(b, pad_new)]) for a, b in zip(self.values, row.values)]
            self.mask = torch.cat([F.pad(self.mask, (pad_old, 0)), F.pad(mask, (pad_new, 0))])
            self.pos = torch.cat([self.pos, pos])
            self.adapters = torch.cat([self.adapters, adapter])
        row.keys = row.values = None                 # the batch holds them now
        self.rows.append(row)

    def keep(self, idx: list[int]) -> None:
        """Only these rows stay; columns that are padding in every remaining row go."""
        if not idx:
            self.keys, self.values, self.mask, self.pos, self.adapters, self.rows = [], [], None, None, None, []
            return
        sel = torch.tensor(idx, device=self.mask.device)
        mask = self.mask.index_select(0, sel)
        first = int(mask.any(0).nonzero()[0])
        self.keys = [k.index_select(0, sel)[:, :, first:] for k in self.keys]
        self.values = [v.index_select(0, sel)[:, :, first:] for v in self.values]
        self.mask, self.pos = mask[:, first:], self.pos.index_select(0, sel)
        self.adapters = self.adapters.index_select(0, sel)
        self.rows = [self.rows[i] for i in idx]

    @property
    def device(self) -> torch.device:
        return self.mask.device

    def step(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row its token (B,); returns the next logits (B, V). A LoRA group steps its rows of mixed
        adapters in one pass; a model fast_decode covers steps in plain torch, any other through transformers'
        forward."""
        mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        if isinstance(model, LoraGroup):
            logits, self.keys, self.values = model.step(self.keys, self.values, mask, self.pos, tokens, self.adapters)
        elif (fast := fast_decode.step_for(model)) is not None:
            logits, self.keys, self.values = fast(self.keys, self.values, mask, self.pos, tokens)
        else:
            cache = assemble(model, list(zip(self.keys, self.values)))
            out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=self.pos[:, None],
                        use_cache=True, **cache_arg(model, cache))
            self.keys = [layer.keys for layer in cache.layers]
            self.values = [layer.values for layer in cache.layers]
            logits = out.logits[:, -1]
        self.mask, self.pos = mask, self.pos + 1
        return logits


def _bucket(x: int, top: int, least: int = 1) -> int:
    """The smallest power of two that is at least x and `least`, at most `top`."""
    b = least
    while b < x:
        b *= 2
    return min(b, top)


class StaticBatch:
    """Batch's interface (join, keep, step, rows, device) over preallocated caches (fast_decode.StaticStep), for
    a GPU: `max_batch` rows of `capacity` positions each, allocated once. The running rows hold the first slots,
    in order (a row that leaves makes the later ones move down). A step runs the rows' count rounded up to a
    power of two over the longest row's length rounded up to one (at least MIN_LENGTH), so a few shapes serve
    every batch; with `graphs` each shape's step is captured in a CUDA graph at its first use and replayed from
    then on. A row whose cache and tokens to come do not fit its capacity is refused at join (ValueError)."""
    MIN_LENGTH = 256

    def __init__(self, model, max_batch: int, capacity: int, graphs: bool):
        self.st = fast_decode.StaticStep(model, max_batch, capacity)
        self.graphs = graphs
        self.rows: list[Row] = []
        self.lengths: list[int] = []                 # each row's cached tokens (its next position), on the host

    @property
    def device(self) -> torch.device:
        return self.st.pos.device

    def join(self, row: Row) -> None:
        n = row.keys[0].shape[2]
        if n + row.params.max_tokens - row.n_out >= self.st.capacity:
            raise ValueError(f"a row of {n} cached tokens with {row.params.max_tokens - row.n_out} to come does "
                             f"not fit the static cache's {self.st.capacity} positions")
        self.st.load(len(self.rows), row.keys, row.values)
        row.keys = row.values = None
        self.rows.append(row)
        self.lengths.append(n)

    def keep(self, idx: list[int]) -> None:
        """Only these rows stay (idx ascending), moved down to the first slots."""
        for j, i in enumerate(idx):
            if i != j:
                self.st.move(i, j, self.lengths[i])
        self.st.clear(len(idx), len(self.rows))
        self.rows = [self.rows[i] for i in idx]
        self.lengths = [self.lengths[i] for i in idx]

    def step(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row its token (B,); returns the next logits (B, V)."""
        n = len(self.rows)
        shape = (_bucket(n, self.st.batch), _bucket(max(self.lengths) + 1, self.st.capacity, self.MIN_LENGTH))
        self.st.clear(n, shape[0])                   # the slots past the rows: stepped too, over their own token
        if self.graphs and shape not in self.st.graphs:
            try:
                self.st.capture(*shape)
            except RuntimeError as e:            # the same steps, eagerly: slower, never wrong
                log.warning("a CUDA graph of the decode step could not be captured (%s); stepping eagerly", e)
                self.graphs = False
        logits = self.st.step(tokens, *shape)[:n].clone()
        self.lengths = [t + 1 for t in self.lengths]
        return logits


class Decoder:
    """Rows waiting and the running batch: `admit()` lets waiting rows in (up to max_batch); `step()` picks
    each running row's token with its own sampling settings, hands it over, drops finished rows, and runs one
    batched forward pass for the rest. One thread steps it (BatchDecoder's); others only append to `waiting`.
    `static_capacity`: the running rows' caches are preallocated, that many positions a row (StaticBatch;
    `graphs`: each step shape replayed from a CUDA graph); None: one left-padded batch grown per step (Batch)."""

    def __init__(self, model, eos_id: int | None, max_batch: int = 8, static_capacity: int | None = None,
                 graphs: bool = False):
        self.model, self.eos_id, self.max_batch = model, eos_id, max_batch
        self.waiting: deque[Row] = deque()
        self.batch = Batch() if static_capacity is None else StaticBatch(model, max_batch, static_capacity, graphs)
        self.steps = 0                               # batched forward passes so far
        self.rows_stepped = 0                        # rows those passes carried (rows_stepped / steps = mean batch)

    def busy(self) -> bool:
        return bool(self.waiting or self.batch.rows)

    def admit(self) -> None:
        while self.waiting and len(self.batch.rows) < self.max_batch:
            row = self.waiting.popleft()
            try:
                self.batch.join(row)
            except ValueError as e:                  # a row the static caches cannot hold: it ends, the rest go on
                row.on_done(f"error: {e}", row.n_out)

    @torch.no_grad()
    def step(self) -> None:
        """One token for every running row (admit() first lets waiting rows in)."""
        try:
            self._step()
        except Exception as e:                       # noqa: BLE001 - fail the rows, keep the loop for the next ones
            for row in self.batch.rows:
                row.on_done(f"error: {type(e).__name__}: {e}", row.n_out)
            self.batch.keep([])

    def _greedy(self, rows: list[Row]) -> dict[int, int]:
        """The next token of each row that picks greedily (temperature 0, nothing to feed), by index: one argmax
        over their logits stacked, so the device is waited for once a step, not once a row."""
        idx = [i for i, r in enumerate(rows) if r.feed is None and r.params.temperature <= 0]
        if not idx:
            return {}
        logits = torch.stack([rows[i].logits for i in idx]).float()
        if self.eos_id is not None:
            masked = [j for j, i in enumerate(idx) if eos_masked(rows[i].params, rows[i].n_out)]
            logits[masked, self.eos_id] = float("-inf")
        return dict(zip(idx, logits.argmax(-1).tolist()))

    def _step(self) -> None:
        rows = self.batch.rows
        greedy = self._greedy(rows)
        picked, live = [], []
        for i, row in enumerate(rows):
            if row.feed is not None:
                picked.append(row.feed)
                live.append(i)
                row.feed = None
                continue
            p = row.params
            if i in greedy:
                nxt = greedy[i]
            else:                                    # sampled, with the row's own generator
                logits = mask_eos(row.logits, p, row.n_out, self.eos_id)
                if row.draft_probs is not None:
                    q = sampling_probs(logits, p.temperature, p.top_p)
                    row.draft_probs.append(q[0])
                    nxt = int(torch.multinomial(q, 1, generator=row.generator)[0, 0])
                else:
                    nxt = int(pick(logits, p.temperature, p.top_p, row.generator)[0])
            finish = None
            if nxt == self.eos_id:
                finish = "stop"
            else:
                row.n_out += 1
                lp = token_logprobs(row.logits, nxt, p.logprobs) if p.logprobs is not None else None
                if not row.on_token(nxt, lp):
                    finish = "stop"
                elif row.n_out >= row.params.max_tokens:
                    finish = "length"
            if finish:
                row.on_done(finish, row.n_out)
            else:
                picked.append(nxt)
                live.append(i)
        if len(live) < len(rows):
            self.batch.keep(live)
        if not live:
            return
        tokens = torch.tensor(picked, device=self.batch.device)
        logits = self.batch.step(self.model, tokens)
        self.steps, self.rows_stepped = self.steps + 1, self.rows_stepped + len(live)
        for row, lg in zip(self.batch.rows, logits):
            row.logits = lg


def _done(finish: str, got: list[int], eos_id: int | None) -> None:
    if finish.startswith("error"):
        raise RuntimeError(f"decode failed: {finish}")
    if finish == "stop":                      # generate's rows never stop on their own: this was eos
        got.append(eos_id)


@torch.no_grad()
def generate(model, cache, prefix_mask: torch.Tensor, first_ids: torch.Tensor, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, eos_id: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """New tokens (B, <= max_new_tokens) after feeding first_ids (B, S) on top of a (left-padded) prefix
    cache, through the serving engines' decode loop. A row that hits eos ends with it and is padded with it;
    the output is as long as the longest row."""
    if max_new_tokens < 1:
        return first_ids[:, :0]
    logits, mask = extend(model, cache, prefix_mask, first_ids)
    dec = Decoder(model, eos_id, max_batch=first_ids.shape[0])
    out: list[list[int]] = [[] for _ in range(first_ids.shape[0])]
    for i in range(first_ids.shape[0]):
        valid = mask[i].nonzero()
        first = int(valid[0])
        if len(valid) != mask.shape[1] - first:
            raise ValueError(f"row {i} of the prefix mask is not left padding")
        keys = [layer.keys[i:i + 1, :, first:] for layer in cache.layers]
        values = [layer.values[i:i + 1, :, first:] for layer in cache.layers]
        on_token = lambda t, _lp, got=out[i]: got.append(t) or True        # noqa: E731
        on_done = lambda finish, n, got=out[i]: _done(finish, got, eos_id)                     # noqa: E731
        dec.waiting.append(Row(keys, values, logits[i, -1], GenParams(max_tokens=max_new_tokens,
                                                                      temperature=temperature, top_p=top_p),
                               on_token, on_done, generator))
    while dec.busy():
        dec.admit()
        dec.step()
    width = max(len(o) for o in out)
    pad = eos_id if eos_id is not None else 0
    return torch.tensor([o + [pad] * (width - len(o)) for o in out], device=first_ids.device)
