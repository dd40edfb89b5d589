"""The engine's state after a sync (issue 51, "Delivery, complete"; docs/verdicts.md, "The engine after the sync"):
its base route scored again after the sync (`base_after_sync`) and after per-target coverage
(`base_after_coverage`), which must give the first base scores (a sync that changes the base model); and, where
each version has a name and id of its own (`SyncMode.keeps_versions`), the version the sync replaced scored again
once the new one is live (`old_after_sync`), which must give the stale scores (an old name that serves the new
weights). In the merged modes, whose sync reloads the base weights, the run ends by giving the sampler its
checkpoint's base weights back and scoring the base route once more (`base_after_restore`): the engine a user reuses
after the run must give the first base scores again. Checks: `verdict.engine_state`. Then `retire` leaves the sampler
as the run found it. And the synced adapter file against the trainer's tensors (`compare_file`: a wrong export, or
the engine's side); in the merged modes, X's fresh load is the merged weights handed over again at once
(`merged_fresh`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from lora_parity.backends.base import AdapterHandle, MergingTrainer, Sampler, TensorReadingTrainer
from lora_parity.evidence.receipt import AdapterVersion
from lora_parity.models import export_check, fresh_adapter
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.run import mixed_batch, sleep_wake
from lora_parity.util.errors import LoraParityError


class Run(Protocol):
    """What these steps read of `phases.Run`."""

    sampler: Sampler
    handle: AdapterHandle | None
    kept: AdapterHandle | None
    mode: Any
    faults: Any
    cfg: Any
    adapters: list[AdapterVersion]
    error: str | None
    sampled: bool
    start_adapter: bool

    @property
    def sampler_scores_base(self) -> bool: ...

    @property
    def sampler_shares_trainer_state(self) -> bool: ...

    @property
    def mixes_batches(self) -> bool: ...

    def step(self, name: str, action: Any) -> None: ...

    def sampler_score(self, key: str, handle: AdapterHandle | None, repeat: bool = False) -> None: ...


def after_sync(run: Run) -> None:
    """The base route again, the routes mixed in one batch (`mixed_batch`), then the replaced version again (where
    the mode keeps it)."""
    if run.sampler_scores_base and run.mode.sampler_lora:
        run.step("base_after_sync", lambda: run.sampler_score("base_after_sync", None))
    if run.mixes_batches:  # while the replaced version is still loaded
        run.step("mixed_batch", lambda: mixed_batch.score(run))
    if _keeps_old(run):
        run.step("old_after_sync", lambda: _old_after_sync(run))


def after_coverage(run: Run, covered: bool) -> None:
    """The base route again after per-target coverage (where it ran)."""
    if covered and run.sampler_scores_base and run.mode.sampler_lora:
        run.step("base_after_coverage", lambda: run.sampler_score("base_after_coverage", None))


def after_run(run: Run) -> None:
    """The merged modes' last phases: the sampler's own base weights back, the way `retire` gives them back
    (`restore_base`), then the base route scored again (`base_after_restore`)."""
    if restores_base(run):
        run.step("restore_base", lambda: run.mode.restore_base(run))
        run.step("base_after_restore", lambda: run.sampler_score("base_after_restore", None))


def restores_base(run: Run) -> bool:
    """The sync reloaded the sampler's base weights (`SyncMode.reloads_base`), the sampler serves its base model, and
    the first base scores are its checkpoint's: with `--probes sampled` they are taken once version 0 is published,
    which in a merged mode carries the start adapter (`--adapter`, or the warm start of `--update step`)."""
    return bool(run.sampler_scores_base and run.mode.reloads_base and not (run.sampled and run.start_adapter))


def retire(run: Run) -> None:
    """Unload what this run left on the sampler (the replaced version where it is still kept, the adapter); in the
    merged modes, or after a fault that lost them in a sleep (`sleep_wake.retire`), give the sampler its checkpoint's
    base weights back where `after_run` did not. A failure here after
    the run failed (a server that died in a phase refuses the unload too) follows the run's own error instead of
    replacing it."""
    try:
        retire_old(run)
        sleep_wake.retire(run)
        run.mode.retire(run)
    except LoraParityError:
        if run.error is None:
            raise
        run.error += " (unloading its adapter failed too)"


def _keeps_old(run: Run) -> bool:
    """The sync kept the version it replaced (the mode's own publish did: a fault's sync may have retired it)."""
    return run.kept is not None


def _old_after_sync(run: Run) -> None:
    """The replaced version, scored while the new one is live, then retired."""
    old = run.kept
    assert old is not None
    run.sampler_score("old_after_sync", run.faults.old_handle(old, run.handle))
    retire_old(run)


def retire_old(run: Run) -> None:
    """Unload the replaced version where the sync kept it (also when the run stopped before `old_after_sync`)."""
    if run.kept is not None:
        old, run.kept = run.kept, None
        run.sampler.retire(old)


def compare_file(run: Run, tensors: Mapping[str, RawTensor]) -> None:
    """The synced version's adapter folder (version 1, where the sync published one), read by lora-parity, against
    the trainer's tensors `tensors`: what differs goes to that version's record (`export_check`)."""
    synced = next((i for i, a in enumerate(run.adapters) if a.version == 1), None)
    handle = run.handle
    if synced is None or handle is None or handle.adapter_id != run.adapters[synced].adapter_id \
            or not handle.path.is_dir():
        return
    spec = run.cfg.adapter
    differs = export_check.differences(handle.path, tensors, spec.rank, spec.alpha)
    run.adapters[synced] = run.adapters[synced].model_copy(update={"file_differences": differs})


def fresh(run: Any, id_offset: int) -> None:
    """The trainer's current tensors of `phases.Run` `run`, written by `fresh_adapter` (not the exporter), loaded on
    the sampler under a name and id of their own (`id_offset` above the run's), scored, retired; the synced file
    compared with the same tensors (`compare_file`). Handed no tensors, it loads nothing and records fresh empty."""
    assert isinstance(run.trainer, TensorReadingTrainer)
    spec, tensors = run.cfg.adapter, run.faults.handed_tensors(run.trainer.lora_tensors())
    compare_file(run, tensors)
    if not tensors:  # an adapter of no tensors is not the trainer's: X compared nothing (`checks.handed_nothing`)
        run.scores["fresh"] = []
        return
    folder = fresh_adapter.write(run.workdir / "fresh", tensors, spec.rank, spec.alpha, spec.targets,
                                 spec.target_parameters)
    adapter_id = run.first_adapter_id + id_offset
    handle = run.sampler.publish(folder, f"lora-parity-fresh-{adapter_id}", adapter_id)
    try:
        run._record("fresh", run.faults.sampler_scores(
            run._timed("fresh", lambda: run.sampler.score(run.sequences, handle))))
    finally:
        run.sampler.retire(handle)


def merged_fresh(run: Any) -> None:
    """X in the merged modes (`phases.Run` `run`): the trainer's current merged weights handed over again at once
    (`memory`: its tensors; `merged`: a folder exported anew), scored as the base route, must score as the synced
    weights did (`updated`), bit for bit, where the engine repeats itself exactly: a bucket lost or split, a stale
    folder or copy. Run after the sleep phases, before per-target coverage republishes; the sampler keeps these
    weights (the same, where the sync was right)."""
    if not (run.mode.reloads_base and isinstance(run.trainer, MergingTrainer)):
        return

    def reload_and_score() -> None:
        sampler, trainer = run.sampler, run.trainer
        if run.mode.name == "memory":
            sampler.reload_base(tensors=trainer.merged_tensors())
        else:
            sampler.reload_base(folder=trainer.export_merged(run.workdir / "merged-fresh"))
        run.base_restored = False
        run._record("fresh", run.faults.sampler_scores(
            run._timed("fresh", lambda: run.sampler.score(run.sequences, None))))

    run.step("fresh", reload_and_score)
