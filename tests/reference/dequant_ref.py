#!/usr/bin/env python3
"""Dequantization of ggml's block formats in NumPy, written from the published block layouts
(ggml's ggml-common.h structs and the reference dequantize_row_* of ggml-quants.c), independently
of combs' C++ (src/backend/quant.cc). float32 throughout, one rounding per operation, in the
reference's order, so the result is bit-exact.

usage: dequant_ref.py TYPE BLOCKS.bin OUT.f32     (TYPE: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K
                                                   Q5_K Q6_K IQ4_NL IQ4_XS MXFP4)
Reads whole blocks, writes their float32 values (little-endian).
"""
import sys

import numpy as np

F = np.float32
IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
FP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def f16(b, off):
    """The f16 at byte `off` of every block, as float32 column."""
    return b[:, off:off + 2].copy().view(np.float16).astype(np.float32)


def nibbles(qs):
    """32 elements from 16 bytes: low nibbles then high nibbles."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int32)


def q4_0(b):
    return (nibbles(b[:, 2:18]) - 8).astype(F) * f16(b, 0)


def q4_1(b):
    return nibbles(b[:, 4:20]).astype(F) * f16(b, 0) + f16(b, 2)


def fifth_bits(qh4):
    bits = np.unpackbits(qh4, axis=1, bitorder="little").astype(np.int32)  # bit j of the uint32, j < 32
    return bits << 4


def q5_0(b):
    return ((nibbles(b[:, 6:22]) | fifth_bits(b[:, 2:6])) - 16).astype(F) * f16(b, 0)


def q5_1(b):
    return (nibbles(b[:, 8:24]) | fifth_bits(b[:, 4:8])).astype(F) * f16(b, 0) + f16(b, 2)


def q8_0(b):
    return b[:, 2:34].view(np.int8).astype(F) * f16(b, 0)


def two_bit_planes(q32):
    """[n, 32] bytes -> [n, 128]: the 2-bit fields at bits 0, 2, 4, 6, each 32 elements."""
    return np.concatenate([(q32 >> s) & 3 for s in (0, 2, 4, 6)], axis=1).astype(np.int32)


def q2_k(b):
    sc = b[:, 0:16]
    q = np.concatenate([two_bit_planes(b[:, 16:48]), two_bit_planes(b[:, 48:80])], axis=1)  # [n, 256]
    d, dmin = f16(b, 80), f16(b, 82)
    dl = np.repeat(d * (sc & 0xF).astype(F), 16, axis=1)
    ml = np.repeat(dmin * (sc >> 4).astype(F), 16, axis=1)
    return dl * q.astype(F) - ml


def q3_k(b):
    hm, p = b[:, 0:32], b[:, 96:108].astype(np.int32)
    low = np.concatenate([p[:, 0:8] & 0xF, p[:, 0:8] >> 4], axis=1)  # scales 0..15, low 4 bits
    top = np.stack([(p[:, 8 + s % 4] >> (2 * (s // 4))) & 3 for s in range(16)], axis=1)
    scales = (low | top << 4) - 32
    q = np.concatenate([two_bit_planes(b[:, 32:64]), two_bit_planes(b[:, 64:96])], axis=1)
    # element 32 s + l of half h has high bit (4 h + s) of hmask byte l; clear -> minus 4
    hbit = np.concatenate([(hm >> k) & 1 for k in range(8)], axis=1).astype(np.int32)
    v = q - np.where(hbit == 1, 0, 4)
    dl = np.repeat(f16(b, 108) * scales.astype(F), 16, axis=1)
    return dl * v.astype(F)


def k4_scales(s12):
    """Q4_K / Q5_K: eight (scale, min) pairs of 6 bits from 12 bytes."""
    s = s12.astype(np.int32)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | (s[:, 0:4] >> 6) << 4], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | (s[:, 4:8] >> 6) << 4], axis=1)
    return sc, mn


def q4_k(b):
    d, dmin = f16(b, 0), f16(b, 2)
    sc, mn = k4_scales(b[:, 4:16])
    qs = b[:, 16:144].reshape(-1, 4, 32)
    q = np.concatenate([np.concatenate([qs[:, g] & 0xF, qs[:, g] >> 4], axis=1) for g in range(4)], axis=1)
    dl = np.repeat(d * sc.astype(F), 32, axis=1)
    ml = np.repeat(dmin * mn.astype(F), 32, axis=1)
    return dl * q.astype(F) - ml


def q5_k(b):
    d, dmin = f16(b, 0), f16(b, 2)
    sc, mn = k4_scales(b[:, 4:16])
    qh = b[:, 16:48].astype(np.int32)
    qs = b[:, 48:176].reshape(-1, 4, 32).astype(np.int32)
    parts = []
    for g in range(4):
        parts.append((qs[:, g] & 0xF) + ((qh >> (2 * g)) & 1) * 16)
        parts.append((qs[:, g] >> 4) + ((qh >> (2 * g + 1)) & 1) * 16)
    q = np.concatenate(parts, axis=1)
    dl = np.repeat(d * sc.astype(F), 32, axis=1)
    ml = np.repeat(dmin * mn.astype(F), 32, axis=1)
    return dl * q.astype(F) - ml


def q6_k(b):
    d = f16(b, 208)
    sc = b[:, 192:208].view(np.int8).astype(F)
    out = []
    for h in range(2):
        ql = b[:, 64 * h:64 * h + 64].astype(np.int32)
        qh = b[:, 128 + 32 * h:128 + 32 * h + 32].astype(np.int32)
        lows = [ql[:, 0:32] & 0xF, ql[:, 32:64] & 0xF, ql[:, 0:32] >> 4, ql[:, 32:64] >> 4]
        for s in range(4):
            q = (lows[s] | ((qh >> (2 * s)) & 3) << 4) - 32
            scale = np.repeat(sc[:, 8 * h + 2 * s:8 * h + 2 * s + 2], 16, axis=1)  # sc[l / 16 + 2 s]
            out.append(d * scale * q.astype(F))
    return np.concatenate(out, axis=1)


def iq4_nl(b):
    return f16(b, 0) * IQ4[nibbles(b[:, 2:18])]


def iq4_xs(b):
    d = f16(b, 0)
    sh = b[:, 2:4].copy().view(np.uint16).astype(np.int32)
    sl = b[:, 4:8].astype(np.int32)
    ls = np.stack([((sl[:, k // 2] >> (4 * (k % 2))) & 0xF) | ((sh[:, 0] >> (2 * k)) & 3) << 4 for k in range(8)],
                  axis=1)
    dl = d * (ls - 32).astype(F)
    qs = b[:, 8:136].reshape(-1, 8, 16)
    levels = np.concatenate([IQ4[nibbles(qs[:, k])] for k in range(8)], axis=1)
    return np.repeat(dl, 32, axis=1) * levels


def mxfp4(b):
    e = b[:, 0].astype(np.int64)
    # half of 2^(e - 127): 2^(e - 128), exact in float32 (subnormal for e < 2)
    d = np.ldexp(np.float64(1.0), e - 128).astype(F)[:, None]
    return FP4[nibbles(b[:, 1:17])] * d


FORMATS = {"Q4_0": (32, 18, q4_0), "Q4_1": (32, 20, q4_1), "Q5_0": (32, 22, q5_0), "Q5_1": (32, 24, q5_1),
           "Q8_0": (32, 34, q8_0), "Q2_K": (256, 84, q2_k), "Q3_K": (256, 110, q3_k), "Q4_K": (256, 144, q4_k),
           "Q5_K": (256, 176, q5_k), "Q6_K": (256, 210, q6_k), "IQ4_NL": (32, 18, iq4_nl),
           "IQ4_XS": (256, 136, iq4_xs), "MXFP4": (32, 17, mxfp4)}


def dequantize(name, raw):
    elems, size, fn = FORMATS[name]
    if len(raw) % size:
        raise ValueError(f"{name}: {len(raw)} bytes are not whole {size}-byte blocks")
    b = np.frombuffer(raw, np.uint8).reshape(-1, size)
    with np.errstate(all="ignore"):  # inf/NaN scales propagate as in C
        y = fn(b).astype(np.float32)
    assert y.shape == (b.shape[0], elems)
    return y.reshape(-1)


if __name__ == "__main__":
    name, src, dst = sys.argv[1:4]
    with open(src, "rb") as f:
        out = dequantize(name, f.read())
    out.astype("<f4").tofile(dst)
