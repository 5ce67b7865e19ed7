"""How rows are stored: the per-row power-of-two scale and the bfloat16 bit pattern.

Holds ``TOP_EXP`` and ``BF16_NAN``, ``row_maxabs``, ``row_scales``, ``f32_to_bf16_bits``,
``bf16_bits_to_f32``, ``encode_rows`` (true float32 rows -> stored values and row_scale) and
``decode_rows`` (back). The rules are described in ``format``'s docstring; numpy only.
"""

from __future__ import annotations

import numpy as np

# A row's max |stored value| is kept below 2**TOP_EXP: float16 tops out at 65504 (~2**16),
# so two binades of headroom keep rounding and later arithmetic from overflowing.
TOP_EXP = 14
BF16_NAN = 0x7FC0  # the fill value of bfloat16 grads: a quiet NaN's high half


def row_maxabs(rows: np.ndarray) -> np.ndarray:
    """Per-row max |value|; NaN or inf where a row has a non-finite value (max/min propagate)."""
    return np.maximum(rows.max(axis=1), -rows.min(axis=1))


def row_scales(maxabs: np.ndarray) -> np.ndarray:
    """Power-of-two scales putting each row's max |value| in [2**(TOP_EXP-1), 2**TOP_EXP)."""
    _, exp = np.frexp(maxabs)  # maxabs = m * 2**exp with 0.5 <= m < 1
    # Clipped to float32's normal exponents so the scale itself is an exact float32.
    scale = np.ldexp(np.float32(1.0), np.clip(exp - TOP_EXP, -126, 127)).astype(np.float32)
    scale[maxabs == 0] = 1.0
    return scale


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop the low half.
    bits = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (bits >> np.uint32(16)).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_rows(rows: np.ndarray, maxabs: np.ndarray | None, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """True float32 rows (and their max |value|, for low precision) -> (stored, row_scale)."""
    if dtype == "float32":
        return rows, np.ones(rows.shape[0], dtype=np.float32)
    assert maxabs is not None, "maxabs is needed for low-precision rows"
    scale = row_scales(maxabs)
    scaled = rows * (np.float32(1.0) / scale)[:, None]  # exact: scale is a power of two
    if dtype == "float16":
        return scaled.astype(np.float16), scale
    return f32_to_bf16_bits(scaled), scale


def decode_rows(stored: np.ndarray, scale: np.ndarray | None, dtype: str) -> np.ndarray:
    """Stored values (+ row_scale) -> true float32 rows."""
    if dtype == "float32":
        return stored
    out = stored.astype(np.float32) if dtype == "float16" else bf16_bits_to_f32(stored)
    assert scale is not None, "row_scale is needed for low-precision rows"
    out *= scale[:, None]
    return out
