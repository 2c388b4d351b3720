"""P-EAGLE: an EAGLE-3 head drafting its whole depth in one parallel pass (mask slots for the future inputs).

head.py the head, drafter.py its one-pass drafter, formats.py its speculators layout, card.py its part
of the model card.
"""
