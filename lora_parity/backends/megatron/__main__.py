"""`python -m lora_parity.backends.megatron`, the entry point before this backend became a package:
one line that names its replacement, exit code 2 (bad usage)."""

import sys

if __name__ == "__main__":
    print("error: torchrun's entry point is now `-m lora_parity.launch` (this backend's rank processes "
          "run `-m lora_parity.backends.megatron.serve`)", file=sys.stderr)
    sys.exit(2)
