"""The vLLM server's engine state beside its adapters, over vLLM's development endpoints (a server run with
`VLLM_SERVER_DEV_MODE=1`): its weight version (`/weight_info`), and sleep and wake as the sleep phases drive the
in-process engine (issue 44; docs/deployment.md, "Sleep and wake"; `backends.sleep` for the protocol and
`run.sleep_wake` for the phases).

Read in vLLM 0.26 (entrypoints/openai/api_server.py) and 0.32 (entrypoints/serve/dev/): `POST /sleep?level=N`,
`POST /wake_up?tags=weights&tags=kv_cache` (no tag: everything), `GET /is_sleeping` ({"is_sleeping": bool}),
`POST /reset_prefix_cache`, and `POST /collective_rpc` with {"method", "args", "kwargs"}, which calls a worker method
by its name with strings only: no callable crosses. Without dev mode none of them exists (404). Sleep also needs the
engine started with `enable_sleep_mode` (the user's engine argument, never set here) on a platform that has a sleep
mode (vLLM-CPU has none).

After a level-2 wake the loop reloads the base weights from the server's own checkpoint (`/v1/models`' `root`). With
LoRA on, vLLM 0.26's `reload_weights` fails (vllm #39934); the in-process sampler's way round it passes a function
(`vllm_reload.reload_from_folder`), which HTTP cannot, so a server started here to sleep gets
`vllm_reload.WorkerExtension` (`--worker-extension-cls`) and the loop calls that way by its method's name. An attached
server, or one started with a worker extension of the user's, gets vLLM's own `reload_weights` (on 0.26 with LoRA on
it fails: an error receipt, never a silent pass)."""

from __future__ import annotations

import itertools
import urllib.parse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lora_parity.backends import served, sleep
from lora_parity.models.config import ModelConfig
from lora_parity.util.errors import ScoreError

DEV_MODE = "VLLM_SERVER_DEV_MODE"
EXTENSION_FLAG, EXTENSION = "--worker-extension-cls", "lora_parity.backends.vllm_reload.WorkerExtension"
RELOAD_METHOD = "lora_parity_reload_from_folder"
"""`WorkerExtension`'s method: `vllm_reload.reload_from_folder` on each worker, by name."""
NO_DEV_MODE = "the server runs without VLLM_SERVER_DEV_MODE=1 (no /sleep, /wake_up)"
NOT_ASKED = ("no sleep level was asked (--sleep-levels), so the server was neither started with nor asked for its "
             "dev mode (VLLM_SERVER_DEV_MODE=1)")
UNFIXED_RELOAD = "vLLM 0.26's reload_weights fails with LoRA on (vllm #39934)"


def sleeps(cfg: ModelConfig, cuda: bool) -> bool:
    """Whether a server started here for `cfg` is set up to sleep: sleep levels asked, on CUDA (vLLM-CPU has no sleep
    mode, and its server is left as it was)."""
    return cuda and bool(cfg.sampler.sleep_levels)


def server_flags(cfg: ModelConfig, cuda: bool, argv: Sequence[str]) -> list[str]:
    """The flags a server started here to sleep gets beside `argv`: lora-parity's worker extension, unless `argv`
    already names one (the user's, through LORA_PARITY_VLLM_SERVER_ARGS: theirs stays, and the base is reloaded with
    vLLM's own `reload_weights`)."""
    if not sleeps(cfg, cuda) or any(a == EXTENSION_FLAG or a.startswith(EXTENSION_FLAG + "=") for a in argv):
        return []
    return [EXTENSION_FLAG, EXTENSION]


def server_env(cfg: ModelConfig, cuda: bool) -> dict[str, str]:
    """The environment a server started here to sleep, or to have its prefix cache reset as the user's loop does
    (`--loop reset_prefix_cache=true`), gets: dev mode, which serves those endpoints (only then: they also expose
    `/collective_rpc`)."""
    return {DEV_MODE: "1"} if sleeps(cfg, cuda) or cfg.sampler.loop.reset_prefix_cache else {}


