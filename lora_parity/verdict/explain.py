"""What a failing or inconclusive check means, and what to look at next: one line per check, for people.

A table from check id prefix to (what the observed number is, what the failure means and where to
look). The longest matching prefix wins; `{target}` is filled with the T.* target name. An id with
no entry (a check added later) falls back to the check's own reason, so every check explains itself.
"""

from __future__ import annotations

from typing import Any, Protocol

from lora_parity.verdict import check_rules


class CheckLike(Protocol):
    """What `line` reads from a receipt check."""

    id: str
    reason: str
    status: Any
    elements: int | None


# prefix -> what the failure means, and what to look at next
EXPLAIN: dict[str, str] = {
    "A.parity": "at zero-init the sampler and the trainer already disagree on the base model: look at the "
                "token alignment (prompt_logprobs[1:] vs forward), the dtype and the kernels, before any sync",
    "A.noise": "the same side scores the same state differently twice: nondeterministic kernels or batching; "
               "fix the seed/batch invariance before trusting any other check",
    "A.fp32.balance": "one side is much farther from the fp32 reference than the other at the start point, "
                      "more than one precision explains: the sampler and the trainer start from different "
                      "adapters or weights (a published start adapter other than the trainer's, another "
                      "checkpoint); compare the published adapter's tensors with the trainer's",
    "A.zero_adapter_noop": "publishing the zero-init adapter changed the sampler's scores: B is not zero in "
                           "the exported adapter, or the sampler applies the wrong weights",
    "B.withheld": "the sampler saw the update before it was synced: it reads the trainer's live weights or a "
                  "folder written too early, so a stale sampler would go unnoticed",
    "B.stimulus": "the update is too small to tell a synced sampler from a stale one: raise the perturbation "
                  "(the config's perturbation.std) or check that the trainer applied its update",
    "C.parity": "the synced sampler still gives the stale scores, so the new adapter never reached the engine: "
                "check the sync step (the adapter path, name and id it loads, the in-place reload flag)",
    "C.noise": "the sampler scores the synced adapter differently twice: the adapter is swapped or reloaded "
               "between requests",
    "C.moved.sampler": "the sampler did not change after the sync, so the update did not reach it: the sync "
                       "was skipped, or the sampler reused a cached adapter under the old name or id",
    "C.moved.trainer": "the trainer did not change after its update: the perturbation was not applied",
    "C.delta.cosine": "the sampler moved in another direction than the trainer: a sign flip (negated B), "
                      "transposed or swapped A/B, or a missing target module",
    "C.delta.scale": "the sampler moved by another amount than the trainer (the observed value is the scale "
                     "error |scale-1|): look at lora_alpha / r (scaling), rsLoRA, or a dropped target",
    "C.delta.rel_l2": "the sampler's change differs from the trainer's: a partial or wrong adapter reached "
                      "the sampler; see the per-target checks T.* to find which module",
    "C.slope": "the sampler makes another share of the trainer's change than 1, beyond its uncertainty (the observed "
               "value is |slope-1|, pooled over C and every target): a scale the engine applies (lora_alpha / r, "
               "rsLoRA, a cast of B) or part of the update not reaching it; the findings above say which",
    "T.": "target {target} alone does not reach the sampler as the trainer applies it: check that module's "
          "name mapping and tensors in the exported adapter",
    "D.base_kept": "the engine's base model (no adapter) scores differently after the sync than before it: the sync "
                   "touched the base weights (an adapter-only sync that repacked or reloaded them); compare the "
                   "engine's base weights before and after the sync",
    "D.base_restored": "the engine's base model (no adapter) scores differently at the end of the run, once its "
                       "checkpoint's base weights were reloaded, than at the start: the merged weights stayed (a "
                       "reset that reloaded nothing, or other weights), and whoever reuses the engine after the run "
                       "serves them; compare the engine's base weights with the checkpoint's",
    "D.old_kept": "the version the sync replaced no longer gives its own scores while the new one is live: an old "
                  "adapter's name follows the live weights, so a frozen snapshot is not frozen; check how the engine "
                  "keys its adapters (name, id, path)",
    "M.": "a route served in a batch that mixes the base model and adapter versions scores otherwise than alone: "
          "the engine applies the wrong LoRA (or none) to some requests of a mixed batch, which rollouts of several "
          "versions at once meet and batches of one route never show; the finding names whose scores they got",
    "W.": "the synced adapter scores otherwise after the engine slept and woke than before: the wake lost or "
          "corrupted LoRA state (vllm #53888, #39934), the loop reloaded the base over what the sync pushed (TRL "
          "#5312), or a level-2 sleep's discarded base was never reloaded (verl #7289, #7304); the reason says "
          "whose scores it gives; check what the loop does between sleep, sync and wake",
    "E.": "the engine does not compute what its own operations compute with the trainer's tensors (the exact "
          "reference, no noise): a wrong read of a right file, or a wrong LoRA computation; the finding above names "
          "the scale, the swap or the points",
    "S.trainer_kept": "querying an old sampling client changed the trainer's weights: the client shares state "
                      "with the trainer",
    "R.": "the fp32 reference comparison (informational)",
    "X.sync.identical": "what the sync delivered is not the trainer's: its tensors handed over again (an adapter "
                        "written by an independent writer and loaded under a new name and id; merged weights "
                        "reloaded at once) score differently on the same deterministic engine; look at the export "
                        "(dtype casts, dropped or stale tensors, lora_alpha / r in adapter_config.json), at a "
                        "bucket lost or a packed module split across buckets, and at what the engine cached under "
                        "the old name",
}

