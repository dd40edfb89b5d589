"""torchrun's entry point for the Megatron trainer: `torchrun ... -m lora_parity.launch run --trainer megatron --tp N`.

torchrun's rank 0 runs the CLI (the sequence and the sampler), which starts trainer rank 0 as its
child; torchrun's other ranks serve the trainer (`backends.megatron.serve`). This module lives
outside `backends/` so that no backend imports the CLI.
"""

from __future__ import annotations

import os

from lora_parity.backends.megatron import protocol


def main() -> None:
    """A trainer rank process under torchrun, or, as torchrun's rank 0, the CLI."""
    if protocol.is_rank_process(dict(os.environ)):
        from lora_parity.backends.megatron.serve import serve

        serve()
    else:
        from lora_parity.cli import main as cli_main

        cli_main()


if __name__ == "__main__":
    main()
