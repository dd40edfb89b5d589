"""Summarize the `selftest --json` files of an unpacked `gpu-evidence.sh sglang-selftest` tarball: per selftest, the
false alarms and each fault caught k of N seeds with its closest call.   usage: summarize-sglang-selftests.py FOLDER"""
import json
import pathlib
import sys

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
    restarted = [r for r in d["rows"] if r.get("restarted")]
    print(f"  servers restarted after a run: {len(restarted)}")
