"""Every phase name `run_sequence` may step through, for checking a crash fault's phase before anything loads."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from lora_parity.models.config import ModelConfig
from lora_parity.run.phases import run_sequence

SLEEPS_AND_RELOADS = ("sleep", "wake_up", "reload_base", "reset_base")
"""What a sampler that sleeps at level 2 does (`SleepingSampler`, `BaseResettingSampler`)."""


class _PhaseLister:
    """Stands in for a `Run` to list the phase names `run_sequence` can step through: every optional
    phase is taken (unknown attributes read as a callable, which is true), and no action runs."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg, self.names = cfg, list[str]()
        self.covered_targets = cfg.adapter.kinds
        # A sync mode with LoRA that kept the replaced version, and one that reloads the base weights, which the
        # run's last phases restore: no run is both, the list has the phases of either (`engine_state`).
        self.mode, self.kept = SimpleNamespace(sampler_lora=True, reloads_base=True), SimpleNamespace(adapter_id=1)
        self.start_adapter = False  # the restore is not scored where a sampled run's base carries a start adapter
        self.replay = SimpleNamespace(on=False)  # route replay moves trainer_updated after updated: the same names
        # A sampler that sleeps at both levels: the sleep phases are those of the levels the config asks for.
        self.sampler = SimpleNamespace(traits=SimpleNamespace(sleep_unavailable=None), sleep_levels=(1, 2),
                                       **{name: self.__getattr__(name) for name in SLEEPS_AND_RELOADS})

    def step(self, name: str, action: Callable[[], object]) -> None:
        self.names.append(name)

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None


def phase_names(cfg: ModelConfig) -> list[str]:
    """Every phase `run_sequence` may run for `cfg`, in order (optional phases included)."""
    lister = _PhaseLister(cfg)
    run_sequence(lister)  # type: ignore[arg-type]
    return lister.names
