"""Held-out evaluation: how often a head's drafts would be accepted, measured the way decoding rolls them out.

Training recipes score their head here every `train.eval_every` steps (acceptance.py); scripts/eval_heads.py
(compare.py: heads side by side, with the spread over prompts) and scripts/sweep_exit.py report the same numbers on
more prompts. bench.py is the decoding benchmark of scripts/bench.py (methods, timing, summary, sweeps, plots).
Evaluation reads heads, targets and data (bench.py also decode) and is read by training, never the other way
round: `train -> eval -> heads, core, data`; training reads only acceptance.py.
"""
