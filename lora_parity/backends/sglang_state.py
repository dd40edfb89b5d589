"""The SGLang engine's state beside its adapters: its weight version (issue 51), and its memory release and resume,
driven as the sleep phases drive vLLM's sleep (issue 44; docs/sglang.md, "Sleep and wake"; `backends.sleep` for the
protocol and `run.sleep_wake` for the phases).

Read in sglang 0.5.16 (srt/managers/scheduler_components/weight_updater.py, srt/model_executor/
model_runner_components/load_model_utils.py, srt/constants.py): a server started with `--enable-memory-saver`
(torch_memory_saver) gives back the GPU memory of what `/release_memory_occupation` names (tags `kv_cache`,
`weights`, `cuda_graph`; none: all three; the KV release also flushes the radix cache) and maps it again on
`/resume_memory_occupation`. The weights come back as they were only where the server keeps a copy on the CPU
(`--enable-weights-cpu-backup`): that is vLLM's level 1. Without the copy their memory comes back undefined and the
loop loads them again (`/update_weights_from_disk` with the served checkpoint): vLLM's level 2. Which of the two is
a property of the server, so one server sleeps at one level. The LoRA adapters' buffers are allocated after the
weights' region closes (`ModelRunner.init_lora_manager`), outside every region: the adapters stay through both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lora_parity.backends import served
from lora_parity.backends.sleep import KV_CACHE, WEIGHTS
from lora_parity.util.errors import ConfigError, ScoreError

SAVER, CPU_BACKUP = "--enable-memory-saver", "--enable-weights-cpu-backup"
TAGS = {WEIGHTS: ["weights"], KV_CACHE: ["kv_cache", "cuda_graph"]}
"""SGLang's memory tags for vLLM's wake-up tags (the CUDA graphs' memory wakes with the KV cache, the last to)."""
NO_SAVER = "the server runs without --enable-memory-saver (it cannot give its memory back)"


def server_flags(levels: Sequence[int]) -> list[str]:
    """The flags that let a started server sleep at `levels` (none, 1 or 2; both on one server is refused)."""
    check_levels(levels)
    if not levels:
        return []
    return [SAVER, CPU_BACKUP] if 1 in levels else [SAVER]


def check_levels(levels: Sequence[int]) -> None:
    """`ConfigError` where one server is asked for both levels: whether the weights survive a release is fixed when
    the server starts (`--enable-weights-cpu-backup`)."""
    if set(levels) >= {1, 2}:
        raise ConfigError("--sampler sglang sleeps at one level per server: level 1 keeps a CPU copy of the weights "
                          "(--enable-weights-cpu-backup), level 2 does not; run --sleep-levels 1 and --sleep-levels 2 "
                          "as two runs")


def levels_of(args: Mapping[str, Any]) -> tuple[int, ...]:
    """The level a server that reported `args` (`/server_info`) sleeps at: 1 with the CPU copy, 2 without, none
    without the memory saver."""
    if args.get("enable_memory_saver") is not True:
        return ()
    return (1,) if args.get("enable_weights_cpu_backup") is True else (2,)


class SGLangEngineState:
    """`SleepingSampler`, `BaseResettingSampler` and `WeightVersionSampler` for the SGLang sampler (a mixin: it needs
    the sampler's `_call`, `_info`, `cfg`, `server`, `api_key` and `_recorded_server_args`)."""

    if TYPE_CHECKING:
        cfg: Any
        server: Any
        api_key: str | None

        def _call(self, path: str, body: dict[str, Any] | None, label: str) -> Any: ...

        def _info(self, name: str) -> Any: ...

        def _recorded_server_args(self) -> dict[str, Any]: ...

    def weight_version(self) -> str | None:
        """`/model_info`'s weight version (`--weight-version`, moved by SGLang's weight updates that name one; a LoRA
        load leaves it); None where the server reports none."""
        try:
            answer = self._info("model_info")
        except ScoreError:  # the sampler's ServerError
            return None
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        return served.server_text(version, self.api_key) if version is not None else None

    def _sleep_unavailable(self) -> str | None:
        """Why this server cannot sleep (None: it can): a started one sleeps where the run asked for a level (it is
        started with the flags then), an attached one where it reports the memory saver."""
        return None if self.sleep_levels else NO_SAVER

    @property
    def sleep_levels(self) -> tuple[int, ...]:
        if self.server is not None:
            return tuple(sorted(set(self.cfg.sampler.sleep_levels)))
        return levels_of(self._recorded_server_args()["args"])

    def sleep(self, level: int) -> None:
        """Release the KV cache, the weights and the CUDA graphs' memory (the server must be idle: it is, between
        the run's requests)."""
        if level not in self.sleep_levels:
            raise ConfigError(f"this SGLang server sleeps at level {self.sleep_levels or 'none'}, not {level}")
        self._call("/release_memory_occupation", {}, f"release_memory_occupation.level{level}")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Map again what `tags` name (None: everything)."""
        body = {} if tags is None else {"tags": [t for tag in tags for t in TAGS[tag]]}
        self._call("/resume_memory_occupation", body, "resume_memory_occupation")

    def reset_base(self) -> None:
        """Load the served checkpoint's weights again (`/update_weights_from_disk` with the server's own model path),
        as the loop does after a level-2 wake; SGLang flushes its cache with it."""
        path = self._info("model_info").get("model_path")
        if not isinstance(path, str) or not path:
            raise ConfigError("the SGLang server reports no model_path to load its weights again from")
        self._call("/update_weights_from_disk", {"model_path": path}, "update_weights_from_disk")
