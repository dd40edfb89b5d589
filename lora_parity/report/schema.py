"""The receipt's JSON Schema, generated from the pydantic models (committed as receipts/schema.json)."""

from __future__ import annotations

import json

from lora_parity.evidence.receipt import Receipt


def schema_json() -> str:
    """The receipt's JSON Schema from the pydantic models: sorted keys, indent 2, trailing newline."""
    return json.dumps(Receipt.model_json_schema(), sort_keys=True, indent=2, ensure_ascii=False) + "\n"
