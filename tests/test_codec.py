import struct
import zlib

import pytest
import torch

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


@pytest.mark.parametrize("dtype,tol", [("fp16", 1e-2), ("bf16", 8e-2), ("int8", 0.1)])
def test_round_trip_and_exact_size(dtype, tol):
    c = _codes()
    blob = codec.encode(c, "base:qa", "v3", DIMS, dtype)
    per = 2 if dtype != "int8" else 1
    n_vals = 2 * (2 * 2 * 7 * 3 + 2 * 2 * 7 * 4) + 2 * 7 * 5
    n_rows = 2 * (2 * 2 * 7 * 2) + 2 * 7
    body = n_vals * per + (2 * n_rows if dtype == "int8" else 0) + 2 * 7 * 5     # + ids (int32) and mask (u8)
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
    hlen = struct.unpack("<I", blob[6:10])[0]
    body = blob[10:10 + hlen].replace(b'"batch": 2', b'"batch": 3')
    forged = blob[:10] + body + blob[10 + hlen:-4]
    _reject(forged + struct.pack("<I", zlib.crc32(forged)), "header implies")


def test_encode_refuses_codes_of_the_wrong_shape():
    c = _codes()
    c.layers[1]["z_k"] = c.layers[1]["z_k"][..., :2]
    with pytest.raises(ValueError, match="layer 1 z_k"):
        codec.encode(c, "base:qa", "v3", DIMS)
