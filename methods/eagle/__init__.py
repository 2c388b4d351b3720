"""EAGLE-1/2: one decoder layer over the fused (feature, token) pair, extrapolating the target's last hidden state.

head.py is heads/eagle.py's EagleHead for now (the layer toolkit every head shares sits beside it); drafter.py drafts
chains and EAGLE-2 trees for EAGLE-1 and EAGLE-3 heads alike; formats.py its export and import layouts.
"""
