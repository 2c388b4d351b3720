"""DFlash: a block drafter proposing a whole block of tokens in one bidirectional pass over the target's features.

head.py the head, drafter.py its block drafter, formats.py its export and import layouts, card.py its part
of the model card.
"""
