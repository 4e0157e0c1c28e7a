"""How the base was quantised, in one small form that a checkpoint records and a resume compares: {"bits": 4 or 8,
"type": "nf4" / "fp4" (4-bit only)}, or None for a base loaded unquantised. A LoRA adapter trained against a 4-bit
base and resumed on an 8-bit (or unquantised) one goes on training against other weights, without a word, unless
the checkpoint says what it was trained against."""

from __future__ import annotations

from ..config import QuantizationSection


def of_section(q: QuantizationSection | None) -> dict | None:
    """The recipe's model.quantization in the recorded form."""
    if q is None:
        return None
    return {"bits": q.bits, "type": (q.type or "nf4") if q.bits == 4 else None}


def of_model(model) -> dict | None:
    """The loaded model's quantisation (transformers keeps its BitsAndBytesConfig on the config), recorded form."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if get("load_in_4bit"):
        return {"bits": 4, "type": get("bnb_4bit_quant_type") or "nf4"}
    if get("load_in_8bit"):
        return {"bits": 8, "type": None}
    return None


def described(record: dict | None) -> str:
    if record is None:
        return "unquantised"
    return f"{record['bits']}-bit" + (f" {record['type']}" if record.get("type") else "")
