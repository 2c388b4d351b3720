"""Held-out evaluation: how often a head's drafts would be accepted, measured the way decoding rolls them out.

Training recipes score their head here every `train.eval_every` steps; scripts/eval_heads.py and
scripts/sweep_exit.py report the same numbers on more prompts. Evaluation reads heads, targets and data and is
read by training, never the other way round: `train -> eval -> heads, core, data`.
"""
