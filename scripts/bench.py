"""`make bench`: the embedded default, three fresh processes, median wall time and per-phase times.

Each run is a separate `lora-parity run` process (engine start included), timed from outside;
per-phase times come from the receipts. "Overhead" is the wall time that is not engine start,
model load or a scoring pass (forward passes); the target is <= 10 % of the wall time.

`--sampler vllm,vllm-server` alternates runs of the samplers named (same probes) and prints the ratio of
their medians: issue 17's target is vllm-server / vllm <= 2.0x on the CPU. A served sampler's server
starts while the trainer loads: its cost to the run is `sampler.start_wait`, which the engine figures
count (`sampler.start`, launch to healthy, is printed beside it).

`--target SECONDS` prints each probe set's median against that target (issue 15: the smollm2 fp32
run, <= 45 s per probe source on 2 cores) and exits 1 when one is over it.

`--selftest` times `lora-parity selftest` instead (fresh processes, median; target <= 60 s on 2
cores). `--floor` alternates the default run with `python -c "import torch, transformers, peft, vllm"`
and prints their ratio (issue 26: <= 1.6x), and one run against a selftest of the same invocation
(<= 2x). `--refusals` times each refusal of issue 26's list (fresh processes, median of `--runs`;
target <= 1 s on a quiet machine) and checks it exits 2.
`--against DIR` alternates every run with the same run of the code in DIR (another checkout,
put first on PYTHONPATH), so that before and after are measured in one sitting on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Importing torch, transformers, PEFT and vLLM is part of starting the engine and loading the model.
ENGINE_AND_LOAD = ("backends.import", "sampler.import", "sampler.start", "sampler.load", "trainer.load",
                   "model.materialize")


def _cwd(code: str | None) -> str | None:
    """Where a run of the code in `code` starts: `python -m` puts the working directory first on
    sys.path, ahead of PYTHONPATH, so a run started in another checkout would import that one's code."""
    return str(Path(code).resolve()) if code is not None else None


def _env(code: str | None) -> dict[str, str]:
    """The environment of a run of the code in `code` (a checkout), or of this one."""
    if code is None:
        return dict(os.environ)
    first = str(Path(code).resolve())
    return {**os.environ, "PYTHONPATH": os.pathsep.join([first, *filter(None, [os.environ.get("PYTHONPATH")])])}


def _engine_seconds(timings: dict[str, float]) -> float:
    """Engine start and model load as the run paid for them: a server started beside the trainer
    counts for the time the run waited for it (`sampler.start_wait`), not its whole start."""
    keys = [k for k in ENGINE_AND_LOAD if not (k == "sampler.start" and "sampler.start_wait" in timings)]
    return sum(timings.get(k, 0.0) for k in keys) + timings.get("sampler.start_wait", 0.0)


def _run(args: argparse.Namespace, probes: str, out: Path,
         code: str | None = None, sampler: str | None = None) -> tuple[float, dict[str, Any]] | None:
    cmd = [sys.executable, "-m", "lora_parity", "run", "--out", str(out), "--json", "--sync", args.sync,
           "--probes", probes]
    if sampler:
        cmd += ["--sampler", sampler]
    if args.model:
        cmd += ["--model", args.model]
    if args.per_target is not None:
        cmd += ["--per-target" if args.per_target else "--no-per-target"]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(code), cwd=_cwd(code))
    wall = time.perf_counter() - start
    if res.returncode not in (0, 1) or not out.is_file():  # 1: a verdict other than pass, still timed
        print(res.stderr[-3000:], file=sys.stderr)
        print(f"bench: {probes} exited {res.returncode}", file=sys.stderr)
        return None
    receipt: dict[str, Any] = json.loads(out.read_text())
    if args.keep and receipt.get("verdict") != "pass":  # a run that did not pass is evidence
        keep = Path(args.keep)
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, keep / f"{Path(str(probes)).name}-{out.name}")
    return wall, receipt


