"""LayerSkip: an early exit after layer E of the frozen target; the first E layers draft, the full model verifies.

head.py the exit's adapters, drafter.py the self-speculative drafter that writes into the target's own cache,
card.py its part of the model card.
"""
