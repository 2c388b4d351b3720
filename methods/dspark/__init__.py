"""DSpark: a DFlash block drafter whose block is chained by a low-rank Markov head and cut by a confidence head.

head.py the head (DFlash's body, methods/dflash/head.py, plus the two heads), drafter.py its drafter, train.py its
recipe, card.py its model-card section.
"""
