"""Summarize the `selftest --json` files of an unpacked `gpu-evidence.sh sglang-selftest` tarball: per selftest, the
false alarms and each fault caught k of N seeds with its closest call; and the clean runs' closest call other than
B.stimulus, whose margin the calibrated update sets (the trainer's change is searched into [1, calibration_ceiling] x
its threshold).   usage: PYTHONPATH=. summarize-sglang-selftests.py FOLDER"""
import json
import pathlib
import sys

from lora_parity.evidence.receipt import Receipt
from lora_parity.run import selftest

root = pathlib.Path(sys.argv[1])
for j in sorted(root.glob("sglang-*.json")):
    d = json.loads(j.read_text())
    fa = d["false_alarms"]
    tallies = d["faults"]
    every = [t for t in tallies if t["caught"] == t["runs"]]
    print(f"{j.stem}: seeds {d['seeds']}, ok {d['ok']}, false alarms {fa['count']}/{fa['runs']} "
          f"(closest clean margin {fa['closest']['margin']:.3g} on {fa['closest']['check']}); "
          f"{len(every)}/{len(tallies)} faults caught in every seed")
    for t in tallies:
        near = t["closest"]
        margin = f", closest {near['margin']:.3g} on {near['check']}" if near and near["margin"] is not None else ""
        print(f"  {t['fault']:<22} {t['caught']}/{t['runs']}  expected {t['expected']}{margin}")
    cleans = sorted((root / j.stem).glob("**/clean.json"))
    others = []
    for f in cleans:
        checks = [c for c in Receipt.model_validate_json(f.read_text()).checks if c.id != "B.stimulus"]
        others.append(selftest.margin(checks, (), tuple(c.id for c in checks)))
    known = [m for m in others if m[0] is not None]
    if known:
        value, check = min(known)
        print(f"  clean runs' closest call but B.stimulus: {value:.3g} on {check} ({len(cleans)} clean runs)")
    restarted = [r for r in d["rows"] if r.get("restarted")]
    print(f"  servers restarted after a run: {len(restarted)}")
