"""A stand-in SGLang server for the `sglang` sampler's CPU tests: SGLang's native HTTP API on loopback
(`/health`, `/model_info`, `/server_info` and their deprecated `/get_` names, `/generate`, `/load_lora_adapter`,
`/load_lora_adapter_from_tensors`, `/unload_lora_adapter`, and the memory saver's `/release_memory_occupation`,
`/resume_memory_occupation` with `/update_weights_from_disk`), serving the fake model of
`lora_parity.backends.fake` with the adapters it loads from PEFT folders or tensors, so that a fake
trainer and this server agree exactly, as a correct sync does.

It behaves as SGLang's source says SGLang does (python/sglang/srt/...):
- a load under a name already loaded is refused with 400 (`lora_manager.validate_new_adapter`); a path
  already loaded under another name is loaded again, with only a warning (sgl-project/sglang#13771);
- every load mints a new `lora_id`, the radix cache's namespace (sgl-project/sglang#8261);
- a load from tensors unpickles `serialized_tensors` (base64) admitting torch's and collections' classes only
  (`utils.common.SafeUnpickler`), checks `expected_checksums` against each tensor's bytes and records the
  path `__tensor__` (`io_struct.LoadLoRAAdapterFromTensorsReqInput`, `managers/tp_worker.py`);
- unloading a name it does not have is 400, "does not exist" (`lora_registry.unregister`);
- a request naming an adapter it unloaded loads it again from the path it was loaded from, as it reads
  now (`TokenizerManager.lora_ref_cache`, `_resolve_lora_path`: "Reloading evicted adapter"; seen on the
  H200); one loaded from tensors (path `__tensor__`) cannot be, and one never loaded neither: 400;
- an adapter whose layer has k_proj or v_proj but no q_proj, or up_proj but no gate_proj, is loaded with
  200, and the first request that uses it kills the server (`lora/lora.py` leaves them unstacked, then
  `mem_pool.load_lora_weight_to_buffer` raises in the scheduler; seen on the H200 with sglang 0.5.16):
  as a process it exits with code 1, on a thread it stops answering;
- `input_token_logprobs` has one `[logprob, token_id, text]` per input token from `logprob_start_len`,
  the first null, ids >= vocab_size - 1 reported as 0; `token_ids_logprob` answers in
  `output_token_ids_logprobs[0]`, the position after the prompt; a request whose logprobs start
  after 0 may read the radix cache for the prefix before that start.

`StandIn` runs it on a thread in the test's process; `python tests/sglang_server.py PORT` runs it as
a process, as lora-parity would start SGLang's.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import pickle
import random
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

from lora_parity.backends import fake
from lora_parity.backends.sleep import LOST_LOGPROB
from lora_parity.models import adapter_files as af
from lora_parity.models import config, lora_targets

_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float64": "F64"}


def send_json(h: http.server.BaseHTTPRequestHandler, status: int, body: Any) -> bool:
    """Answer `body` as JSON with `status` (True: answered, as an override returns)."""
    data = json.dumps(body).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)
    return True


class _SafeUnpickler(pickle.Unpickler):
    """SGLang's `SafeUnpickler`, narrowed to what a tensor dict needs: torch's and collections' classes."""

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] in ("torch", "collections") or (module, name) == ("builtins", "dict"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed")


Override = Callable[[http.server.BaseHTTPRequestHandler, dict[str, Any]], bool]
"""Answers a request in the test's way and returns True, or returns False to let the stand-in answer."""


class StandIn:
    """The stand-in server on 127.0.0.1 (a free port unless given), on a thread; `requests` records
    (method, path, headers, JSON body) of each request, `warnings` what SGLang would log."""

    def __init__(self, kinds: list[str] | None = None, vocab_size: int = 512, port: int = 0,
                 server_args: dict[str, Any] | None = None) -> None:
        self.kinds = kinds or list(config.load(None).adapter.targets)
        self.vocab_size = vocab_size
        self.requests: list[tuple[str, str, dict[str, str], dict[str, Any]]] = []
        self.warnings: list[str] = []
        self.registry: dict[str, tuple[str, str, dict[str, float]]] = {}
        """name -> (lora_id, path, the fake model's coefficients)."""
        self.cache: dict[tuple[str, tuple[int, ...]], dict[str, float]] = {}
        """(lora_id or '', prefix) -> the coefficients its KV was computed with (the radix cache)."""
        self.overrides: dict[str, Override] = {}
        self.ref_cache: dict[str, str] = {}
        """Every name loaded, with its path (kept after an unload, as SGLang's `lora_ref_cache`)."""
        self.unstacked: dict[str, str] = {}
        """Loaded names SGLang would fail to serve -> the tensor its scheduler would name."""
        self.die: Callable[[], None] = lambda: threading.Thread(target=self.close, daemon=True).start()
        """What the first request with such an adapter does: stop answering (as a process: exit)."""
        self.server_args = {"version": "0.5.16-standin", "enable_deterministic_inference": True,
                            "attention_backend": "fa3", "disable_radix_cache": False, "api_key": None,
                            "enable_memory_saver": False, "enable_weights_cpu_backup": False,
                            **(server_args or {})}
        self.released: set[str] = set()
        """Memory tags released (`/release_memory_occupation`) and not yet resumed."""
        self.weights_lost = False
        """The weights came back without a CPU copy and nothing loaded them since (`/update_weights_from_disk`)."""
        self.lock = threading.Lock()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                stand_in.requests.append((self.command, self.path, dict(self.headers), body))
                override = stand_in.overrides.get(self.path)
                if override is not None and override(self, body):
                    return
                send_json(self, *stand_in.answer(self.command, self.path, body))

            do_GET = do_POST = _any

            def log_message(self, *args: object) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            request_queue_size = 128  # uvicorn's backlog is larger still: 32 requests in flight never reset

        self.server = Server(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def posted(self, path: str) -> list[dict[str, Any]]:
        """The JSON bodies POSTed to `path`, in order."""
        return [body for method, p, _, body in self.requests if method == "POST" and p == path]

    def answer(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """SGLang's status and JSON answer to a request."""
        if method == "GET" and path == "/health":
            return 200, {}
        if method == "GET" and path in ("/model_info", "/get_model_info"):
            return 200, {"model_path": "/models/tiny-qwen3", "is_generation": True,
                         "weight_version": self.server_args.get("weight_version", "default")}
        if method == "GET" and path in ("/server_info", "/get_server_info"):
            return 200, dict(self.server_args)
        with self.lock:
            if path in ("/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk"):
                return self._memory(path, body)
            if path == "/load_lora_adapter":
                return self._load(body)
            if path == "/load_lora_adapter_from_tensors":
                return self._load_tensors(body)
            if path == "/unload_lora_adapter":
                name = body.get("lora_name")
                if name not in self.registry:
                    return 400, {"success": False, "error_message": f"LoRA with name {name} does not exist. "
                                                                    f"Loaded LoRAs: {list(self.registry)}"}
                del self.registry[name]
                return 200, {"success": True, "loaded_adapters": self._loaded()}
            if path == "/generate":
                return self._generate(body)
        return 404, {"detail": "Not Found"}

    def _note_unstacked(self, name: str, tensors: list[str]) -> None:
        """Remember an adapter SGLang would leave unstacked (k/v without q, up without gate)."""
        unpaired = lora_targets.unpaired_target(tensors, (("k_proj", "q_proj"), ("v_proj", "q_proj"),
                                                          ("up_proj", "gate_proj")))
        if unpaired is not None:
            path, kind, _ = unpaired
            self.unstacked[name] = f"{path}.{kind}.lora_A.weight"

    def _loaded(self) -> dict[str, str]:
        return {name: entry[1] for name, entry in self.registry.items()}

    def _load(self, body: dict[str, Any]) -> tuple[int, Any]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if name in self.registry:
            return 400, {"success": False, "error_message": f"Failed to load LoRA adapter {name} because it is "
                                                            "already loaded", "loaded_adapters": self._loaded()}
        for other, (_, other_path, _) in self.registry.items():
            if other_path == path:
                self.warnings.append(f"{path} is already loaded with name: {other}, but another copy is being "
                                     f"loaded with name: {name}")
        cfg, tensors = af.read_adapter(path)
        self._note_unstacked(str(name), list(tensors))
        self.registry[str(name)] = (uuid.uuid4().hex, str(path), fake._coefficients(cfg, tensors))
        self.ref_cache[str(name)] = str(path)
        return 200, {"success": True, "loaded_adapters": self._loaded()}

    def _load_tensors(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = body.get("lora_name")
        if name in self.registry:
            return 400, {"success": False, "error_message": f"Failed to load LoRA adapter {name} because it is "
                                                            "already loaded", "loaded_adapters": self._loaded()}
        try:
            tensors = _SafeUnpickler(io.BytesIO(base64.b64decode(body["serialized_tensors"], validate=True))).load()
        except Exception as e:  # SGLang answers a payload it cannot read with an error
            return 400, {"success": False, "error_message": f"cannot deserialize the tensors: {e}"}
        import torch

        raw = {k: af.Tensor(_DTYPES[str(t.dtype)], list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
               for k, t in tensors.items()}
        expected = body.get("expected_checksums")
        if expected is not None:
            bad = sorted(k for k in set(expected) | set(raw)
                         if k not in raw or hashlib.sha256(raw[k].data).hexdigest() != expected.get(k))
            if bad:
                return 500, {"success": False, "error_message": f"[LORA-CHECK] adapter sync MISMATCH: {bad[:5]}"}
        self._note_unstacked(str(name), list(raw))
        self.registry[str(name)] = (uuid.uuid4().hex, "__tensor__", fake._coefficients(body["config_dict"], raw))
        self.ref_cache[str(name)] = "__tensor__"
        return 200, {"success": True, "loaded_adapters": self._loaded()}

    def _memory(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """SGLang's memory saver: without `--enable-memory-saver` a release frees nothing (a no-op); with it, the
        released tags hold nothing until resumed, a KV release flushes the radix cache, and weights released without
        a CPU copy come back undefined until `/update_weights_from_disk` loads them (the adapters' buffers stay)."""
        if path == "/update_weights_from_disk":
            self.weights_lost, self.cache = False, {}
            return 200, {"success": True, "message": "Succeeded to update model weights."}
        tags = set(body.get("tags") or ["kv_cache", "weights", "cuda_graph"])
        if not self.server_args["enable_memory_saver"]:
            return 200, {}
        if path == "/release_memory_occupation":
            self.released |= tags
            self.cache = {} if "kv_cache" in tags else self.cache
        else:
            if "weights" in tags & self.released and not self.server_args["enable_weights_cpu_backup"]:
                self.weights_lost = True
            self.released -= tags
        return 200, {}

    def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.released:  # SGLang serves nothing from released memory
            return 500, {"error": {"message": f"memory released: {sorted(self.released)}"}}
        ids = body["input_ids"]
        single = isinstance(ids[0], int)
        batch = [ids] if single else ids
        names = body.get("lora_path")
        names = [names] * len(batch) if single or not isinstance(names, list) else names
        for name in dict.fromkeys(n for n in names if n is not None and n not in self.registry):
            if name not in self.ref_cache:
                return 400, {"error": {"message": f"Got LoRA adapter that has never been loaded: {name}"}}
            if self.ref_cache[name] == "__tensor__":
                return 400, {"error": {"message": f"Failed to implicitly load LoRA adapter {name}: cannot read "
                                                  "__tensor__"}}
            self.warnings.append(f"Reloading evicted adapter: {name}")
            self._load({"lora_name": name, "lora_path": self.ref_cache[name]})
        fatal = next((self.unstacked[n] for n in names if n in self.unstacked), None)
        if fatal is not None:
            print(f"Scheduler hit an exception: ValueError: Cannot find target module name for {fatal}", flush=True)
            self.die()
            return 500, {}
        out = [self._one(list(seq), self.registry[n] if n is not None else None, body)
               for seq, n in zip(batch, names, strict=True)]
        return 200, out[0] if single else out

    def _one(self, seq: list[int], adapter: tuple[str, str, dict[str, float]] | None,
             body: dict[str, Any]) -> dict[str, Any]:
        lora_id, coefficients = (adapter[0], adapter[2]) if adapter else ("", {})
        sampling = body.get("sampling_params") or {}
        start = body.get("logprob_start_len", -1)
        start = len(seq) - 1 if start is None or start < 0 else start
        if start > 0:  # the prefix before the start may be served from the radix cache
            coefficients = self.cache.setdefault((lora_id, tuple(seq[:start])), coefficients)
        meta: dict[str, Any] = {"prompt_tokens": len(seq)}
        if body.get("return_logprob"):
            row = fake._score([seq], coefficients, self.kinds)[0]
            row = [LOST_LOGPROB] * len(row) if self.weights_lost else row
            meta["input_token_logprobs"] = [[None if t == start else row[t - 1], self._clip(seq[t]), None]
                                            for t in range(start, len(seq))]
            if body.get("token_ids_logprob"):
                meta["output_token_ids_logprobs"] = [[[self._logprob(seq[-1], tok, len(seq) - 1, coefficients), tok,
                                                       None] for tok in body["token_ids_logprob"]]]
        rng = random.Random(sampling.get("sampling_seed", 0))
        full, output = list(seq), []
        for _ in range(sampling.get("max_new_tokens", 128)):
            tok = (fake._sample(full[-1], len(full) - 1, coefficients, self.kinds, rng)
                   if sampling.get("temperature", 1.0) > 0 else 0)
            output.append([self._logprob(full[-1], tok, len(full) - 1, coefficients), tok, None])
            full.append(tok)
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = output
        return {"output_ids": [tok for _, tok, _ in output], "meta_info": meta}

    def _logprob(self, prev: int, tok: int, t: int, coefficients: dict[str, float]) -> float:
        """The fake model's logprob of `tok` after `prev` at position t, as its scores have it (at most 0)."""
        return LOST_LOGPROB if self.weights_lost else min(fake._score_at(prev, tok, t, coefficients, self.kinds), 0.0)

    def _clip(self, token: int) -> int:
        return token if token < self.vocab_size - 1 else 0


def main(argv: list[str]) -> None:
    """`python tests/sglang_server.py PORT`: serve on PORT until killed."""
    server = StandIn(port=int(argv[0]))
    server.die = lambda: os._exit(1)
    server.thread.join()


if __name__ == "__main__":
    main(sys.argv[1:])
