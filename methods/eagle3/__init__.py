"""EAGLE-3: a head fusing low, middle and high target layers, trained with a training-time test.

head.py the head, drafter.py its drafter (EAGLE-1's chains and trees, methods/eagle/drafter.py), formats.py its export
and import layouts (speculators, SGLang, llama.cpp GGUF), card.py its part of the model card.
"""
