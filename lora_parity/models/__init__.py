"""models: what is tested: model configs, checkpoints, the synthetic and real builders, init, provenance,
adapter files, LoRA targets and the update rules (perturb, update_step) the backends apply.
May import util/ and evidence/ only.
"""
