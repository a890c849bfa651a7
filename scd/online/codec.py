"""Wire format for one request's codes: versioned, self-describing, checked on decode.

Layout (little-endian):
  magic   b"SCDC"              4 bytes
  version u16                  2 bytes
  hlen    u32                  4 bytes
  header  JSON, hlen bytes     {"pair", "artifact", "dtype", "batch", "tokens", "plan", "dims"[, "x_codes"]}
          (dims: the ranks of the code tensors; Reuse ranks may be any of the artifact's levels; x_codes:
          the layers carrying a hidden-state code, when codes are shared by groups of layers; absent, every
          hidden layer carries its own)
  body    token_ids (int32, B*T) | mask (uint8, B*T) | per coded layer, in plan order, each code tensor
          (a layer's z_x after its other codes); with "compress": "zstd" in the header, one zstd frame of
          those bytes (its content size set: the decoder refuses a frame that does not say it holds exactly
          the body the header implies)
  crc32   u32 of everything before it (the bytes on the wire)
Code tensors are fp16 or bf16, or int8 / int4 with a per-row fp16 scale (row = last dim), stored scales first;
int4 values are offset by 8 and packed two to a byte, low nibble first, a row padded to an even width. A
"mixed" code is two such tensors one after the other: its first r // 3 columns in int8, then the rest in int4
(codes are ordered widest column first, so the columns that matter most get the finer steps). An exact
plan's fields may travel in a scheme of their own: kivi4 (keys per channel, values per group, both
asymmetric int4 with fp16 scales and minima) or klt (integer symbols of scd.online.klt's transform code as
"sym16": 16-bit zigzag, the field's low bytes then its high bytes, no scales).
The decoder checks magic, version, lengths, crc, and that pair/artifact/plan match what it expects and dims
are among the ones it accepts (one per level of the artifact).

Device payloads (`Wire`, from `encode_wire`): on a GPU the codes never leave device memory. The body is the same
bytes as above (uncompressed), as one flat uint8 tensor on the encoding device, and travels as a tensor (Ray
Direct Transport); the header travels beside it as bytes: magic, version, header JSON (with "body_bytes" and
"check", the body's checksum), crc32 of those. The checksum is crc32 for a body in host memory, and on a device
"sum64": per 16 MiB chunk the sum of its bytes and their sum weighted by position (computed where the body is;
only 16 bytes per chunk reach the host). `decode` reads both kinds and checks the same things.

Quantised codes (int8, int4, mixed) are compressed with zstd by default: lossless, so the consumer rebuilds
from exactly the same codes, and their values are far from uniform over their range (a row's scale is set by
its largest value), so the bytes shrink.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass

import torch
import zstandard

from scd.online.rebuild import Codes, MixedCode, QuantCode, entry_groups
from scd.online.schemes import field_dtype, field_view, kivi_bytes, kivi_from, kivi_tensors, sym16_from, zigzag_planes
from scd.settings import EXACT_DTYPES as DTYPES

MAGIC = b"SCDC"
VERSION = 1
COMPRESS = ("none", "zstd")
ZSTD_LEVEL = 3          # on quantised codes lower levels are no faster; higher ones shrink no further, far slower
_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16}
# code tensor names per layer kind, and which dims of the artifact give their last axis
FIELDS = {"reuse": (("z_k", "r_k"), ("z_v", "r_v")), "hidden": (("z_x", "r_x"),), "patch": (("z_h", "r_h"),),
          "exact": (), "shared": (("k", "d_kv"), ("v", "d_kv")), "entry": (("z_e", "d_e"),), "recompute": (),
          "shared_entry": (("k", "d_kv"), ("v", "d_kv"), ("z_e", "d_e"))}
PER_TOKEN = ("z_h", "z_x")          # one code per token (B, T, r); the others one per KV head (B, n_kv, T, r)
# a residual stream entering a layer (B, T, H) travels as (B, T, e_groups, d_e): rows of d_e values, each
# with its own scale when quantised (one scale per 576-wide row lets the stream's few large channels set
# every step)


class PayloadError(ValueError):
    """A payload that cannot be decoded for this pair: truncated, corrupted, or for something else."""


def _shape(kind_field: str, b: int, t: int, dims: dict[str, int], r: int) -> tuple[int, ...]:
    if kind_field == "z_e":
        return (b, t, dims["e_groups"], r)
    return (b, t, r) if kind_field in PER_TOKEN else (b, dims["n_kv"], t, r)


_QMAX = {"int8": 127, "int4": 7}


def parts(r: int, dtype: str) -> list[tuple[str, int]]:
    """How a code row of width r goes on the wire: (precision, columns) of each part, in order."""
    if dtype != "mixed":
        return [(dtype, r)]
    return [(d, w) for d, w in (("int8", r // 3), ("int4", r - r // 3)) if w]


def _quantise(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) symmetric int8 or int4: (fp16 scales (rows,), values). int8 values (rows, r) as
    int8; int4 ones offset by 8 and packed two to a byte, (rows, ceil(r / 2)) uint8."""
    rows = x.reshape(-1, x.shape[-1])
    qmax = _QMAX[dtype]
    scale = (rows.abs().amax(-1) / qmax).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))   # a zero row (or one below fp16's range)
    q = torch.round(rows / scale.float()[:, None]).clamp(-qmax, qmax)
    if dtype == "int8":
        return scale, q.to(torch.int8)
    q = (q + 8).to(torch.uint8)
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1), value=8)
    return scale, q[:, 0::2] | (q[:, 1::2] << 4)


