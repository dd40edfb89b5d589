"""Digest many receipts (gpu-evidence.sh `pseeds` folders) into one line each and one row per configuration.

    python scripts/digest-runs.py OUT_PREFIX NAME=DIR ...     (DIR holds seed-NN/*.json or *.json receipts)

Every receipt is verified first (`lora-parity verify`'s check: a receipt that does not reproduce from its raw
scores is counted apart, never judged). Per receipt: the configuration, seed, run, verdict, delivery (the
receipt's `verdicts.sync`) and computation (`verdicts.numerics`) verdicts, the failed checks and the first
finding. Per configuration: runs, passes, delivery failures, computation failures, inconclusive runs, errors.
Writes OUT_PREFIX.jsonl and OUT_PREFIX.md; prints the table. Nothing is re-run.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from lora_parity.evidence.receipt import CheckStatus
from lora_parity.util.errors import ReceiptError
from lora_parity.verdict import findings
from lora_parity.verdict.verify import verify


def digest(name: str, path: Path) -> dict[str, object]:
    seed = path.parent.name.removeprefix("seed-") if path.parent.name.startswith("seed-") else "00"
    row: dict[str, object] = {"config": name, "seed": int(seed), "run": path.stem, "file": str(path)}
    try:
        receipt = verify(path).receipt
    except ReceiptError as e:
        return row | {"verified": False, "why": str(e)[:300]}
    split = receipt.verdicts
    return row | {
        "verified": True,
        "verdict": receipt.verdict.value,
        "delivery": split.sync.verdict.value if split else None,
        "computation": split.numerics.verdict.value if split else None,
        "failed": [c.id for c in receipt.checks if c.status == CheckStatus.FAIL],
        "inconclusive": [c.id for c in receipt.checks if c.status == CheckStatus.INCONCLUSIVE],
        "finding": (findings.of_receipt(receipt) or [None])[0],
        "error": (receipt.error or "")[:200] or None,
        "seconds": round(sum(p.seconds or 0.0 for p in receipt.phases), 1),
    }


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| configuration | receipts | pass | delivery fail | computation fail | inconclusive | error | "
             "not verified |", "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(str(r["config"]) for r in rows):
        mine = [r for r in rows if r["config"] == name]
        ok = [r for r in mine if r.get("verified")]
        n = Counter(str(r["verdict"]) for r in ok)
        lines.append(f"| {name} | {len(mine)} | {n['pass']} | {sum(r['delivery'] == 'fail' for r in ok)} | "
                     f"{sum(r['computation'] == 'fail' for r in ok)} | {n['inconclusive']} | {n['error']} | "
                     f"{len(mine) - len(ok)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    prefix, jobs = Path(argv[0]), []
    for spec in argv[1:]:
        name, _, folder = spec.partition("=")
        jobs += [(name, path) for path in sorted(Path(folder).glob("**/*.json"))
                 if not path.name.endswith(".summary.json")]  # the --json summaries beside hf-seeds' receipts
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:  # a verify takes seconds
        rows = list(pool.map(digest, *zip(*jobs, strict=True))) if jobs else []
    prefix.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = table(rows)
    prefix.with_suffix(".md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
