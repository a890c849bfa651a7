import json
import struct
import zlib

import pytest
import torch
import zstandard

from scd.online import codec
from scd.online.rebuild import Codes, dense

DIMS = {"n_kv": 2, "r_k": 3, "r_v": 4, "r_h": 5}
PLAN = ["exact", "reuse", "patch", "reuse"]


def _codes(b=2, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = Codes(torch.randint(0, 1000, (b, t), generator=g), torch.ones(b, t, dtype=torch.long), list(PLAN))
    c.mask[1, :3] = 0
    for l in (1, 3):
        c.layers[l] = {"z_k": torch.randn(b, 2, t, 3, generator=g), "z_v": torch.randn(b, 2, t, 4, generator=g)}
    c.layers[2] = {"z_h": torch.randn(b, t, 5, generator=g) * 10}
    return c


@pytest.mark.parametrize("dtype,tol", [("fp16", 1e-2), ("bf16", 8e-2), ("int8", 0.1), ("int4", 0.5), ("mixed", 0.5)])
def test_round_trip_and_exact_size(dtype, tol):
    c = _codes()
    blob = codec.encode(c, "base:qa", "v3", DIMS, dtype, compress="none")      # the layout, byte for byte
    widths = {3: 2 * 2 * 7 * 2, 4: 2 * 2 * 7 * 2, 5: 2 * 7}       # code width -> rows of that width (z_k, z_v, z_h)
    row_bytes = {"fp16": lambda r: 2 * r, "bf16": lambda r: 2 * r, "int8": lambda r: r + 2,
                 "int4": lambda r: (r + 1) // 2 + 2,                  # a quantised row carries its fp16 scale
                 "mixed": lambda r: (r // 3 + 2) + (r - r // 3 + 1) // 2 + 2}[dtype]   # one int8 part, one int4
    body = sum(n * row_bytes(r) for r, n in widths.items()) + 2 * 7 * 5   # + ids (int32) and mask (u8)
    hlen = struct.unpack("<I", blob[6:10])[0]
    assert len(blob) == 10 + hlen + body + 4, f"{len(blob)} bytes, expected {10 + hlen + body + 4}"
    d = codec.decode(blob, "base:qa", "v3", PLAN, DIMS)
    assert torch.equal(d.token_ids, c.token_ids) and torch.equal(d.mask, c.mask)
    for l, fields in c.layers.items():
        for k, x in fields.items():
            rel = ((dense(d.layers[l][k]) - x).abs().max() / x.abs().max()).item()
            assert rel < tol, f"{dtype} layer {l} {k}: relative error {rel:.2e} > {tol}"


def _reject(blob, match, pair="base:qa", art="v3", plan=PLAN, dims=DIMS):
    with pytest.raises(codec.PayloadError, match=match):
        codec.decode(blob, pair, art, plan, dims)


def test_bad_payloads_are_rejected_with_a_reason():
    blob = codec.encode(_codes(), "base:qa", "v3", DIMS)
    _reject(blob[:-9], "checksum|truncated")
    _reject(blob[:8], "truncated")
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0xFF
    _reject(bytes(flipped), "checksum")
    _reject(b"XXXX" + blob[4:], "not an SCD payload")
    _reject(blob, "pair: payload='base:qa' expected='base:code'", pair="base:code")
    _reject(blob, "artifact", art="v4")
    _reject(blob, "dims", dims={**DIMS, "r_k": 4})
    _reject(blob, "plan", plan=["exact", "reuse", "reuse", "reuse"])
    future = bytearray(blob[:-4])
    future[4:6] = struct.pack("<H", 99)
    _reject(bytes(future) + struct.pack("<I", zlib.crc32(bytes(future))), "version 99")
    # a header that lies about the batch size is caught by the length check, crc or not
    _reject(_forge(blob, lambda h: h.update(batch=3)), "header implies")


def _forge(blob: bytes, header_edit=None, body: bytes | None = None) -> bytes:
    """blob with its JSON header edited and/or its body replaced, and a valid checksum (a hostile sender)."""
    hlen = struct.unpack("<I", blob[6:10])[0]
    h = json.loads(blob[10:10 + hlen])
    if header_edit:
        header_edit(h)
    hb = json.dumps(h, sort_keys=True).encode()
    out = blob[:4] + struct.pack("<HI", codec.VERSION, len(hb)) + hb + (blob[10 + hlen:-4] if body is None else body)
    return out + struct.pack("<I", zlib.crc32(out))


@pytest.mark.parametrize("dtype", ["int8", "int4", "mixed"])
def test_quantised_codes_are_compressed_losslessly_and_smaller(dtype):
    """zstd over the body (the default for quantised codes): the consumer decodes exactly the codes of the
    uncompressed payload, and Gaussian codes (rows scaled by their largest value) take fewer bytes."""
    g = torch.Generator().manual_seed(4)
    c = Codes(torch.randint(0, 1000, (2, 256), generator=g), torch.ones(2, 256, dtype=torch.long), ["exact", "hidden"])
    c.layers[1] = {"z_x": torch.randn(2, 256, 192, generator=g)}
    dims = {"n_kv": 1, "r_k": 1, "r_v": 1, "r_h": 1, "r_x": 192}
    plain = codec.encode(c, "a:b", "v", dims, dtype, compress="none")
    packed = codec.encode(c, "a:b", "v", dims, dtype)
    assert codec.header(packed)["compress"] == "zstd" and "compress" not in codec.header(plain)
    # (Gaussian codes: 0.93 / 0.84 / 0.96 of the bytes; real ones, heavier-tailed, shrink more: codec's docstring)
    assert len(packed) < 0.97 * len(plain), f"{dtype}: {len(packed)} bytes compressed against {len(plain)}"
    a, b = (codec.decode(x, "a:b", "v", c.plan, dims) for x in (plain, packed))
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.mask, b.mask)
    assert torch.equal(dense(a.layers[1]["z_x"]), dense(b.layers[1]["z_x"]))
    assert "compress" not in codec.header(codec.encode(c, "a:b", "v", dims, "fp16"))     # float codes: as they are
    tiny = Codes(c.token_ids[:1, :2], c.mask[:1, :2], c.plan)                # too few bytes to shrink: sent plain
    tiny.layers[1] = {"z_x": c.layers[1]["z_x"][:1, :2]}
    assert "compress" not in codec.header(codec.encode(tiny, "a:b", "v", dims, dtype))
    with pytest.raises(ValueError, match="compress must be one of"):
        codec.encode(c, "a:b", "v", dims, dtype, compress="lz4")


def test_hostile_compressed_bodies_are_refused_before_they_are_decompressed():
    c = _codes()
    blob = codec.encode(c, "base:qa", "v3", DIMS, "int8")
    hlen = struct.unpack("<I", blob[6:10])[0]
    frame = blob[10 + hlen:-4]
    size = zstandard.frame_content_size(frame)
    # a frame that says it holds more (a decompression bomb) or less than the header implies
    for claim in (size * 1000, size - 1):
        bomb = zstandard.ZstdCompressor().compress(b"\0" * claim)
        _reject(_forge(blob, body=bomb), f"compressed body holds {claim} bytes, the header implies {size}")
    _reject(_forge(blob, body=b"not zstd at all"), "not a valid zstd frame")
    _reject(_forge(blob, lambda h: h.update(compress="lz4")), "compress: 'lz4'")
    _reject(_forge(blob, lambda h: h.pop("compress")), "header implies")     # a compressed body read as plain


def test_encode_refuses_codes_of_the_wrong_shape():
    c = _codes()
    c.layers[1]["z_k"] = c.layers[1]["z_k"][..., :2]
    with pytest.raises(ValueError, match="layer 1 z_k"):
        codec.encode(c, "base:qa", "v3", DIMS)


def test_int4_codes_are_each_within_half_a_step_of_the_value():
    """int4: odd and even widths, a row of zeros, each value decoded within half its row's step (scale)."""
    g = torch.Generator().manual_seed(1)
    for r in (1, 4, 7):
        x = torch.randn(6, r, generator=g) * torch.tensor([[0.01], [1], [3], [0], [100], [1]])
        scale, q = codec.wire_tensors(x, "int4")
        assert q.dtype == torch.uint8 and q.shape == (6, (r + 1) // 2), q.shape
        back = codec.from_wire_tensors((scale, q), tuple(x.shape))
        step = scale.float()[:, None]
        err = ((back - x).abs() / step).max().item()
        assert err <= 0.5 + 1e-3, f"r={r}: error {err:.3f} steps"
        assert back.abs().max() <= 7 * step.max() + 1e-6


def test_mixed_codes_send_their_first_third_in_int8_and_the_rest_in_int4():
    """code_dtype mixed: columns [0, r // 3) go as int8, the rest as int4, each part with its own row scales;
    the payload's MixedCode dequantises (into a caller's buffer too) to exactly what wire_round gives."""
    from scd.online.rebuild import MixedCode
    g = torch.Generator().manual_seed(2)
    for r in (2, 9, 10):
        x = torch.randn(2, 5, r, generator=g) * torch.linspace(4, 0.2, r)
        head = r // 3
        assert codec.parts(r, "mixed") == [(d, w) for d, w in (("int8", head), ("int4", r - head)) if w]
        assert codec.code_bytes_per_row(r, "mixed") == (head + 2 if head else 0) + (r - head + 1) // 2 + 2
        back = codec.wire_round(x, "mixed")
        want = torch.cat(([codec.wire_round(x[..., :head], "int8")] if head else [])
                         + [codec.wire_round(x[..., head:], "int4")], -1)
        assert torch.equal(back, want), f"r={r}: parts are not quantised independently"
        if head:
            step8 = x[..., :head].abs().amax(-1, keepdim=True) / 127
            err = ((back[..., :head] - x[..., :head]).abs() / step8).max().item()
            assert err <= 0.5 + 1e-2, f"r={r}: int8 head off by {err:.3f} steps"
        c = Codes(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long), ["exact", "hidden"])
        c.layers[1] = {"z_x": x}
        dims = {"n_kv": 1, "r_k": 1, "r_v": 1, "r_h": 1, "r_x": r}
        got = codec.decode(codec.encode(c, "a:b", "v", dims, "mixed"), "a:b", "v", c.plan, dims).layers[1]["z_x"]
        assert isinstance(got, MixedCode) and got.shape == (2, 5, r)
        buf = torch.full((10 * r,), float("nan"))
        assert torch.equal(dense(got, torch.float32, buf), back) and torch.equal(buf.view(2, 5, r), back)
        assert torch.equal(dense(got.to("cpu")), back)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "int8", "int4", "mixed"])
