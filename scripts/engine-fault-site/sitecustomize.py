"""A fault planted outside lora-parity, in the adapter as the engine reads it (gpu-evidence.sh `pseeds`, ARG
@fault=SPEC): on PYTHONPATH, it wraps safetensors' `safe_open` for every `adapter_model.safetensors` read once
vLLM is imported (every engine load, lora-parity's own fresh load for X too, so only C and T can see it).

    ENGINE_FAULT=scale:0.9           every lora_B times 0.9
    ENGINE_FAULT=layer:down_proj     the middle layer's down_proj lora_B zeroed (layer:MODULE:INDEX for another)
"""

import os
import re
import sys

FAULT = os.environ.get("ENGINE_FAULT", "")


def _layer_of(name):
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def corrupt(tensors):
    kind, _, arg = FAULT.partition(":")
    layers = sorted({i for i in map(_layer_of, tensors) if i is not None})
    module, _, index = arg.partition(":")
    at = int(index) if index else (layers[len(layers) // 2] if layers else -1)
    out = {}
    for name, value in tensors.items():
        if kind == "scale" and "lora_B" in name:
            value = (value.float() * float(arg)).to(value.dtype)
        elif kind == "layer" and f"{module}.lora_B" in name and _layer_of(name) == at:
            value = value * 0
        out[name] = value
    return out


if FAULT:
    import safetensors

    _open = safetensors.safe_open

    class _Read:
        def __init__(self, path, framework, *args, **kwargs):
            with _open(path, framework, *args, **kwargs) as f:
                self._tensors = corrupt({n: f.get_tensor(n) for n in f.keys()})
                self._metadata = f.metadata()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return list(self._tensors)

        def get_tensor(self, name):
            return self._tensors[name]

        def metadata(self):
            return self._metadata

    def safe_open(path, framework="pt", *args, **kwargs):
        if str(path).endswith("adapter_model.safetensors") and "vllm" in sys.modules:
            return _Read(path, framework, *args, **kwargs)
        return _open(path, framework, *args, **kwargs)

    safetensors.safe_open = safe_open
