"""The draft length's one default (decode/draft.NUM_DRAFT, issue 51): every chain drafter built without num_draft (or
with None, as generate passes num_draft=null) drafts NUM_DRAFT tokens; one given is kept. DFlash and P-EAGLE default
to their own block and depth (tests/decode/test_dflash_decode.py, test_peagle_decode.py)."""

from __future__ import annotations

import pytest

from selfspec.decode.draft import NUM_DRAFT
from selfspec.decode.drafters import build_drafter


@pytest.mark.parametrize("name", ["eagle", "layerskip", "ngram", "draft_model"])
@pytest.mark.parametrize("given", [{}, {"num_draft": None}, {"num_draft": 3}])
def test_a_chain_drafter_drafts_num_draft_by_default(name, given, tiny_target):
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.methods.layerskip.head import build_layerskip

    target = tiny_target("llama")
    options = {"eagle": lambda: {"head": build_eagle(target.model)},
               "layerskip": lambda: {"head": build_layerskip(target.model, exit_layer=1)},
               "ngram": dict, "draft_model": lambda: {"draft_model": tiny_target("llama", seed=1)}}[name]()
    drafter = build_drafter(name, target, **options, **given)
    assert drafter.num_draft == (given.get("num_draft") or NUM_DRAFT)