def test_a_wire_body_is_the_uncompressed_payload_body_byte_for_byte(dtype):
    """encode_wire keeps the body a tensor where the codes are; its bytes are the bytes payload's, so one
    decoder reads both, and gives the same codes."""
    c = _codes()
    blob = codec.encode(c, "base:qa", "v3", DIMS, dtype, compress="none")
    wire = codec.encode_wire(c, "base:qa", "v3", DIMS, dtype)
    assert wire.body.dtype == torch.uint8 and wire.body.numel() == codec.body_bytes(blob)
    hlen = struct.unpack("<I", blob[6:10])[0]
    assert wire.body.numpy().tobytes() == blob[10 + hlen:-4], "wire body differs from the bytes payload's body"
    assert codec.header(wire)["check"][0] == "crc32"                 # a host body: crc32, as bytes payloads
    a, b = codec.decode(blob, "base:qa", "v3", PLAN, DIMS), codec.decode(wire, "base:qa", "v3", PLAN, DIMS)
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.mask, b.mask)
    for l, fields in a.layers.items():
        for k, x in fields.items():
            err = (dense(x) - dense(b.layers[l][k])).abs().max().item()
            assert err == 0, f"{dtype} layer {l} {k}: wire decode differs from bytes decode by {err:.2e}"


def test_a_damaged_or_foreign_wire_is_refused():
    wire = codec.encode_wire(_codes(), "base:qa", "v3", DIMS, "int8")
    with pytest.raises(codec.PayloadError, match="checksum"):
        codec.decode(codec.corrupted(wire), "base:qa", "v3", PLAN, DIMS)
    with pytest.raises(codec.PayloadError, match="layout implies"):
        codec.decode(codec.Wire(wire.head, wire.body[:-1]), "base:qa", "v3", PLAN, DIMS)
    with pytest.raises(codec.PayloadError, match="artifact"):
        codec.decode(wire, "base:qa", "v4", PLAN, DIMS)
    head = bytearray(wire.head)
    head[12] ^= 0x01                                                  # inside the header JSON: its crc32 fails
    with pytest.raises(codec.PayloadError, match="checksum"):
        codec.decode(codec.Wire(bytes(head), wire.body), "base:qa", "v3", PLAN, DIMS)


def test_sum64_sees_a_flipped_byte_and_swapped_bytes_in_any_chunk(monkeypatch):
    """The device checksum (here on the host, over small chunks): a changed byte and two swapped bytes change it,
    in the first and in a later chunk."""
    monkeypatch.setattr(codec, "CHUNK", 64)
    monkeypatch.setattr(codec, "_WEIGHTS", {})
    body = torch.randint(0, 256, (300,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ref = codec.checksum(body, "sum64")
    for i in (3, 130, 299):
        flipped = body.clone()
        flipped[i] ^= 0x10
        assert codec.checksum(flipped, "sum64") != ref, f"a flip at byte {i} went unseen"
    for i, j in ((0, 1), (140, 150)):
        if body[i] == body[j]:
            continue
        swapped = body.clone()
        swapped[i], swapped[j] = body[j], body[i]
        assert codec.checksum(swapped, "sum64") != ref, f"swapping bytes {i} and {j} went unseen"
