"""Checks on a held-out eval's figures that can fail (tau >= 1 cannot: it is 1 + a sum of probabilities)."""

import math


def assert_tau_is_its_chains(heldout: dict) -> None:
    """The eval ran chains, and its tau is 1 + sum over depths of P(first d drafts accepted), rebuilt from the
    conditional acceptances acc@d it reports (eval.acceptance.acceptance_from_hits)."""
    assert heldout["chains"] > 0, heldout
    conditional = [heldout[f"acc@{d}"] for d in range(1, 1 + sum(k.startswith("acc@") for k in heldout))]
    assert conditional and all(0.0 <= c <= 1.0 for c in conditional), heldout
    rebuilt = 1.0 + sum(math.prod(conditional[:d]) for d in range(1, len(conditional) + 1))
    assert abs(heldout["tau"] - rebuilt) < 1e-3 * len(conditional), (heldout["tau"], rebuilt)
