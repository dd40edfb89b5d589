"""Deterministic synthetic checkpoints in HF format, generated on first use and cached.

No weights can be downloaded in CI, so the embedded default is a small Qwen3-architecture model
made from a seed: HF's own initialisation under `torch.manual_seed`, then the output projection
redrawn with a larger std so that next-token distributions are far from uniform. It is saved
with `save_pretrained` (config.json + model.safetensors) and loaded back through the same code
paths as a real checkpoint. The cache key is the digest of the spec, so a changed spec makes a
new folder; generation writes to a temporary folder and renames it into place.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from lora_parity.evidence.receipt import sha256_json
from lora_parity.models.config import ModelConfig, SyntheticSpec
from lora_parity.models.hub import hub_checkpoint
from lora_parity.util.cache import cache_root
from lora_parity.util.errors import ConfigError


def spec_digest(spec: SyntheticSpec, dtype: str) -> str:
    """Cache key of a synthetic checkpoint."""
    data = spec.model_dump(mode="json")
    # Optional fields added later are left out while unset, so that existing specs keep their cache key.
    return sha256_json({"spec": _without_unset_later(data), "dtype": dtype, "generator": 1})[:16]


_OPTIONAL_LATER = ("rms_norm_eps", "moe", "mla", "moe.expert_std")
"""Spec fields added after the first checkpoints were cached, by dotted path: left out of the key while unset."""


def _without_unset_later(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    return {k: _without_unset_later(v, f"{prefix}{k}.") if isinstance(v, dict) else v for k, v in data.items()
            if not (f"{prefix}{k}" in _OPTIONAL_LATER and v is None)}


def _family_kwargs(spec: SyntheticSpec) -> dict[str, object]:
    """HF config arguments of the MoE and MLA architectures (none for the dense ones)."""
    out: dict[str, object] = {} if spec.rms_norm_eps is None else {"rms_norm_eps": spec.rms_norm_eps}
    moe, mla = spec.moe, spec.mla
    if moe is not None and spec.architecture == "Qwen3MoeForCausalLM":
        out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
                   moe_intermediate_size=moe.moe_intermediate_size, norm_topk_prob=moe.norm_topk_prob,
                   mlp_only_layers=list(range(moe.first_k_dense)))
    elif moe is not None and mla is not None:  # the GLM family: MLA attention, shared experts, leading dense layers
        n_dense = moe.first_k_dense
        out.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
                   moe_intermediate_size=moe.moe_intermediate_size, n_shared_experts=moe.num_shared_experts,
                   norm_topk_prob=moe.norm_topk_prob, first_k_dense_replace=n_dense,
                   mlp_layer_types=["dense"] * n_dense + ["sparse"] * (spec.num_hidden_layers - n_dense),
                   q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
                   qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim)
        if mla.index_topk is not None:
            # GLM-5 routes with sigmoid scores and a learned correction bias, as HF's model always does;
            # vLLM reads both from config.json (without them it routes with softmax, and loading fails
            # on the e_score_correction_bias it then has no parameter for).
            out.update(index_topk=mla.index_topk, index_head_dim=mla.index_head_dim, index_n_heads=mla.index_n_heads,
                       scoring_func="sigmoid", topk_method="noaux_tc")
    return out


def hf_config_fields(spec: SyntheticSpec) -> dict[str, object]:
    """The shape fields the generated config.json will have (no torch needed)."""
    fields = spec.model_dump(exclude={"architecture", "seed", "lm_head_std", "generate_on", "moe", "mla"})
    fields = {k: v for k, v in fields.items() if v is not None}
    return {**fields, "architectures": [spec.architecture], **_family_kwargs(spec)}


def generate(spec: SyntheticSpec, dtype: str, folder: Path) -> None:
    """Write the checkpoint of `spec` into `folder` (created)."""
    import torch
    import transformers

    config_cls = getattr(transformers, spec.architecture.replace("ForCausalLM", "Config"))
    hf_config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        # MLA models derive their head dims from the mla section (GlmMoeDsa points head_dim at the RoPE slice).
        **({} if spec.mla is not None else {"head_dim": spec.head_dim}),
        **_family_kwargs(spec),
    )
    device = torch.device(spec.generate_on)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{spec.architecture} spec is generated on the GPU (generate_on: cuda); no CUDA here")
    torch.manual_seed(spec.seed)
    with device:
        model = getattr(transformers, spec.architecture)(hf_config).to(getattr(torch, dtype))
        with torch.no_grad():
            generator = torch.Generator(device=device).manual_seed(spec.seed + 1)
            head = model.get_output_embeddings().weight
            head.copy_(torch.randn(head.shape, generator=generator, dtype=torch.float32) * spec.lm_head_std)
            if spec.moe is not None and spec.moe.expert_std is not None:  # the routed experts only, not shared ones
                for name, weight in sorted(model.named_parameters()):
                    if ".experts." in name:
                        weight.copy_(torch.randn(weight.shape, generator=generator, dtype=torch.float32)
                                     * spec.moe.expert_std)
    model.save_pretrained(folder, safe_serialization=True)


def materialize(cfg: ModelConfig) -> Path:
    """The checkpoint folder of a config: generated and cached for a synthetic model, the given
    folder for a local one."""
    spec = cfg.model
    if spec.path is not None:
        path = Path(spec.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model path {path} not found or has no config.json")
        return path
    if spec.hf_id is not None:
        snapshot = hub_checkpoint(spec.hf_id)
        if snapshot is not None:  # already in the local Hugging Face cache: used as it is
            return snapshot
        raise ConfigError(
            f"{cfg.name} names the hub model {spec.hf_id}; lora-parity does not download weights: "
            "download it yourself and pass the folder with --model PATH"
        )
    if spec.gguf is not None:
        from lora_parity.models import realmodel

        return realmodel.materialize(cfg.name, spec.gguf, spec.dtype, cache_root())
    assert spec.synthetic is not None
    folder = _synthetic_folder(cfg)
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        generate(spec.synthetic, spec.dtype, tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # lost a race to another process: theirs is identical
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _synthetic_folder(cfg: ModelConfig) -> Path:
    assert cfg.model.synthetic is not None
    return cache_root() / "models" / f"{cfg.name}-{spec_digest(cfg.model.synthetic, cfg.model.dtype)}"


def cached(cfg: ModelConfig) -> Path | None:
    """The folder `materialize` would return without building anything (a local folder, a hub
    snapshot, a synthetic checkpoint already cached), or None: it must be built first (a GGUF
    conversion's cache key is not computed here) or does not exist (`materialize` says why)."""
    spec = cfg.model
    if spec.path is not None:
        folder: Path | None = Path(spec.path)
    elif spec.hf_id is not None:
        folder = hub_checkpoint(spec.hf_id)
    elif spec.synthetic is not None:
        folder = _synthetic_folder(cfg)
    else:
        folder = None
    return folder if folder is not None and (folder / "config.json").is_file() else None


TOKENIZER_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>")
"""Ids 0 and 1, the bos and eos ids every synthetic config.json names."""


def _tokenizer_corpus(seed: int = 0, num_lines: int = 2000) -> list[str]:
    """Deterministic pseudo-text: words built from a fixed set of syllables, seeded."""
    import random

    syllables = ["ka", "lo", "ri", "sen", "ta", "mu", "ve", "dor", "pi", "an", "el", "qu", "zo", "th", "ing", "er",
                 "st", "ou", "ch", "ly", "x", "9", "2024", " ", ",", ".", "\n", "(", ")", "=", "+", "_"]
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(3, 12))]
        lines.append(" ".join(words))
    return lines


def add_tokenizer(folder: Path, vocab_size: int) -> Path:
    """Write a byte-level BPE tokenizer of exactly `vocab_size` tokens (tokenizer.json and
    tokenizer_config.json) into the checkpoint `folder`, trained with `tokenizers` on a fixed,
    seeded corpus: deterministic, nothing downloaded. Servers that load a tokenizer with the model
    (SkyRL's Tinker server does) need one; lora-parity itself only scores token ids.

    Ids 0 and 1 are `<|bos|>` and `<|eos|>`, then the 256 byte symbols, then merges."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    num_special = len(TOKENIZER_SPECIAL_TOKENS)
    if vocab_size < 256 + num_special:
        raise ConfigError(f"a byte-level tokenizer needs at least {256 + num_special} tokens, not {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(TOKENIZER_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_tokenizer_corpus(), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ConfigError(f"tokenizer training reached {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    bos, eos = TOKENIZER_SPECIAL_TOKENS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "model_max_length": 1 << 16, "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return folder
