"""torchrun's entry point for the Megatron trainer: `torchrun ... -m lora_parity.launch run --trainer megatron --tp N`.

torchrun's rank 0 runs the CLI (the sequence and the sampler), which starts trainer rank 0 as its
child; torchrun's other ranks serve the trainer (`backends.megatron.serve`). This module lives
outside `backends/` so that no backend imports the CLI.
"""

from __future__ import annotations

import os

from lora_parity.backends.megatron import protocol

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def loopback_gloo(environ: dict[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME=lo when torchrun's rank 0 is on the loopback address (every "node" on this
    machine, `--local-addr 127.0.0.1`) and the user named no interface: gloo otherwise picks the one
    the host name resolves to, which in containers may not route to itself. Else nothing."""
    if environ.get("MASTER_ADDR") in LOOPBACK and "GLOO_SOCKET_IFNAME" not in environ:
        return {"GLOO_SOCKET_IFNAME": "lo"}
    return {}


def main() -> None:
    """A trainer rank process under torchrun, or, as torchrun's rank 0, the CLI."""
    os.environ.update(loopback_gloo(dict(os.environ)))  # before any process group, and for trainer rank 0
    if protocol.is_rank_process(dict(os.environ)):
        from lora_parity.backends.megatron.serve import serve

        serve()
    else:
        from lora_parity.cli.app import main as cli_main

        cli_main()


if __name__ == "__main__":
    main()
