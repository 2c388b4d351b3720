"""EAGLE-3: a head fusing low, middle and high target layers, trained with a training-time test.

head.py the head, formats.py its export and import layouts (speculators, SGLang, llama.cpp GGUF); it drafts with
methods/eagle/drafter.py.
"""
