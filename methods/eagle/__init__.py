"""EAGLE-1/2: one decoder layer over the fused (feature, token) pair, extrapolating the target's last hidden state.

head.py the head (its decoder layer from heads/layers.py), drafter.py the chains and EAGLE-2 trees EAGLE-1 and
EAGLE-3 heads both draft, formats.py its export and import layouts, card.py its part of the model card.
"""