def _report(args: argparse.Namespace, probes: str, walls: list[float], receipts: list[dict[str, Any]]) -> None:
    med = statistics.median
    print(f"lora-parity bench: {args.runs} fresh processes, model {receipts[0]['model']['name']}, "
          f"sampler {receipts[0]['sampler']['backend']} on {receipts[0]['environment']['device']}, sync {args.sync}, "
          f"probes {probes} ({receipts[0]['probes']['num_scored_positions']} scored tokens)")
    print(f"  wall time (process)         median {med(walls):7.2f} s   runs: "
          + ", ".join(f"{w:.2f}" for w in walls))
    keys = [k for k in receipts[0]["timings"] if k != "total" and not k.startswith("process.")]
    shown = [k for k in keys if k in ENGINE_AND_LOAD or not k.startswith(("score.", "publish.v", "http."))]
    for key in shown:
        values = [r["timings"].get(key, 0.0) for r in receipts]
        print(f"  {key:<28} median {med(values):7.3f} s")
    score = [sum(v for k, v in r["timings"].items() if k.startswith("score.")) for r in receipts]
    sync = [r["timings"].get("sync", 0.0) for r in receipts]
    publish = [statistics.mean([v for k, v in r["timings"].items() if k.startswith("publish.v")]) for r in receipts]
    engine = [_engine_seconds(r["timings"]) for r in receipts]
    _report_http(receipts)
    overhead = [w - e - s for w, e, s in zip(walls, engine, score, strict=True)]
    print(f"  all scoring passes          median {med(score):7.3f} s")
    print(f"  sync (export + load)        median {med(sync):7.3f} s   mean publish per version {med(publish):.3f} s")
    print(f"  engine start + model load   median {med(engine):7.3f} s (imports included)")
    print(f"  wall / (imports + engine start + model load): {med(walls) / med(engine):.2f}x (medians; issue 47's GPU "
          "target <= 1.3x)")
    targets = [per_target_seconds(r["timings"]) for r in receipts]
    if any(targets):
        shares = [t / w for t, w in zip(targets, walls, strict=True)]
        print(f"  per-target coverage         median {med(targets):7.3f} s = {100 * med(shares):.1f} % of the "
              f"wall time (median of the runs' shares; target <= 25 %)")
    print(f"  overhead (the rest)         median {med(overhead):7.3f} s = {100 * med(overhead) / med(walls):.1f} % "
          f"of the wall time (target <= 10 %)")
    # `total` times the sequence after loading: the rest is neither it nor the engine's start and the imports
    outside = [w - r["timings"].get("total", w) - e for w, r, e in zip(walls, receipts, engine, strict=True)]
    print(f"    of which outside the run  median {med(outside):7.3f} s (interpreter start, the CLI, preflight "
          "before the run's timer, exit and teardown)")
    # the process's own clock (`util.process_clock`): its age as the run starts and as the receipt is sealed
    before = [r["timings"].get("process.before_run") for r in receipts]
    sealed = [r["timings"].get("process.at_receipt") for r in receipts]
    if all(b is not None for b in before) and all(a is not None for a in sealed):
        after = [w - a for w, a in zip(walls, sealed, strict=True)]
        print(f"      before the run          median {med(before):7.3f} s (interpreter start and the CLI's imports)")
        print(f"      after the receipt       median {med(after):7.3f} s (exit and teardown: the engine's shutdown, "
              "the interpreter's)")
    untimed = [untimed_in_open(r["timings"]) for r in receipts]
    if all(u is not None for u in untimed):
        print(f"      in the backends' start  median {med([u for u in untimed if u is not None]):7.3f} s outside its "
              "timed parts (the engine's settings read back, the backends' info, the start adapter)")
    print(f"  scoring: {receipts[0]['sampler']['settings'].get('scoring')}; "
          f"trainer: {receipts[0]['trainer']['settings'].get('forward', 'one sequence per forward')}")
    print(f"  verdicts: {', '.join(r['verdict'] for r in receipts)}")


def untimed_in_open(timings: dict[str, float]) -> float | None:
    """What the backends' start (`backends.open`) spent outside its own timed parts: the checkpoint, the imports and
    start of the sampler, the trainer's load (the run's wait for a served sampler, not its whole start). None for a
    receipt made before `backends.open` was timed."""
    if "backends.open" not in timings:
        return None
    inside = _engine_seconds(timings) - timings.get("backends.import", 0.0)  # the imports before it are preflight's
    return timings["backends.open"] - inside - timings.get("model.digest", 0.0)


def per_target_seconds(timings: dict[str, float]) -> float:
    """The run's per-target coverage: its `target.<name>` phases (each with its search, scoring and sync)."""
    return sum(v for k, v in timings.items() if k.startswith("target."))


def _report_http(receipts: list[dict[str, Any]]) -> None:
    """A served sampler's HTTP time per endpoint (medians; concurrent calls' times add up)."""
    kinds = sorted({k.split(".")[1] for r in receipts for k in r["timings"] if k.startswith("http.")})
    for kind in kinds:
        values = [sum(v for k, v in r["timings"].items() if k.split(".")[:2] == ["http", kind]) for r in receipts]
        print(f"  {'http ' + kind:<28} median {statistics.median(values):7.3f} s")


