"""Bytes of bitsandbytes' quantised linear weights, for the memory plan (launch.plan).

4-bit (Dettmers et al. 2023): half a byte per weight, plus a float32 absmax per block of 64 weights; with double
quantisation the absmax values are themselves 8-bit, with a float32 constant per 256 of them. 8-bit (LLM.int8): a
byte per weight plus a float32 scale per output row, ignored here (a row holds thousands of weights).
"""

from __future__ import annotations

BLOCK = 64  # weights per 4-bit quantisation block (bitsandbytes' blocksize for 4-bit weights)
DOUBLE_BLOCK = 256  # absmax values per block of the second quantisation


def quantized_linear_bytes(weights: int, bits: int, double_quant: bool = True) -> float:
    """Bytes of `weights` linear weights quantised to `bits` (4 or 8)."""
    if bits == 8:
        return float(weights)
    constants = weights / BLOCK * (1 + 4 / DOUBLE_BLOCK) if double_quant else weights / BLOCK * 4
    return weights / 2 + constants