def _columns(x: torch.Tensor, dtype: str) -> list[tuple[str, torch.Tensor]]:
    """x split along its last dim into its wire parts (see `parts`)."""
    out, col = [], 0
    for d, w in parts(x.shape[-1], dtype):
        out.append((d, x[..., col:col + w]))
        col += w
    return out


def _field_u8(x: torch.Tensor, dtype: str) -> list[torch.Tensor]:
    """One code tensor's wire bytes as flat uint8 tensors where x is: its wire_tensors one after the other (each
    part's scales, then values)."""
    if dtype == "sym16":
        return zigzag_planes(x)
    tensors = kivi_tensors(x.detach().float(), dtype) if dtype in ("kivi_k", "asym4") else wire_tensors(x, dtype)
    return [_u8(t) for t in tensors]


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, as a flat uint8 view (a copy only when it is not contiguous)."""
    return t.contiguous().view(torch.uint8).reshape(-1)


def wire_tensors(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, ...]:
    """One code tensor in its wire precision, compact: (fp16 scales, values) for int8/int4, else the tensor in
    fp16/bf16. `from_wire_tensors` gives back what the consumer decodes."""
    x = x.detach().float()
    if dtype == "mixed":
        return tuple(t for d, part in _columns(x, dtype) for t in _quantise(part, d))
    return _quantise(x, dtype) if dtype in _QMAX else (x.to(_TORCH[dtype]),)


def from_wire_tensors(tensors: tuple[torch.Tensor, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 code of shape `shape` that `wire_tensors` parts stand for."""
    if len(tensors) == 1:
        return tensors[0].float().reshape(shape)
    if len(tensors) == 2:
        return QuantCode(*tensors, shape).dense()
    widths = [w for _, w in parts(shape[-1], "mixed")]
    return MixedCode([QuantCode(tensors[2 * i], tensors[2 * i + 1], (*shape[:-1], w)) for i, w in enumerate(widths)],
                     shape).dense()


