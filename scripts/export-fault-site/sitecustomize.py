"""A fault planted outside lora-parity, in the adapter file between export and load (issue 45's layer faults; the
`scripts/layer-faults.sh` runs): on PYTHONPATH, it wraps safetensors' `save_file` for every `adapter_model.safetensors`
the run writes (the sync's exports, per-target and per-layer coverage's too) and rewrites what is saved.

    EXPORT_FAULT=upper-half          every lora_B of the upper half of the layers zeroed (a shard merge that lost them)
    EXPORT_FAULT=previous            the middle layer's tensors from the first adapter saved (the previous version)
    EXPORT_FAULT=zero-b:down_proj    the middle layer's down_proj lora_B zeroed (zero-b:MODULE:INDEX for another)
"""

import os
import re

FAULT = os.environ.get("EXPORT_FAULT", "")
_first = {}


def _layer_of(name):
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def rewrite(tensors):
    kind, _, arg = FAULT.partition(":")
    layers = sorted({i for i in map(_layer_of, tensors) if i is not None})
    middle = layers[len(layers) // 2] if layers else -1
    module, _, index = arg.partition(":")
    at = int(index) if index else middle
    if not _first:
        _first.update({n: t.clone() for n, t in tensors.items()})
    out = {}
    for name, value in tensors.items():
        layer = _layer_of(name)
        if kind == "upper-half" and "lora_B" in name and layer is not None and layer >= (len(layers) + 1) // 2:
            value = value * 0
        elif kind == "previous" and layer == middle and name in _first and _first[name].shape == value.shape:
            value = _first[name]
        elif kind == "zero-b" and f"{module}.lora_B" in name and layer == at:
            value = value * 0
        out[name] = value
    return out


if FAULT:
    import safetensors.torch as st

    _save = st.save_file

    def save_file(tensors, filename, *args, **kwargs):
        if str(filename).endswith("adapter_model.safetensors"):
            tensors = rewrite(tensors)
        return _save(tensors, filename, *args, **kwargs)

    st.save_file = save_file
