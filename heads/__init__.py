"""Draft heads trained from a frozen target: one file per architecture behind one small interface.

Every head is built by `HEADS[type](target_model, **head_config)`, is bound to the target's shared modules
(embedding, lm_head) by reference, and reports `head_config()` for its checkpoint.
"""

from selfspec.heads.dflash import build_dflash
from selfspec.heads.eagle import build_eagle
from selfspec.heads.eagle3 import build_eagle3
from selfspec.heads.layerskip import build_layerskip
from selfspec.heads.peagle import build_peagle

HEADS = {"eagle": build_eagle, "eagle3": build_eagle3, "layerskip": build_layerskip, "dflash": build_dflash,
         "peagle": build_peagle}