# suffix of a check id -> what its observed number is
MEASURE: dict[str, str] = {
    "parity.mean": "mean |diff|",
    "parity.p99": "p99 |diff|",
    "parity.max": "max |diff|",
    "repeat": "max |repeat diff|",
    "zero_adapter_noop": "max |diff|",
    "withheld": "max |stale-zero|",
    "stimulus": "mean |diff|",
    "moved.sampler": "mean |change|",
    "moved.trainer": "mean |change|",
    "moved": "‖Δsampler‖",
    "cosine": "cosine",
    "scale": "|scale-1|",
    "rel_l2": "rel L2",
    "kept": "max |diff|",
    "balance": "farther side's mean |diff| from fp32",
    "identical": "max |synced-fresh|",
    "slope": "|slope-1|",
    "level1": "max |diff|",
    "level2": "max |diff|",
}


def measure(check_id: str) -> str:
    """What the observed number of `check_id` is ('|scale-1|' for a scale check), or '' if unknown."""
    for suffix, label in MEASURE.items():
        if check_id.endswith(suffix):
            return label
    return ""


def meaning(check_id: str) -> str | None:
    """What a failure of `check_id` means and where to look next, or None for an id the table lacks."""
    matches = [p for p in EXPLAIN if check_id.startswith(p)]
    if not matches:
        return None
    text = EXPLAIN[max(matches, key=len)]
    target = check_rules.target_of(check_id)
    return text.format(target=target)


# prefix -> (the check whose failure causes it, the line that says so): shown instead of the meaning
CONSEQUENCES: dict[str, tuple[str, str]] = {
    "C.delta.": ("C.moved.sampler", "follows from C.moved.sampler: a sampler that did not move has no direction "
                                    "or size of change to compare"),
    "C.slope": ("C.moved.sampler", "follows from C.moved.sampler: a sampler that did not move makes none of the "
                                   "trainer's change"),
}


TAIL_ONLY = "the synced sampler moved with the trainer (direction and scale agree, the mean is within its " \
            "threshold), but a few tokens disagree beyond the tail the start point's noise predicts: a numerics " \
            "tail (low-probability tokens, bf16 rounding of a large change), not a missing sync; see the worst " \
            "positions in `lora-parity report`"
MOVED_WRONG = "the synced sampler moved, but not as the trainer did: a partial or wrong adapter reached the engine " \
              "(a dropped target, another scale or sign); see the per-target checks T.* and C.delta.*"


def _c_parity(check: CheckLike, failing: frozenset[str]) -> str | None:
    """C.parity.*'s meaning from the evidence: the stale-scores text only where the sampler did not move."""
    if not check.id.startswith("C.parity.") or "C.moved.sampler" in failing:
        return None
    if any(f.startswith("C.delta.") or f == "C.parity.mean" for f in failing):
        return MOVED_WRONG
    return TAIL_ONLY


def line(check: CheckLike, failing: frozenset[str] = frozenset()) -> str:
    """One line for a failing or inconclusive check, chosen from the evidence: an inconclusive check says
    what the noise allows (its own reason), one that compared nothing says so; where a failure only follows
    from another failing check in `failing`, that; a C parity failure says whether the sampler moved; else the
    check's meaning (or its own reason for an unknown id). Without `failing` (a lone check) the meaning is the
    prefix's."""
    status = getattr(check.status, "value", check.status)
    if status == "inconclusive":
        return f"undecided, not a failure: {check.reason}"
    if status == "not_reached" and check.elements == 0:
        return "not a failure, and no pass either: a comparison handed an empty set verifies nothing"
    for prefix, (cause, text) in CONSEQUENCES.items():
        if check.id.startswith(prefix) and cause in failing:
            return text
    if failing:
        evidence = _c_parity(check, failing)
        if evidence is not None:
            return evidence
    return meaning(check.id) or check.reason
