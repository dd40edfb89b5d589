"""Tally scripts/layer-faults.sh's receipts: did each run fail, and did it name the layers (and, for zero-b, the
module) its fault touched? The layers come from the fault and the model's layer count, the naming from the receipt
(the synced file's differences, read by lora-parity; the findings print them)."""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

from lora_parity.evidence.receipt import load

SPAN = re.compile(r"layers? ([0-9, -]+)")


def layers_named(text: str) -> set[int]:
    found: set[int] = set()
    for part in SPAN.findall(text):
        for piece in part.split(","):
            piece = piece.strip()
            if "-" in piece:
                lo, hi = piece.split("-")
                found |= set(range(int(lo), int(hi) + 1))
            elif piece:
                found.add(int(piece))
    return found


def expected(fault: str, n_layers: int) -> tuple[set[int], str | None]:
    middle = n_layers // 2
    if fault == "upper-half":
        return set(range((n_layers + 1) // 2, n_layers)), None
    if fault == "previous":
        return {middle}, None
    module = fault.split("-", 2)[2] if fault.startswith("zero-b-") else None
    return {middle}, module


def main(paths: list[str]) -> int:
    tally: dict[str, list[bool]] = defaultdict(list)
    for path in paths:
        receipt, _ = load(Path(path))
        fault = Path(path).name.split(".")[1]
        tensors = receipt.perturbation.tensors if receipt.perturbation else []
        n_layers = 1 + max((int(m.group(1)) for t in tensors if (m := re.search(r"layers\.(\d+)\.", t))), default=-1)
        synced = next((a for a in receipt.adapters if a.version == 1), None)
        differs = "; ".join(synced.file_differences or []) if synced else ""
        want, module = expected(fault, n_layers)
        named = layers_named(differs) == want and (module is None or module in differs)
        ok = receipt.verdict.value == "fail" and named
        tally[fault].append(ok)
        print(f"{Path(path).name}: verdict {receipt.verdict.value}; named {sorted(layers_named(differs))} "
              f"(want {sorted(want)}{', ' + module if module else ''}): {'ok' if ok else 'MISSED'}")
    for fault, oks in sorted(tally.items()):
        print(f"{fault}: {sum(oks)}/{len(oks)} failed and named")
    return 0 if all(all(v) for v in tally.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