def _selftest(args: argparse.Namespace, tmp: str, code: str | None, i: int) -> float | None:
    cmd = [sys.executable, "-m", "lora_parity", "selftest", "--json", "--out-dir", str(Path(tmp) / f"st-{i}")]
    if args.model:
        cmd += ["--model", args.model]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(code), cwd=_cwd(code))
    wall = time.perf_counter() - start
    if res.returncode != 0:
        print(res.stdout[-2000:] + res.stderr[-2000:], file=sys.stderr)
        print(f"bench: selftest exited {res.returncode}", file=sys.stderr)
        return None
    return wall


def bench_selftest(args: argparse.Namespace) -> int:
    """Median wall time of `lora-parity selftest` in fresh processes (alternating with --against)."""
    codes: list[str | None] = [None] + ([args.against] if args.against else [])
    walls: dict[str | None, list[float]] = {c: [] for c in codes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for j, code in enumerate(codes):
                wall = _selftest(args, tmp, code, 2 * i + j)
                if wall is None:
                    return 1
                walls[code].append(wall)
    for code in codes:
        runs = ", ".join(f"{w:.1f}" for w in walls[code])
        print(f"lora-parity bench: selftest{f' ({code})' if code else ''}: median "
              f"{statistics.median(walls[code]):.1f} s of {args.runs} fresh processes (target <= 60 s); runs: {runs}")
    return 0


REFUSALS: dict[str, list[str]] = {
    "--probes text, model without a tokenizer": ["run", "--probes", "text"],
    "missing probe file": ["run", "--probes", "no-such-probes.jsonl"],
    "--trainer tinker without a sampler": ["run", "--trainer", "tinker"],
    "--inject crash-at=typo": ["run", "--inject", "crash-at=sycn"],
    "--probes default-x100000000": ["run", "--probes", "default-x100000000"],
    "--junit into a file, not a folder": ["run", "--junit", "README.md/j.xml"],
    "--adapter missing": ["run", "--adapter", "no-such-adapter"],
}
"""Issue 26's refusals: each must exit 2 before torch, transformers, PEFT or vLLM is imported."""
IMPORT_FLOOR = "import torch, transformers, peft, vllm"


def _timed(cmd: list[str], cwd: str | None = None) -> tuple[float, int]:
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    return time.perf_counter() - start, res.returncode


def bench_refusals(args: argparse.Namespace) -> int:
    """Median wall time of each refusal in fresh processes; exit 1 if one does not exit 2."""
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for what, argv in REFUSALS.items():
            runs = [_timed([sys.executable, "-m", "lora_parity", *argv, "--out", str(Path(tmp) / "r.json")])
                    for _ in range(args.runs)]
            codes = {code for _, code in runs}
            median = statistics.median(w for w, _ in runs)
            worst = max(worst, median)
            print(f"lora-parity bench: refusal {what}: median {median:.2f} s of {args.runs} (exit {sorted(codes)}; "
                  f"target <= 1 s)")
            if codes != {2}:
                return 1
    print(f"lora-parity bench: refusals: slowest median {worst:.2f} s (target <= 1 s: "
          f"{'met' if worst <= 1 else 'MISSED'}); load average {_load()}")
    return 0


def bench_floor(args: argparse.Namespace) -> int:
    """The default run against the import floor and against a selftest, alternating, one invocation."""
    walls: dict[str, list[float]] = {"run": [], "floor": [], "selftest": []}
    load_before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            result = _run(args, "default", Path(tmp) / f"floor-{i}.json")
            if result is None:
                return 1
            walls["run"].append(result[0])
            walls["floor"].append(_timed([sys.executable, "-c", IMPORT_FLOOR])[0])
            wall = _selftest(args, tmp, None, i)
            if wall is None:
                return 1
            walls["selftest"].append(wall)
    med = {k: statistics.median(v) for k, v in walls.items()}
    for name, values in walls.items():
        print(f"lora-parity bench: {name}: median {med[name]:.2f} s of {args.runs}; "
              f"runs: {', '.join(f'{w:.2f}' for w in values)}")
    print(f"run / import floor: {med['run'] / med['floor']:.2f}x (target <= 1.6x); selftest / run: "
          f"{med['selftest'] / med['run']:.2f}x (target <= 2x); same invocation, alternating; load average "
          f"{load_before} before, {_load()} after")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--sync", default="new-id")
    parser.add_argument("--probes", default="default",
                        help="probe sets, comma-separated, e.g. default,default-x10: runs alternate between them "
                             "and the median wall time of each is compared with the first's")
    parser.add_argument("--sampler", default=None,
                        help="samplers, comma-separated, e.g. vllm,vllm-server: runs alternate between them (on the "
                             "first probe set) and the median wall time of each is compared with the first's")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="copy the receipt of every run whose verdict is not pass into DIR")
    parser.add_argument("--per-target", dest="per_target", action=argparse.BooleanOptionalAction, default=None,
                        help="pass --per-target / --no-per-target to every run (default: the config's setting)")
    parser.add_argument("--target", type=float, default=None, metavar="SECONDS",
                        help="report each probe set's median wall time against this target (exit 1 if over)")
    parser.add_argument("--selftest", action="store_true", help="time `lora-parity selftest` instead of `run`")
    parser.add_argument("--against", default=None, metavar="DIR",
                        help="alternate each run with the same run of the code in DIR (another checkout)")
    parser.add_argument("--floor", action="store_true", help="the default run against the import floor and a selftest")
    parser.add_argument("--refusals", action="store_true", help="time each refusal of issue 26's list")
    args = parser.parse_args()
    for flag, mode in (("refusals", bench_refusals), ("floor", bench_floor), ("selftest", bench_selftest),
                       ("against", bench_against)):
        if getattr(args, flag):
            return mode(args)
    variants = _variants(args)
    walls: dict[str, list[float]] = {v: [] for v in variants}
    receipts: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    load_before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for j, (name, (probes, sampler)) in enumerate(variants.items()):  # alternating: drift hits all alike
                result = _run(args, probes, Path(tmp) / f"bench-{j}-{i}.json", sampler=sampler)  # a probe may be a path
                if result is None:
                    return 1
                walls[name].append(result[0])
                receipts[name].append(result[1])
    for name, (probes, _) in variants.items():
        _report(args, probes, walls[name], receipts[name])
    med = statistics.median
    names = list(variants)
    for name in names[1:]:
        print(f"wall time {name} / {names[0]}: {med(walls[name]) / med(walls[names[0]]):.2f}x "
              f"(medians of {args.runs}, same invocation; load average "
              f"{load_before} before, {_load()} after)")
    kind = "sampler" if args.sampler and "," in args.sampler else "probes"
    for name in names:
        print(_against_target(args, f"{receipts[name][0]['model']['name']} {kind} {name}", walls[name]))
    return 0 if args.target is None or all(med(walls[n]) <= args.target for n in names) else 1