class VLLMServerEngineState:
    """`SleepingSampler`, `BaseResettingSampler` and the weight version for the vllm-server sampler (a mixin: it needs
    the sampler's `_call`, `cfg`, `cuda`, `server`, `api_key` and `traits`)."""

    if TYPE_CHECKING:
        cfg: ModelConfig
        cuda: bool
        server: Any
        api_key: str | None
        traits: Any

        def _call(self, path: str, body: dict[str, Any] | None, label: str) -> Any: ...

    def weight_version(self) -> str | None:
        """`GET /weight_info`'s weight version (dev mode); None where the server has no such route or answers
        something else."""
        try:
            answer = self._call("/weight_info", None, "weight_info")
        except ScoreError:  # the sampler's ServerError
            return None
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        return served.server_text(version, self.api_key).replace("`", "'") if version is not None else None

    def _sleep_unavailable(self) -> str | None:
        """Why this server cannot sleep (None: it can): one started here sleeps on CUDA where the run asked for a
        level (it is started with dev mode then, and preflight refused it without the user's enable_sleep_mode); an
        attached one where its `/is_sleeping` answers (dev mode on), asked only where a level is asked."""
        if self.server is not None and not self.cuda:
            return sleep.VLLM_CPU
        if not self.cfg.sampler.sleep_levels:
            return NOT_ASKED
        if self.server is not None:
            return None if self.cfg.sampler.engine_args.get("enable_sleep_mode") is True else sleep.NOT_STARTED
        try:
            answer = self._call("/is_sleeping", None, "is_sleeping")
        except ScoreError:  # 404 without dev mode
            return NO_DEV_MODE
        return None if isinstance(answer, dict) and isinstance(answer.get("is_sleeping"), bool) else NO_DEV_MODE

    @property
    def sleep_levels(self) -> tuple[int, ...]:
        """Levels 1 and 2 where the server can sleep (`_sleep_unavailable`), else none."""
        return sleep.LEVELS if self.traits.sleep_unavailable is None else ()

    def sleep(self, level: int) -> None:
        """`POST /sleep?level=N`: level 1 offloads the weights to the CPU, level 2 discards them; both discard the KV
        cache and clear the prefix cache (`backends.sleep`)."""
        self._call(f"/sleep?level={int(level)}", {}, f"sleep.level{int(level)}")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """`POST /wake_up` with a `tags` query parameter per tag ("weights", "kv_cache"; none: everything)."""
        query = "" if tags is None else "?" + urllib.parse.urlencode([("tags", tag) for tag in tags])
        self._call(f"/wake_up{query}", {}, "wake_up")

    def reset_base(self) -> None:
        """Reload the served checkpoint's weights on every worker (`/collective_rpc`, `_reload_route`), then clear
        the prefix cache, as the in-process sampler does: blocks computed before hold the old weights' KV."""
        models = self._call("/v1/models", None, "models")
        data = models.get("data") if isinstance(models, dict) else None
        root = data[0].get("root") if isinstance(data, list) and data and isinstance(data[0], dict) else None
        if not isinstance(root, str) or not root:
            raise ScoreError("vLLM server: /v1/models reports no root (the checkpoint path) to reload the base from")
        if self._extension():
            body: dict[str, Any] = {"method": RELOAD_METHOD, "args": [root], "kwargs": {}}
        else:
            body = {"method": "reload_weights", "args": [], "kwargs": {"weights_path": root}}
        self._call("/collective_rpc", body, f"collective_rpc.{body['method']}")
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """`POST /reset_prefix_cache`: after a base reload, and as the user's loop does after a sync (`run.loop`)."""
        try:
            self._call("/reset_prefix_cache", {}, "reset_prefix_cache")
        except ScoreError as e:
            if " answered 404" in str(e):
                raise ScoreError("vLLM server: /reset_prefix_cache is not served (the server runs without "
                                 f"{DEV_MODE}=1): the loop's reset after the sync cannot be made") from None
            raise

    def _extension(self) -> bool:
        """Whether the server was started here with lora-parity's worker extension (`server_flags`)."""
        argv = list(self.server.argv) if self.server is not None else []
        return any(a == EXTENSION_FLAG and b == EXTENSION for a, b in itertools.pairwise(argv))

    def _sleep_settings(self) -> dict[str, str]:
        """The receipt's words: `sleep_mode` (`verdict.lifecycle` reads it) and, where it sleeps, how the base is
        reloaded after a level-2 wake."""
        why = self.traits.sleep_unavailable
        out = {"sleep_mode": sleep.setting(why, sleep.LEVELS)}
        if why is None and self._extension():
            out["base_reload"] = (f"/collective_rpc {RELOAD_METHOD} ({EXTENSION_FLAG} {EXTENSION}: reload_weights "
                                  "with the checkpoint's names reconciled to the LoRA-wrapped layers where the engine "
                                  "needs it)")
        elif why is None:
            whose = "a worker extension of the user's" if self.server is not None else "an attached server"
            out["base_reload"] = f"/collective_rpc reload_weights ({whose}; {UNFIXED_RELOAD})"
        return out
