"""The CLI's commands, one module per group (huggingface_hub's layout); `lora_parity.cli` registers
them on its typer app and keeps `run`, `selftest` and `keygen`.

- `options`: the option types every command shares, defined once.
- `receipts`: commands that read receipts (verify, report, table, diff, schema).
- `models`: the model configs (models, init).
"""
