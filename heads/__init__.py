"""What every head shares: checkpoints that describe themselves (checkpoint.py), the layer toolkit heads are built
from (eagle.py), reduced draft vocabularies (vocab.py). Each head type's own head is its method's (methods/): built by
`method(type).load("head")(target_model, **head_config)`, bound to the target's shared modules (embedding, lm_head) by
reference, reporting `head_config()` for its checkpoint.
"""
