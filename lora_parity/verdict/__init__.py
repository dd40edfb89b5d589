"""verdict: the pure judgement: stats, the noise model and thresholds, checks and their rules, breakdown,
explanations, the calibration rule and `verify` (a receipt re-judged from its recorded scores).
May import util/ and evidence/ only: nothing that loads torch, vLLM or a backend.
"""
