"""LoRA adapters served unmerged on one base model: rows of different adapters in one batch.

A group holds the base once and, per adapter, its low-rank factors as PEFT saved them (adapter_config.json and
adapter_model.safetensors, read without building a PEFT model). A forward over a batch runs the base's matmuls
once for every row and adds each row's own low-rank term, gathered by the row's adapter index, as Punica's and
S-LoRA's batched LoRA kernels do (here two batched matmuls per projection): for a projection W and a row of
adapter a,

    y = x W^T + s_a (x A_a^T) B_a^T

with s_a the adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA). Index 0 is the base itself (no
factors), so base rows and adapter rows share a batch. The projections that FastStep fuses (q, k, v; gate, up)
take one gathered pair of factors for the fused output: their A's stacked, their B's block-diagonal.

Adapters of different ranks share the stacks at the largest rank (zero-padded: the padding adds zeros). Only
LoRA on the attention and MLP projections of a model fast_decode covers; DoRA, embedding or head adapters are
refused by `read_adapter`, in one line. An activated LoRA (aLoRA, scd.online.activated) runs on the base's
weights up to its invocation's last occurrence and with its factors from there: a prefix without the
invocation is the base's cache, computed once for the group and not copied.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from scd.online import activated, fast_decode
from scd.online.api import AdapterError

# the projections a group adapts, as FastStep runs them: (fused kind, its modules in fused order)
KINDS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
MODULE_KIND = {m: k for k, ms in KINDS.items() for m in ms}


@dataclass
class Adapter:
    """One adapter's factors: (layer, module) -> (A (r, in), B (out, r) scaled by the adapter's scaling)."""
    name: str
    path: str
    rank: int
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    invocation: tuple[int, ...] | None = None     # an activated LoRA's invocation token ids


def _module_of(key: str) -> tuple[int, str, str] | None:
    """(layer, module, 'lora_A' | 'lora_B') of a PEFT weight name, or None for anything else."""
    parts = key.split(".")
    if "layers" not in parts or not any(p in ("lora_A", "lora_B") for p in parts):
        return None
    layer = int(parts[parts.index("layers") + 1])
    ab = "lora_A" if "lora_A" in parts else "lora_B"
    module = parts[parts.index(ab) - 1]
    return layer, module, ab


def read_adapter(name: str, path: str | Path, base) -> Adapter:
    """An adapter folder's factors, checked against the base model (its layers and projection shapes)."""
    p = Path(path)
    cfg_file, weights = p / "adapter_config.json", p / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise AdapterError(f"adapter {name!r}: {p} is not a PEFT adapter folder (adapter_config.json and "
                           f"adapter_model.safetensors)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r}; a group holds LoRA adapters")
    if cfg.get("use_dora"):
        raise AdapterError(f"adapter {name!r}: DoRA adapters are not held unmerged; serve it merged")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {name!r}: fan_in_fan_out adapters (GPT-2 style) do not fit a Llama base")
    tensors = load_file(str(weights))
    layers = base.model.layers
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        where = _module_of(key)
        if where is None:
            raise AdapterError(f"adapter {name!r}: {key} is not a LoRA factor of a layer's projection "
                               f"(a group adapts {', '.join(MODULE_KIND)})")
        layer, module, ab = where
        if module not in MODULE_KIND:
            raise AdapterError(f"adapter {name!r}: it adapts {module!r}; a group adapts {', '.join(MODULE_KIND)}")
        if layer >= len(layers):
            raise AdapterError(f"adapter {name!r}: it adapts layer {layer}, and the base has {len(layers)}")
        found.setdefault((layer, module), {})[ab] = t
    alpha_pattern, rank_pattern = cfg.get("alpha_pattern") or {}, cfg.get("rank_pattern") or {}
    invocation = tuple(cfg["alora_invocation_tokens"]) if cfg.get("alora_invocation_tokens") else None
    out = Adapter(name, str(p), 0, invocation=invocation)
    dtype = base.model.embed_tokens.weight.dtype
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} lacks {({'lora_A', 'lora_B'} - set(ab)).pop()}")
        a, b = ab["lora_A"], ab["lora_B"]
        sub = getattr(layers[layer].self_attn if module in KINDS["qkv"] + KINDS["o"] else layers[layer].mlp, module)
        out_f, in_f = sub.weight.shape
        r = a.shape[0]
        if a.shape != (r, in_f) or b.shape != (out_f, r):
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} has factors {tuple(a.shape)} and "
                               f"{tuple(b.shape)}, and the base's {module} is {out_f} x {in_f}")
        alpha = next((v for k, v in alpha_pattern.items() if module in k), cfg.get("lora_alpha", r))
        r_cfg = next((v for k, v in rank_pattern.items() if module in k), cfg.get("r", r))
        scale = alpha / math.sqrt(r_cfg) if cfg.get("use_rslora") else alpha / r_cfg
        out.factors[(layer, module)] = (a.to(dtype), (b * scale).to(dtype))
        out.rank = max(out.rank, r)
    if not out.factors:
        raise AdapterError(f"adapter {name!r}: no LoRA factors in {weights}")
    return out