def _against_target(args: argparse.Namespace, what: str, walls: list[float]) -> str:
    """One line: the median wall time of `what`, and whether it is within --target."""
    median = statistics.median(walls)
    line = f"lora-parity bench: {what}: median {median:.1f} s of {len(walls)} fresh processes"
    if args.target is not None:
        line += f" (target <= {args.target:g} s: {'met' if median <= args.target else 'MISSED'})"
    return f"{line}; load average now {_load()}"


def _variants(args: argparse.Namespace) -> dict[str, tuple[str, str | None]]:
    """What the runs alternate between, by name: the probe sets, or the samplers (on the first set)."""
    sets, samplers = args.probes.split(","), args.sampler.split(",") if args.sampler else [None]
    if len(samplers) > 1:
        return {s or "": (sets[0], s) for s in samplers}
    return {p: (p, samplers[0]) for p in sets}


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def bench_against(args: argparse.Namespace) -> int:
    """Every probe set, alternating between this code and the code in --against: medians and ratios."""
    sets = args.probes.split(",")
    codes = ("this", args.against)
    walls: dict[tuple[str, str], list[float]] = {(p, c): [] for p in sets for c in codes}
    receipts: dict[tuple[str, str], list[dict[str, Any]]] = {(p, c): [] for p in sets for c in codes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for k, probes in enumerate(sets):
                for j, code in enumerate(codes):
                    result = _run(args, probes, Path(tmp) / f"a-{i}-{k}-{j}.json",
                                  None if code == "this" else code)
                    if result is None:
                        return 1
                    walls[probes, code].append(result[0])
                    receipts[probes, code].append(result[1])
    for (probes, code), values in walls.items():
        print(f"== {code}")  # each code's phases and ratios, from its own alternating runs
        _report(args, probes, values, receipts[probes, code])
        print(f"lora-parity bench: run ({code}), probes {probes}: median {statistics.median(values):.2f} s "
              f"of {args.runs}; runs: {', '.join(f'{w:.2f}' for w in values)}")
    med = statistics.median
    for probes in sets:
        print(f"probes {probes}: this / {args.against} = "
              f"{med(walls[probes, 'this']) / med(walls[probes, args.against]):.2f}x (medians, alternating runs)")
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
