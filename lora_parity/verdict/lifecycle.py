"""The lifecycle table: each condition of the engine as users deploy it, and whether this run exercised it.

lora-parity's own defaults make repeats exact (eager mode, batch-invariant kernels, no sleep mode, raw prompt
logprobs, fresh prompts); several silent LoRA faults show only under the deployed settings (issue 44). Each
row is derived from what the run recorded, never from its options alone: the phases that completed
(`receipt.phases`) and the settings the sampler reported (`receipt.sampler.settings`). "not covered" is a
row of its own in every report, never a pass. Pure: `verify` recomputes the table from the same fields.

Settings read (each sampler records those it knows; a missing one reads "not recorded"):
`cuda_graphs` ('on ...' or 'off (why)'), `enforce_eager`, `sleep_mode` ('off (why)'), `batch_invariant`
('on'/'off (why)', a server's VLLM_BATCH_INVARIANT value), `logprobs_mode`, `enable_prefix_caching` and
`engine_args` (the user's `KEY=VALUE` engine arguments), `mixed_batch` ('on', or 'off: why'), `sampling` (the
user's temperature, top-p and top-k: `models.sampling`), `sync_buckets` (how the sync hands the weights over:
`models.loop`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lora_parity.evidence.receipt_models import GRAPHS_DECODE_ONLY, SYNC_AT_ONCE, LifecycleRow, PhaseStatus

SLEEP_PHASES = {1: ("sleep_wake.level1", "wake_again.level1"), 2: ("sleep_wake.level2", "wake_again.level2")}
"""The phases of a sleep level (`run.sleep_wake`, `--sleep-levels`): sleep -> sync -> wake -> score, then a second
sleep and wake without a sync (level 2 drops the weights each time). vLLM-CPU has no sleep mode (docs/deployment.md)."""
PREFIX_PHASES = ("stale_cached", "updated_cached")
GENERATION_PHASES = ("sample", "generate_updated")
PROCESSED = ("processed_logprobs", "processed_logits")
MIXED_PHASE = "mixed_batch"

CONDITIONS = ("CUDA graphs", "sleep level 1 + wake", "sleep level 2 + wake", "warm prefix cache after the sync",
              "decode-path logprobs", "processed logprobs", "mixed batches", "batch-variant kernels",
              "the user's engine arguments", "the user's sampling parameters", "the user's sync in buckets")
"""Every row, in the order the table prints them (the last two only where the sampler records `sampling` and
`sync_buckets`: receipts made before them derive the table they recorded)."""
IDENTITY_SAMPLING = "temperature 1, top_p 1, top_k off"
"""`models.sampling.SamplingSpec.describe()` of the identity (lora-parity's own sampling)."""


def _setting(settings: Mapping[str, Any], key: str) -> str | None:
    value = settings.get(key)
    return None if value is None else str(value)


def _graphs(settings: Mapping[str, Any], backend: str, done: set[str]) -> LifecycleRow:
    recorded = _setting(settings, "cuda_graphs")
    if recorded is not None and recorded.startswith(GRAPHS_DECODE_ONLY) and not done & set(GENERATION_PHASES):
        return _row("CUDA graphs", False, f"{recorded}; this run scored prompts alone (--probes sampled decodes "
                                          "through them)")
    if recorded is not None:
        return _row("CUDA graphs", recorded.startswith("on"), recorded)
    if settings.get("enforce_eager") is True:
        return _row("CUDA graphs", False, "eager mode (enforce_eager: true)")
    return _row("CUDA graphs", False, f"not recorded by the {backend} sampler")


def _sleep(level: int, done: set[str], phases: set[str], settings: Mapping[str, Any], backend: str) -> LifecycleRow:
    name = f"sleep level {level} + wake"
    first, again = SLEEP_PHASES[level]
    if first in done and again in done:
        whole = "wake: everything at once" in (_setting(settings, "loop") or "")  # the user's loop (`models.loop`)
        around = "sleep -> wake -> sync -> score" if whole else "sleep -> sync -> wake -> score"
        return _row(name, True, f"{around}, and a second wake without a sync ({first}, {again})")
    if first in phases or again in phases:
        return _row(name, False, "the sleep/wake phases did not complete")
    why = _setting(settings, "sleep_mode") or f"the {backend} sampler records no sleep mode"
    if why.startswith("on"):
        why = f"sleep mode {why}, but the run asked for no level-{level} sleep (--sleep-levels, sampler.sleep_levels)"
    return _row(name, False, f"no sleep/wake phase ran: {why}")


def _prefix(done: set[str], phases: set[str], settings: Mapping[str, Any], backend: str) -> LifecycleRow:
    name = "warm prefix cache after the sync"
    if all(p in done for p in PREFIX_PHASES):
        reset = "reset after the sync: yes" in (_setting(settings, "loop") or "")  # the user's loop (`models.loop`)
        return _row(name, True, "prefixes read through the cache before the sync (stale_cached) and the same "
                                "prefixes after it (updated_cached" + (", the cache reset after the sync as the user's "
                                                                       "loop does" if reset else "") + "): checks P.*")
    if any(p in phases for p in PREFIX_PHASES):
        return _row(name, False, "the prefix-cache phases did not complete")
    off = _setting(settings, "cached_scoring")
    if off is not None and off.startswith("off"):
        return _row(name, False, off)
    if settings.get("enable_prefix_caching") is False:
        return _row(name, False, "prefix caching off (enable_prefix_caching: false)")
    return _row(name, False, f"the {backend} sampler does not score through its prefix cache (no P phases)")


def _decode(done: set[str]) -> LifecycleRow:
    ran = [p for p in GENERATION_PHASES if p in done]
    if ran:
        return _row("decode-path logprobs", True, f"generation logprobs beside prompt logprobs ({', '.join(ran)}): "
                                                  "checks G.*")
    return _row("decode-path logprobs", False, "prompt logprobs only (the generation path runs with --probes sampled)")


def _mixed(done: set[str], phases: set[str], settings: Mapping[str, Any]) -> LifecycleRow:
    if MIXED_PHASE in done:
        return _row("mixed batches", True, "the base model and the synced adapter (and the replaced version where "
                                           "one batch serves two adapters) in one batch, each against its scores "
                                           "alone: checks M.*")
    if MIXED_PHASE in phases:
        return _row("mixed batches", False, "the mixed-batch phase did not complete")
    off = _setting(settings, "mixed_batch")
    if off is not None and off.startswith("off"):
        return _row("mixed batches", False, off)
    return _row("mixed batches", False, "no phase scores base and adapter requests, or two adapter versions, in one "
                                        "batch")


def _processed(settings: Mapping[str, Any], backend: str, done: set[str]) -> LifecycleRow:
    mode, said = _setting(settings, "logprobs_mode"), _setting(settings, "sampling")
    if mode is None:
        return _row("processed logprobs", False, f"not recorded by the {backend} sampler (raw logprobs)")
    # vLLM's prompt logprobs are raw whatever the mode: only the decode path reads processed ones. Receipts that
    # record `sampling` (the rule's own age) are held to that; older ones keep the table they recorded.
    if mode in PROCESSED and said is not None and not done & set(GENERATION_PHASES):
        return _row("processed logprobs", False, f"logprobs_mode: {mode}, but no phase generated (the engine's prompt "
                                                 "logprobs are raw; the decode path runs with --probes sampled)")
    if mode == "processed_logprobs" and said is not None and said != IDENTITY_SAMPLING:
        how = "at that temperature" if said.endswith(", top_p 1, top_k off") else "as processed (top-k, top-p)"
        return _row("processed logprobs", True, f"logprobs_mode: {mode}, drawn at {said}: the trainer scores the drawn "
                                                f"tokens {how} (G.trainer); G.sampled and G.updated not "
                                                "computed (the engine's prompt logprobs stay raw)")
    return _row("processed logprobs", mode in PROCESSED, f"logprobs_mode: {mode}")


def _batch_variant(settings: Mapping[str, Any], backend: str) -> LifecycleRow:
    name = "batch-variant kernels"
    value = _setting(settings, "batch_invariant")
    if value is None:
        return _row(name, False, f"not recorded by the {backend} sampler")
    if value.startswith("on") or value.strip() == "1":
        return _row(name, False, f"batch-invariant kernels {value}: repeats exact, the deployed kernels not run")
    return _row(name, True, f"batch invariance {value}: the sampler repeats (A/C sampler_repeat) measure the noise "
                            "under it")


def _engine_args(settings: Mapping[str, Any]) -> LifecycleRow:
    given, effect = settings.get("engine_args"), settings.get("engine_args_effect")
    if isinstance(given, list) and given:
        said = "; ".join(str(e) for e in effect) if isinstance(effect, list) and effect else ""
        return _row("the user's engine arguments", True, "as given: " + ", ".join(str(g) for g in given)
                    + (f" ({said})" if said else ""))
    return _row("the user's engine arguments", False, "lora-parity's defaults only (no --engine-arg or "
                                                      "sampler.engine_args)")


def _sampling(settings: Mapping[str, Any], done: set[str]) -> list[LifecycleRow]:
    name, said = "the user's sampling parameters", _setting(settings, "sampling")
    if said is None:
        return []
    if said == IDENTITY_SAMPLING:
        return [_row(name, False, f"lora-parity's own ({said}); --sampling or sampler.sampling sets yours")]
    if not done & set(GENERATION_PHASES):
        return [_row(name, False, f"{said}, but no phase generated (the decode path runs with --probes sampled)")]
    raw = _setting(settings, "logprobs_mode") != "processed_logprobs"
    return [_row(name, True, f"rollouts drawn with {said}; " + ("the logprobs compared are raw: checks G.*" if raw else
                                                                "processed logprobs compared (the row above)"))]


def _buckets(settings: Mapping[str, Any], done: set[str]) -> list[LifecycleRow]:
    name, said = "the user's sync in buckets", _setting(settings, "sync_buckets")
    if said is None:
        return []
    if said == SYNC_AT_ONCE:
        return [_row(name, False, "the weights handed over at once (--loop bucket_mb=N with --sync memory hands the "
                                  "merged weights over in your buckets)")]
    if "sync" not in done:
        return [_row(name, False, f"{said}, but the sync did not complete")]
    return [_row(name, True, f"the merged weights handed over in {said}: checks C.* (the modules split across "
                             "buckets: each version's split_modules)")]


def _row(condition: str, covered: bool, detail: str) -> LifecycleRow:
    return LifecycleRow(condition=condition, status="covered" if covered else "not covered", detail=detail)


def derive(backend: str, settings: Mapping[str, Any], phases: Sequence[Any]) -> list[LifecycleRow]:
    """The table for a run whose sampler is `backend` with `settings`, and whose `phases` (records with `name`
    and `status`) ran; a phase counts as run only where it completed."""
    names = {p.name for p in phases}
    done = {p.name for p in phases if p.status == PhaseStatus.OK}
    return [_graphs(settings, backend, done), _sleep(1, done, names, settings, backend),
            _sleep(2, done, names, settings, backend),
            _prefix(done, names, settings, backend), _decode(done), _processed(settings, backend, done),
            _mixed(done, names, settings),
            _batch_variant(settings, backend), _engine_args(settings), *_sampling(settings, done),
            *_buckets(settings, done)]


def of_receipt(receipt: Any) -> list[LifecycleRow]:
    """The table of a receipt (recorded or not: receipts made before it are derived the same way)."""
    return derive(receipt.sampler.backend, receipt.sampler.settings, receipt.phases)


def not_covered(rows: Sequence[LifecycleRow]) -> list[LifecycleRow]:
    """The rows this run did not cover."""
    return [r for r in rows if r.status == "not covered"]
