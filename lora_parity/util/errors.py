"""One error hierarchy. Each subclass also inherits the matching built-in, so callers can catch either.

The CLI maps every `LoraParityError` to a one-line message and the exit code in `EXIT_*`; anything
else that escapes is a bug and still ends with exit code 2 and one line (plus the traceback on
`LORA_PARITY_DEBUG=1`).
"""

from __future__ import annotations

EXIT_PASS = 0
"""The run (or the verified receipt) passed."""
EXIT_FAIL = 1
"""The run (or the verified receipt) failed or was inconclusive."""
EXIT_BAD_INPUT = 2
"""Bad input, an errored run, or a receipt that does not verify."""


class LoraParityError(Exception):
    """Base of every error lora-parity raises on purpose."""


class ConfigError(LoraParityError, ValueError):
    """A config, model path or option is missing or malformed."""


class BackendUnavailableError(LoraParityError, ImportError):
    """A backend's packages are not installed; the message names the pip extra."""


class ScoreError(LoraParityError, ValueError):
    """A backend returned scores that cannot be compared (non-finite, wrong length, misaligned)."""


class PhaseError(LoraParityError, RuntimeError):
    """A phase of the sequence could not complete (including an injected crash)."""


class ReceiptError(LoraParityError, ValueError):
    """A receipt is unreadable, invalid, tampered with, or does not reproduce from its raw scores."""


class ReceiptExistsError(LoraParityError, FileExistsError):
    """The output path exists and `--force` was not given."""
