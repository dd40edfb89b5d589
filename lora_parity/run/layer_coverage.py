"""Per-layer coverage (docs/verdicts.md, "Per-layer coverage"): after per-target coverage, each target kind is
perturbed again in one group of `GROUP_LAYERS` decoder layers alone (its own calibrated stimulus), synced and
scored on both sides (`target.K@A-B.*`). A layer whose update does not reach the engine (a target module the engine
ignores in one layer, an export that drops late layers) is then a third of the phase's change instead of a
thirtieth of the target's, and its group's slope (T.K@A-B.slope) fails and names it.

Where the exact reference ran (`verdict.exact_reference`) and the engine equals it bit for bit at the start point
and at a target's own point, that target reaches the engine exactly in every layer, at any size: it gets no layer
groups (a clean run on such an engine has none). A target that parts from the reference gets them, and each group's
own exact reference (E.target.K@A-B) names the layers; where every target parts, only the first gets them (enough
to tell a fault in some layers from one in all)."""

from __future__ import annotations

from typing import Protocol

from lora_parity.backends.base import LayerSubsetTrainer, Trainer


class Run(Protocol):
    """What per-layer coverage reads of `phases.Run` and the step it runs."""

    trainer: Trainer
    per_layer: bool
    scores: dict[str, list[list[float]]]

    @property
    def steps(self) -> bool: ...

    @property
    def covered_targets(self) -> list[str]: ...

    def target_coverage(self, kind: str, tag: str | None = None) -> None: ...

GROUP_LAYERS = 3
"""Layers per group: a dropped layer is about 1/3 of its group's change, against a per-phase slope uncertainty
of 0.01-0.035 measured on the CPU (SmolLM2-135M bf16; with groups of 4 a dropped layer's group was at
0.796 ± 0.035, 1.01x its threshold)."""


def groups(layers: list[int], size: int = GROUP_LAYERS) -> list[list[int]]:
    """`layers` in contiguous groups of `size` or `size` − 1 (as even as the count allows); none for a model
    of at most `size` layers (its per-target run already covers every layer at that size)."""
    if len(layers) <= size:
        return []
    count = -(-len(layers) // size)
    base, extra = divmod(len(layers), count)
    out, i = [], 0
    for g in range(count):
        n = base + (1 if g < extra else 0)
        out.append(layers[i:i + n])
        i += n
    return out


def tag(kind: str, group: list[int]) -> str:
    """The per-target tag of target `kind` in layer `group`: `down_proj@12-15`."""
    return f"{kind}@{group[0]}-{group[-1]}"


def groups_of(run: Run) -> list[tuple[str, list[int]]]:
    """(kind, layers) of every per-layer run: each covered target in each group; none where per-layer coverage
    is off, per-target coverage did not run, the update is an optimizer step (it moves A too, in every layer), or
    the trainer cannot restrict its update to some layers."""
    trainer = run.trainer
    if not run.per_layer or run.steps or not isinstance(trainer, LayerSubsetTrainer):
        return []
    layer_groups = groups(trainer.layers())
    kinds = [kind for kind in run.covered_targets if not exactly_reached(run, kind)]
    if mirrored(run) and len(kinds) == len(run.covered_targets) > 1:
        kinds = kinds[:1]  # every target parts from the reference: one target's groups tell one layer from all
    return [(kind, group) for kind in kinds for group in layer_groups]


def mirrored(run: Run) -> bool:
    """The exact reference ran and the engine equals it bit for bit at the start point."""
    return "exact.zero" in run.scores and run.scores.get("zero") == run.scores["exact.zero"]


def exactly_reached(run: Run, kind: str) -> bool:
    """The engine equals the exact reference bit for bit at the start point and at target `kind`'s own point."""
    s = run.scores
    pairs = [("zero", "exact.zero"), (f"target.{kind}.sampler", f"exact.target.{kind}")]
    return all(a in s and b in s and s[a] == s[b] for a, b in pairs)


def cover(run: Run, kind: str, group: list[int]) -> None:
    """Target `kind`'s coverage run with the trainer's update restricted to `group`."""
    trainer = run.trainer
    assert isinstance(trainer, LayerSubsetTrainer)
    with trainer.restricted_to(group):
        run.target_coverage(kind, tag(kind, group))