def wire_round(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """One code tensor as the consumer decodes it after the wire at `dtype` (rounded to fp16/bf16, or int8
    per row with an fp16 scale), in float32. Not differentiable: training uses x + (wire_round(x) - x).detach()."""
    return from_wire_tensors(wire_tensors(x, dtype), tuple(x.shape))


def as_received(codes: Codes, dtype: str) -> Codes:
    """The codes after a trip over the wire at `dtype`, without serialising: what calibration scores and
    fine-tunes on."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out = Codes(codes.token_ids, codes.mask, list(codes.plan), level=codes.level)
    out.layers = {l: {name: wire_round(x, dtype) for name, x in fields.items()} for l, fields in codes.layers.items()}
    return out


def code_bytes_per_row(r: int, dtype: str) -> int:
    """Wire bytes of one code row of width r (an int8 or int4 row, or each part of a mixed one, carries its fp16
    scale)."""
    if dtype == "mixed":
        return sum(code_bytes_per_row(w, d) for d, w in parts(r, dtype))
    return r + 2 if dtype == "int8" else (r + 1) // 2 + 2 if dtype == "int4" else 2 * r


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    if dtype in ("kivi_k", "asym4"):
        return kivi_bytes(shape, dtype)
    if dtype == "sym16":
        return 2 * math.prod(shape)
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows * code_bytes_per_row(shape[-1], dtype)


def _from_bytes(body: torch.Tensor, off: int, shape: tuple[int, ...], dtype: str) -> "torch.Tensor | QuantCode | MixedCode":
    """A code tensor in its wire dtype (fp16/bf16), or a QuantCode (MixedCode) that rebuild() dequantises where
    it uses it."""
    if dtype in ("kivi_k", "asym4"):
        return kivi_from(body, off, shape, dtype)
    if dtype == "sym16":
        return sym16_from(body, off, shape)
    if dtype == "mixed":
        codes = []
        for d, w in parts(shape[-1], dtype):
            codes.append(_from_bytes(body, off, (*shape[:-1], w), d))
            off += _nbytes((*shape[:-1], w), d)
        return MixedCode(codes, shape)
    n = 1
    for s in shape:
        n *= s
    if dtype in _QMAX:
        rows = n // shape[-1]
        scale = field_view(body, off, 2 * rows, torch.float16)
        if dtype == "int8":
            return QuantCode(scale, field_view(body, off + 2 * rows, n, torch.int8).view(rows, -1), shape)
        width = (shape[-1] + 1) // 2
        return QuantCode(scale, field_view(body, off + 2 * rows, rows * width, torch.uint8).view(rows, width), shape)
    return field_view(body, off, 2 * n, _TORCH[dtype]).reshape(shape)


def _hidden_layers(plan: list[str]) -> list[int]:
    return [l for l, kind in enumerate(plan) if kind == "hidden"]


def _layout(plan: list[str], dims: dict[str, int], b: int, t: int,
            x_codes: list[int] | None = None) -> list[tuple[int, str, tuple[int, ...]]]:
    """(layer, field, shape) of every code tensor of a payload, in wire order. x_codes: the layers carrying
    a hidden-state code (default: every hidden layer)."""
    carriers = set(_hidden_layers(plan) if x_codes is None else x_codes)
    return [(l, name, _shape(name, b, t, dims, dims[dim])) for l, kind in enumerate(plan)
            for name, dim in FIELDS[kind] + (FIELDS["hidden"] if l in carriers and kind != "hidden" else ())
            if name != "z_x" or l in carriers]


def _body_bytes(layout, b: int, t: int, dtype: str) -> int:
    """Bytes between header and checksum: token ids, mask and the code tensors of `layout`."""
    return 5 * b * t + sum(_nbytes(shape, field_dtype(name, dtype)) for _, name, shape in layout)


def default_compress(dtype: str) -> str:
    """zstd for quantised codes (their bytes shrink by about a seventh), none for fp16/bf16 ones."""
    return "zstd" if dtype in _QMAX or dtype in ("mixed", "kivi4", "klt") else "none"


def _start(codes: Codes, pair: str, artifact: str, dims: dict[str, int], dtype: str) -> tuple[dict, list]:
    """(the header, [(code tensor, its field dtype)] in wire order) of a payload of `codes`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    b, t = codes.token_ids.shape
    header = {"pair": pair, "artifact": artifact, "dtype": dtype, "batch": b, "tokens": t, "plan": codes.plan,
              "dims": dims}
    x_codes = sorted(l for l, fields in codes.layers.items() if "z_x" in fields)
    if x_codes != _hidden_layers(codes.plan):              # codes shared by groups of layers
        header["x_codes"] = x_codes
    fields = []
    for l, name, want in _layout(codes.plan, dims, b, t, x_codes):
        x = codes.layers[l][name]
        if tuple(x.shape) != want:
            raise ValueError(f"layer {l} {name} has shape {tuple(x.shape)}, expected {want}")
        fields.append((x, field_dtype(name, dtype)))
    return header, fields


def _body(codes: Codes, fields: list, host: bool = False) -> torch.Tensor:
    """A payload's body (token ids, mask, then each field of `_start`'s list in its wire precision) as one flat
    uint8 tensor where the codes are, or (`host`) quantised and laid out on the host."""
    where = (lambda t: t.cpu()) if host else (lambda t: t)                  # noqa: E731
    parts = [_u8(where(codes.token_ids).to(torch.int32)), _u8(where(codes.mask).to(torch.uint8))]
    parts += [t for x, fd in fields for t in _field_u8(where(x), fd)]
    return torch.cat(parts)


def _head(header: dict) -> bytes:
    """magic, version, header length and header JSON: what a payload's bytes start with."""
    hb = json.dumps(header, sort_keys=True).encode()
    return b"".join([MAGIC, struct.pack("<HI", VERSION, len(hb)), hb])


def encode(codes: Codes, pair: str, artifact: str, dims: dict[str, int], dtype: str = "fp16",
           compress: str | None = None) -> bytes:
    """Serialise codes. dims = {"n_kv", "r_k", "r_v", "r_h"} of the artifact that produced them; compress: the
    lossless stage over the body, one of COMPRESS (default: `default_compress(dtype)`), used when it makes the
    body smaller (the header says so)."""
    compress = default_compress(dtype) if compress is None else compress
    if compress not in COMPRESS:
        raise ValueError(f"compress must be one of {COMPRESS}, got {compress!r}")
    header, fields = _start(codes, pair, artifact, dims, dtype)
    body = _body(codes, fields, host=True).numpy().tobytes()
    head = _head(header)
    if compress == "zstd":
        packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(body)
        hz = _head({**header, "compress": compress})
        if len(hz) + len(packed) < len(head) + len(body):     # (a few tokens' codes may not shrink: sent as they are)
            head, body = hz, packed
    blob = head + body
    return blob + struct.pack("<I", zlib.crc32(blob))


@dataclass(frozen=True)
class Wire:
    """A payload whose body stays where it was encoded (a device's memory): `head` is the bytes of a payload's
    header with its own crc32 (magic, version, header JSON carrying "body_bytes" and "check"), `body` the flat
    uint8 tensor of the body's bytes (uncompressed). Moves between processes as a tensor (Ray Direct Transport)."""
    head: bytes
    body: torch.Tensor

    def __len__(self) -> int:
        return len(self.head) + self.body.numel()


CHUNK = 1 << 24            # sum64's chunk: int64 copies of one chunk are what the checksum holds at a time
_WEIGHTS: dict[str, torch.Tensor] = {}


def checksum(body: torch.Tensor, kind: str) -> int:
    """A flat uint8 body's checksum, computed where it is: "crc32" (host bytes; a device body is copied to the
    host first) or "sum64" (per CHUNK bytes the sum and the position-weighted sum, gathered in one small copy)."""
    if kind == "crc32":
        return zlib.crc32(body.cpu().numpy())
    if kind != "sum64":
        raise PayloadError(f"unknown checksum {kind!r}")
    key = str(body.device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.arange(1, CHUNK + 1, dtype=torch.int64, device=body.device)
    w = _WEIGHTS[key]
    sums = []
    for o in range(0, body.numel(), CHUNK):
        c = body[o:o + CHUNK].to(torch.int64)
        sums.append(torch.stack([c.sum(), (c * w[:c.numel()]).sum()]))
    return zlib.crc32(torch.stack(sums).cpu().numpy().tobytes()) if sums else 0


def encode_wire(codes: Codes, pair: str, artifact: str, dims: dict[str, int], dtype: str = "fp16") -> Wire:
    """`encode` without leaving the codes' device: quantised there, the body one uint8 tensor there (the bytes of
    an uncompressed payload's body), checksummed there ("sum64" on a device, "crc32" on the host)."""
    header, fields = _start(codes, pair, artifact, dims, dtype)
    body = _body(codes, fields)
    kind = "crc32" if body.device.type == "cpu" else "sum64"
    head = _head({**header, "body_bytes": body.numel(), "check": [kind, checksum(body, kind)]})
    return Wire(head + struct.pack("<I", zlib.crc32(head)), body)


def corrupted(payload: "bytes | Wire") -> "bytes | Wire":
    """A copy of `payload` with one byte of its body flipped (the fault drills' damage): decode refuses it."""
    if isinstance(payload, Wire):
        body = payload.body.clone()
        body[-1] ^= 0xFF
        return Wire(payload.head, body)
    return payload[:-1] + bytes([payload[-1] ^ 0xFF])


def body_bytes(payload: "bytes | Wire") -> int:
    """Bytes of a payload's body as sent (compressed or not): the payload without its header and checksum."""
    if isinstance(payload, Wire):
        return payload.body.numel()
    return len(payload) - 14 - struct.unpack("<I", payload[6:10])[0]


def header(payload: "bytes | Wire", checksum: bool = True) -> dict:
    """The payload's JSON header after checking magic, version, lengths and (unless `checksum` is False: a
    peek at which artifact decodes it, before `decode` checks everything) the checksum; PayloadError if any
    is wrong. (A Wire's checksum here is its header's; `decode` checks its body's.)"""
    return _header(memoryview(payload.head if isinstance(payload, Wire) else payload), checksum)[0]


def _header(mv: memoryview, checksum: bool = True) -> tuple[dict, int]:
    """(the checked header, its length in bytes)."""
    if len(mv) < 14:
        raise PayloadError(f"payload truncated: {len(mv)} bytes is shorter than the fixed header")
    if bytes(mv[:4]) != MAGIC:
        raise PayloadError(f"not an SCD payload (magic {bytes(mv[:4])!r})")
    version, hlen = struct.unpack("<HI", mv[4:10])
    if version != VERSION:
        raise PayloadError(f"payload version {version}, this decoder reads version {VERSION}")
    if 10 + hlen + 4 > len(mv):
        raise PayloadError(f"payload truncated: header says {hlen} bytes, only {len(mv) - 14} left")
    (crc,) = struct.unpack("<I", mv[-4:])
    if checksum and zlib.crc32(mv[:-4]) != crc:
        raise PayloadError("payload checksum mismatch (corrupted or truncated in transit)")
    try:
        h = json.loads(bytes(mv[10:10 + hlen]))
        int(h["batch"]), int(h["tokens"]), h["dtype"]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise PayloadError(f"malformed payload header: {e}") from None
    return h, hlen


def decode(payload: "bytes | Wire", pair: str, artifact: str, plan: list[str],
           dims: "dict[str, int] | list[dict[str, int]]", x_codes: list[int] | None = None) -> Codes:
    """Parse and validate a payload against the consumer's expectation; raise PayloadError on any mismatch.
    `dims`: the dims it must have, or a list of those it may have (an artifact's levels, `level_dims`);
    `x_codes`: the layers carrying a hidden-state code (an artifact's x_codes; None: every hidden layer).
    A Wire's codes are views of its body, on its device."""
    accepted = dims if isinstance(dims, list) else [dims]
    mv = memoryview(payload.head if isinstance(payload, Wire) else payload)
    h, hlen = _header(mv)
    b, t, dtype = int(h["batch"]), int(h["tokens"]), h["dtype"]
    wrong = [f"{k}: payload={h.get(k)!r} expected={v!r}" for k, v in
             (("pair", pair), ("artifact", artifact), ("plan", plan)) if h.get(k) != v]
    if h.get("x_codes") != (None if x_codes is None or x_codes == _hidden_layers(plan) else x_codes):
        wrong.append(f"x_codes: payload={h.get('x_codes')!r} expected={x_codes!r}")
    if h.get("dims") not in accepted:
        wrong.append(f"dims: payload={h.get('dims')!r} expected one of {accepted!r}")
    if dtype not in DTYPES:
        wrong.append(f"dtype: {dtype!r} not in {DTYPES}")
    compress = h.get("compress", "none")
    if compress not in COMPRESS:
        wrong.append(f"compress: {compress!r} not in {COMPRESS}")
    if wrong:
        raise PayloadError("payload does not match this consumer: " + "; ".join(wrong))
    dims = h["dims"]
    layout = _layout(plan, dims, b, t, x_codes)
    size = _body_bytes(layout, b, t, dtype)
    if isinstance(payload, Wire):
        body = _wire_body(payload, h, size)
    else:
        raw = _decompress(mv[10 + hlen:-4], size) if compress == "zstd" else bytearray(mv[10 + hlen:-4])
        if len(raw) != size:
            raise PayloadError(f"payload is {len(mv)} bytes, its header implies {10 + hlen + size + 4}")
        body = torch.frombuffer(raw, dtype=torch.uint8)       # one copy; fields are views
    ids = field_view(body, 0, 4 * b * t, torch.int32).long().reshape(b, t)
    mask = body[4 * b * t:5 * b * t].long().reshape(b, t)
    off = 5 * b * t
    codes = Codes(ids, mask, list(plan), level={dim: dims[dim] for kind in ("reuse", "hidden") if kind in plan
                                                for _, dim in FIELDS[kind]})
    for l, name, shape in layout:
        codes.layers.setdefault(l, {})[name] = _from_bytes(body, off, shape, field_dtype(name, dtype))
        off += _nbytes(shape, field_dtype(name, dtype))
    return codes


def _wire_body(wire: Wire, h: dict, size: int) -> torch.Tensor:
    """A Wire's body after checking its size and checksum against its header."""
    body = wire.body
    if body.dtype != torch.uint8 or body.dim() != 1:
        raise PayloadError(f"a wire body is a flat uint8 tensor, got {body.dtype} of shape {tuple(body.shape)}")
    if h.get("body_bytes") != size or body.numel() != size:
        raise PayloadError(f"wire body is {body.numel()} bytes (header says {h.get('body_bytes')}), "
                           f"its layout implies {size}")
    try:
        kind, value = h["check"]
    except (KeyError, TypeError, ValueError):
        raise PayloadError("wire header carries no body checksum") from None
    if checksum(body, kind) != value:
        raise PayloadError("payload checksum mismatch (corrupted or truncated in transit)")
    return body


def _decompress(frame: memoryview, size: int) -> bytearray:
    """The body in a zstd frame that must say it holds `size` bytes (never more is allocated: a frame claiming
    some other size is refused before it is decompressed)."""
    try:
        claimed = zstandard.frame_content_size(frame)
        if claimed != size:
            raise PayloadError(f"compressed body holds {claimed} bytes, the header implies {size}")
        return bytearray(zstandard.ZstdDecompressor().decompress(frame))
    except zstandard.ZstdError as e:
        raise PayloadError(f"compressed body is not a valid zstd frame: {e}") from None


def artifact_dims(art, level: dict[str, int] | None = None) -> dict[str, int]:
    """The dims a payload of `art` carries at `level` (Reuse ranks; default the full ones); with shared or
    entered layers in its plan, their widths too."""
    dims = {"n_kv": art.spec.num_kv_heads, "r_k": art.r_k, "r_v": art.r_v, "r_h": art.r_h, "r_x": art.r_x}
    if {"shared", "entry", "shared_entry"} & set(art.payload_plan):
        e_groups, d_e = entry_groups(art.spec.hidden_size, art.spec.head_dim)
        dims.update(d_kv=art.spec.head_dim, e_groups=e_groups, d_e=d_e)
    return {**dims, **(level or {})}


def level_dims(art) -> list[dict[str, int]]:
    """The dims of every level `art` serves: what a consumer accepts."""
    return [artifact_dims(art, level) for level in art.levels]


def code_bytes(art, tokens: int, level: dict[str, int] | None = None, batch: int = 1) -> int:
    """Bytes of the codes of `tokens` prefix tokens at `level` (ids, mask and code tensors: a payload without
    its few hundred bytes of header), what a link has to carry."""
    return _body_bytes(_layout(art.payload_plan, artifact_dims(art, level), batch, tokens, art.x_codes), batch, tokens,
                       art.code_dtype)