class LoraLinear(torch.nn.Module):
    """A base projection with one adapter's low-rank term added, unmerged: y = x W^T + (x A^T) B^T (B scaled).
    `weight` is the merged matrix, made when read: an artifact's Patch layers compose it once (at prepare)."""

    def __init__(self, base: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.base, self.a, self.b = base, a, b
        self.in_features, self.out_features, self.bias = base.in_features, base.out_features, base.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight + self.b @ self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


def adapter_view(base, adapter: Adapter):
    """The base model with one adapter on, as a model of its own: its modules are new, their weights the
    base's (shared, not copied), and each projection the adapter adapts adds its low-rank term (LoraLinear).
    It runs what is written for a model (an artifact's rebuild, recompute blocks and tails) for one adapter of
    a group, for the memory of its factors."""
    shared = {id(t): t for t in [*base.parameters(), *base.buffers()]}
    view = copy.deepcopy(base, memo=shared)
    for (layer, module), (a, b) in adapter.factors.items():
        owner = view.model.layers[layer]
        owner = owner.self_attn if module in KINDS["qkv"] + KINDS["o"] else owner.mlp
        setattr(owner, module, LoraLinear(getattr(owner, module), a, b))
    return view.eval()


@dataclass(frozen=True)
class _Tables:
    """What a LoraGroup holds now, swapped as one value when adapters are added or removed."""
    names: list                       # by index: "" the base, an adapter's name, None a removed adapter's index
    first: dict                       # name -> the first layer it changes
    invocation: list                  # by index: an activated LoRA's invocation tokens, else None
    stacks: list                      # per layer: kind -> (A stack, B stack) of the adapters adapting it
    slots: list                       # per layer: kind -> each index's row in the stacks (-1: none)


class LoraGroup:
    """A base model and its adapters, stacked per layer and projection kind for gathered batched matmuls (an
    adapter has rows only where it adapts). `index(name)` is an adapter's index (0: the base); `step`, `extend`
    and `prefill` run FastStep's layers with each row's low-rank terms added."""

    def __init__(self, base, adapters: list[Adapter]):
        self.fast = fast_decode.step_for(base)
        if self.fast is None:
            raise AdapterError(f"{type(base).__name__} is not a model a group serves (fast_decode.supported)")
        names = [a.name for a in adapters]
        if len(set(names)) != len(names):
            raise AdapterError(f"adapter names repeat: {names}")
        self.base = base
        self.base_layers = base.model.layers
        self.layers = len(base.model.layers)
        self.held: list[Adapter | None] = list(adapters)   # by index - 1; None: removed (its index is not reused)
        self._version = 0
        self._gathered: tuple[tuple, list[dict]] | None = None
        self._build()

    def _build(self) -> None:
        """The names, first adapted layers, invocations and stacked factors of the adapters held now, swapped
        in as one value (`_tables`): a step, extend or prefill running meanwhile reads either the old ones or
        the new (each reads them once), and the indices of adapters held in both are the same."""
        held = [a for a in self.held if a is not None]
        names = ["", *(a.name if a is not None else None for a in self.held)]
        # the first layer each adapter changes: below it an adapter's cache is the base's (the base: none)
        first = {"": self.layers, **{a.name: min(layer for layer, _ in a.factors) for a in held}}
        invocation = [None, *(a.invocation if a is not None else None for a in self.held)]   # by index
        r = max([a.rank for a in held], default=0)
        w = self.base_layers[0].mlp.down_proj.weight
        # per layer and kind: the factors of the adapters that adapt it (no rows for the others), and each
        # adapter index's row there (-1: none)
        stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        all_slots: list[dict[str, list[int]]] = []
        for li, layer in enumerate(self.base_layers):
            per_kind, slots = {}, {}
            for kind, modules in KINDS.items():
                subs = [getattr(layer.self_attn if kind in ("qkv", "o") else layer.mlp, m) for m in modules]
                in_f, outs = subs[0].weight.shape[1], [s.weight.shape[0] for s in subs]
                here = [ad for ad in held if any((li, m) in ad.factors for m in modules)]
                if not here:
                    continue
                a_stack = w.new_zeros(len(here), len(modules) * r, in_f)
                b_stack = w.new_zeros(len(here), sum(outs), len(modules) * r)
                for si, ad in enumerate(here):
                    row = 0
                    for mi, (m, n_out) in enumerate(zip(modules, outs)):
                        if (li, m) in ad.factors:
                            fa, fb = ad.factors[(li, m)]
                            a_stack[si, mi * r:mi * r + fa.shape[0]] = fa
                            b_stack[si, row:row + n_out, mi * r:mi * r + fb.shape[1]] = fb
                        row += n_out
                per_kind[kind] = (a_stack, b_stack)
                slots[kind] = [here.index(a) if a in here else -1 for a in [None, *self.held]]
            stacks.append(per_kind)
            all_slots.append(slots)
        self._tables = _Tables(names, first, invocation, stacks, all_slots)
        self._version += 1

    @property
    def names(self) -> list[str | None]:
        """Adapter names by index: "" the base, None a removed adapter's index."""
        return self._tables.names

    @property
    def first(self) -> dict[str, int]:
        return self._tables.first

    @property
    def invocation(self) -> list[tuple[int, ...] | None]:
        return self._tables.invocation

    def add(self, adapter: Adapter) -> int:
        """Hold one more adapter (read by `read_adapter` against this group's base); returns its index. The
        indices of the adapters held before stay theirs."""
        if adapter.name in self.names:
            raise AdapterError(f"an adapter named {adapter.name!r} is already in the group")
        self.held.append(adapter)
        self._build()
        return len(self.held)

    def remove(self, name: str) -> None:
        """Drop an adapter (no row of it may be running); the others keep their indices."""
        self.held[self.index(name) - 1] = None
        self._build()

    def index(self, name: str) -> int:
        return self._tables.names.index(name)

    def adapter(self, name: str) -> Adapter:
        return self.held[self.index(name) - 1]

    def stack_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for per in self._tables.stacks for pair in per.values() for t in pair)

    def gather(self, adapter_idx: torch.Tensor) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """`factors` of a decode batch's rows, kept for its next steps until a row joins or leaves (or the
        adapters held change)."""
        key = (self._version, tuple(adapter_idx.tolist()))
        if self._gathered is None or self._gathered[0] != key:
            self._gathered = (key, self.factors(key[1]))
        return self._gathered[1]

    def factors(self, rows: tuple[int, ...]) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Each row's factors (by adapter index) per layer and kind, transposed for bmm: A^T (B, in, k*r), B^T
        (B, k*r, out) (fast_decode.lora_delta), zero for a row whose adapter does not adapt that kind; a kind
        no row's adapter adapts is left out (no matmul)."""
        out = []
        tables = self._tables
        stacks, all_slots = tables.stacks, tables.slots
        for per_kind, slots in zip(stacks, all_slots):
            layer = {}
            for kind, (a, b) in per_kind.items():
                at = [slots[kind][i] for i in rows]
                if all(r < 0 for r in at):
                    continue
                sel = torch.tensor([max(r, 0) for r in at], device=a.device)
                a_t, b_t = a.index_select(0, sel).transpose(1, 2), b.index_select(0, sel).transpose(1, 2)
                if any(r < 0 for r in at):
                    keep = torch.tensor([r >= 0 for r in at], device=a.device, dtype=a.dtype)[:, None, None]
                    b_t = b_t * keep
                layer[kind] = (a_t, b_t)
            out.append(layer)
        return out

    @torch.no_grad()
    def step(self, keys, values, mask, pos, tokens, adapter_idx):
        """One decode step of a mixed batch (as FastStep.__call__, plus each row's adapter index (B,))."""
        return self.fast._run(keys, values, tokens[:, None], pos[:, None], mask.bool()[:, None, None],
                              lora=self.gather(adapter_idx))

    def extend(self, keys, values, tokens, adapter: int):
        """One row's suffix (1, S) on its cache with adapter `adapter` (as FastStep.extend; no cache: the
        adapter's own prefill of the tokens). An activated LoRA runs the tokens before its invocation's last
        occurrence on the base's weights (all of them when the suffix does not invoke it). Its factors are
        gathered for it alone: a decode batch's stay kept."""
        inv = self.invocation[adapter]
        if inv is not None:
            at = activated.invocation_start(tokens, inv)
            if at > 0:
                logits, keys, values = self.fast.extend(keys, values, tokens[:, :at])
                if at == tokens.shape[1]:
                    return logits, keys, values
                tokens = tokens[:, at:]
        return self.fast.extend(keys, values, tokens, lora=self.factors((adapter,)))

    @torch.no_grad()
    def prefill(self, prefix: torch.Tensor, names: list[str]) -> dict[str, tuple]:
        """A prefix (1, T) for the base and the named adapters, the base's layers computed once: {name: (last
        logits (1, V), keys, values per layer)}, "" the base's (`base_prefill`, then `adapter_prefix` each).
        Exact: each equals the adapter merged into the base (up to float rounding)."""
        base = self.base_prefill(prefix, names)
        return {"": base[:3], **{n: self.adapter_prefix(base, prefix, n) for n in names}}

    @torch.no_grad()
    def base_prefill(self, prefix: torch.Tensor, names: list[str] | None = None) -> tuple:
        """The base's prefill of a prefix (1, T): (last logits (1, V), keys, values per layer, taps), taps the
        base's residual entering the first layer of each named adapter (None: every adapter) that leaves the
        layers below it to the base, which `adapter_prefix` starts from."""
        tables = self._tables
        names = [n for n in tables.names[1:] if n is not None] if names is None else names
        taps = {tables.first[n]: None for n in names if n in tables.first and 0 < tables.first[n] < self.layers}
        return (*self.fast.extend([], [], prefix, taps=taps), taps)

    def base_from_trace(self, trace) -> tuple:
        """`base_prefill`'s tuple from the base's trace of a prefix (scd.online.trace.capture, with its residual
        streams), for every adapter: its keys and values, and the taps its hidden states hold. No logits: a
        row's suffix runs on top of the cache."""
        tables = self._tables
        taps = {tables.first[n]: trace.hidden[tables.first[n]] for n in tables.names[1:]
                if n is not None and 0 < tables.first[n] < self.layers}
        return None, trace.keys, trace.values, taps

    @torch.no_grad()
    def adapter_prefix(self, base: tuple, prefix: torch.Tensor, name: str) -> tuple:
        """An adapter's (last logits, keys, values) of the prefix from the base's (`base_prefill`, with its
        taps): an activated LoRA's is the base's cache up to its invocation (all of it when the prefix does not
        invoke it); an adapter that leaves the layers below s to the base runs its layers from s with its
        factors on, from the base's residual entering s, and its cache below s is the base's own tensors
        (referenced, not copied); one that changes layer 0 prefills the prefix itself."""
        logits, base_keys, base_values, taps = base
        tables = self._tables
        s, i = tables.first[name], tables.names.index(name)
        if tables.invocation[i] is not None:
            at = activated.invocation_start(prefix, tables.invocation[i])
            if at == prefix.shape[1]:
                return logits, base_keys, base_values
            return self.extend([k[:, :, :at] for k in base_keys], [v[:, :, :at] for v in base_values],
                               prefix[:, at:], i)
        if s == 0:
            return self.extend([], [], prefix, i)
        if s >= self.layers:                                    # the base itself
            return logits, base_keys, base_values
        if s not in taps:                   # a base prefill from before this adapter was added: no residual at s
            return self.extend([], [], prefix, i)
        empty = self.fast.empty()
        logits, keys, values = self.fast.extend(empty[s:], empty[s:], prefix, lora=self.factors((i,))[s:],
                                                first=s, x=taps[s])
        return logits, base_keys[:s] + keys, base_values[:s] + values

    def prefill_share(self, names: list[str]) -> dict[str, float]:
        """Each named adapter's layers computed by `prefill`, as a share of a whole prefill (layers count
        alike): 0 for the base's, whose prefill the group does once for all, and for an activated LoRA's (a
        prefix that does not invoke it)."""
        tables = self._tables
        return {n: 0.0 if tables.invocation[tables.names.index(n)] is not None
                else (self.layers - min(tables.first[n], self.layers)) / self.layers for n in names}
