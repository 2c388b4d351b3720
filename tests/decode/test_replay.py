"""decode/replay.py: a lookup replayed over the target's greedy output counts exactly what the engine counted
decoding with it (passes, committed tokens, drafted tokens), however the output ended."""

import pytest

from selfspec.decode.drafters.ngram import NgramDrafter
from selfspec.decode.drafters.suffix import SuffixDrafter
from selfspec.decode.engine import generate
from selfspec.decode.replay import replay

LOOKUPS = {"ngram": lambda: NgramDrafter(num_draft=4), "suffix": lambda: SuffixDrafter(),
           "suffix tree": lambda: SuffixDrafter(num_draft=6, tree=True),
           "suffix shallow": lambda: SuffixDrafter(num_draft=3, alpha=0.5)}


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("stop", ["length", "eos"])
def test_replay_counts_what_the_engine_counted(lookup, stop, family, tiny_target, prompt_of):
    target = tiny_target(family)
    ids = prompt_of(target, "one two three four one two three four one two three four one two")
    new = 48
    plain = generate(target, None, ids, new, eos_token_ids=[]).tokens
    eos = [plain[30]] if stop == "eos" else []  # a token of the output ends it at its first occurrence
    r = generate(target, LOOKUPS[lookup](), ids, new, eos_token_ids=eos)
    assert r.stop_reason == stop
    got = replay(LOOKUPS[lookup](), ids, r.tokens, new)
    assert (got.passes, got.committed, got.drafted) == (r.verify_passes, r.committed_by_verify, r.drafted_tokens)
    assert got.tau == pytest.approx(r.tau)
    assert got.drafted_passes == sum(r.proposed_by_position[:1])


def test_an_output_longer_than_its_budget_is_refused():
    with pytest.raises(ValueError, match="max_new_tokens=2"):
        replay(SuffixDrafter(), [1, 2], [3, 4, 5], 2)
