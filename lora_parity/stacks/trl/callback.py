"""`check_trl`: `lora_parity.api.check` on a GRPOTrainer through TRL's own sync and engine (`adapters`), a fault
planted in TRL's path if asked (`faults`); and `ParityCallback`, a `transformers.TrainerCallback` that runs it at a
chosen optimizer step of `trainer.train()` and writes the receipt.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from lora_parity.api import Result, check
from lora_parity.stacks.trl import adapters, faults
from lora_parity.util.errors import LoraParityError


def check_trl(trainer: Any, sequences: Sequence[Sequence[int]], *, out: Path | str | None = None,
              fault: str | None = None, model: str | None = None, sampling_params: Any = None,
              **kwargs: Any) -> Result:
    """Run the A/B/C sequence (per-target and per-layer coverage, the prefix cache where the engine has one) on
    `trainer`'s policy and TRL's engine, every adapter version moved by TRL's own sync; return the `Result` (and
    write the receipt to `out`). `fault` plants one of `faults.FAULTS` for the run (recorded in the receipt's
    sampler settings). `alpha` and `dtype` default to the policy's, `reference` (the checkpoint whose fp32 copy
    judges A by what precision explains) to the folder the policy was loaded from where it is a local one; other
    keywords go to `lora_parity.api.check`.

    Call it where no rollout is in flight (between optimizer steps): the engine is woken from TRL's sleep mode for
    the check and put back to sleep after; on return the policy holds its tensors as they were and TRL's sync has
    pushed them once more. `ConfigError` for a trainer without vLLM, PEFT or a sync the plugin knows."""
    policy = adapters.TRLPolicy(trainer)
    adapters.require_unmerged(policy)
    engine = adapters.engine_for(trainer, policy, sampling_params)
    trl_sync, _ = adapters.find_sync(trainer)
    engine.planted_fault = fault
    base = policy.snapshot_base()

    def sync() -> None:
        """TRL's sync, then the policy's base weights as they were before it: TRL's merge/unmerge round trip
        rounds them, and the check's own syncs must leave the policy as it found it (the pushed weights are TRL's)."""
        trl_sync()
        policy.base_drift = max(policy.base_drift, policy.restore_base(base))

    kwargs.setdefault("alpha", policy.alpha)
    kwargs.setdefault("dtype", policy.dtype)
    folder = base_checkpoint(policy.model)
    kwargs.setdefault("reference", folder)
    hub = str(getattr(policy.model, "name_or_path", "") or "trl-policy")
    name = model or (folder.name if folder is not None else hub)  # a local folder by its name: no path in the receipt
    with engine.awake(), faults.planted(trainer, fault):
        return check(policy, engine, sync, sequences, out=out, model=name, **kwargs)


def base_checkpoint(model: Any) -> Path | None:
    """The local folder a PEFT policy's base model was loaded from (its `name_or_path`), or None: a hub name, or
    a model built in memory."""
    name = str(getattr(model, "name_or_path", "") or "")
    return Path(name) if name and (Path(name) / "config.json").is_file() else None


class ParityFailed(LoraParityError, RuntimeError):
    """Raised by `ParityCallback(raise_on_fail=True)` when the check's verdict is not pass: its summary."""


class ParityCallback(TrainerCallback):
    """Runs `check_trl` once, at the end of optimizer step `at_step` (`on_step_end`, between TRL's rollouts), and
    writes the receipt to `out` (`{step}` in it is the step). `result` holds the `Result`; with `raise_on_fail`
    a verdict other than pass stops training with `ParityFailed`. Other keywords go to `check_trl`."""

    def __init__(self, sequences: Sequence[Sequence[int]], *, at_step: int, out: Path | str,
                 raise_on_fail: bool = False, **kwargs: Any) -> None:
        self.sequences = [list(s) for s in sequences]
        self.at_step = at_step
        self.out = str(out)
        self.raise_on_fail = raise_on_fail
        self.kwargs = kwargs
        self.trainer: Any = None
        self.result: Result | None = None

    def attach(self, trainer: Any) -> ParityCallback:
        """Register on `trainer` (`add_callback`); the hooks get no trainer of their own, so it is kept here."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step != self.at_step or self.result is not None:
            return control
        if self.trainer is None:
            raise LoraParityError("ParityCallback: attach(trainer) it, the check needs the GRPOTrainer")
        self.result = check_trl(self.trainer, self.sequences, out=self.out.format(step=state.global_step),
                                **self.kwargs)
        if self.raise_on_fail and not self.result.passed:
            raise ParityFailed(self.result.summary())
        return control
