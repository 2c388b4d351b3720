"""End-to-end speculative SAMPLING is distributed exactly as the target: chi-square tests of the first three
generated tokens over many seeds (fixed, so the test is deterministic), against the exact joint computed
from the target itself. top_k=3 keeps the outcome space small (27 cells)."""

from __future__ import annotations


import pytest
import torch

from selfspec.decode.drafters import build_drafter
from selfspec.decode.drafters.draft_model import DraftModelDrafter
from selfspec.methods.dflash.head import build_dflash
from selfspec.methods.eagle.head import build_eagle
from selfspec.methods.peagle.head import build_peagle
from sampling_stats import chi_square_pvalue, exact_joint, sampled_first_three, perturbed_draft

T, TOP_K, RUNS = 1.0, 3, 400


@pytest.mark.parametrize("drafter", ["none", "draft_model_chain", "ngram_chain", "oracle_tree_point_masses",
                                     "oracle_tree_iid", "eagle_chain", "eagle_tree", "dflash_block",
                                     "dflash_guided", "peagle_chain"])
def test_sampling_matches_target_distribution(drafter, tiny_target, prompt_of):
    target = tiny_target("llama")
    prompt = prompt_of(target, "abcabcabc")
    vocab = target.model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(0)
    head = build_eagle(target.model, vocab_size=64, draft_vocab=torch.arange(64) + 64)
    d = {
        "none": None,
        "draft_model_chain": DraftModelDrafter(perturbed_draft(target.model), vocab, num_draft=2),
        "ngram_chain": build_drafter("ngram", target, num_draft=2),
        "oracle_tree_point_masses": build_drafter("oracle", target, num_draft=2, width=2),
        "oracle_tree_iid": build_drafter("oracle", target, num_draft=2, width=2, sampled=True),
        # random heads (reduced draft vocabulary): little is accepted, but the wiring of p must stay exact
        "eagle_chain": build_drafter("eagle", target, head=head, num_draft=2),
        "eagle_tree": build_drafter("eagle", target, head=head, chain=False, tree_depth=2, tree_top_k=3,
                                    tree_total_tokens=6),
        "dflash_block": build_drafter("dflash", target, head=build_dflash(target.model, block_size=3, vocab_size=64,
                                                                          draft_vocab=torch.arange(64) + 64)),
        "dflash_guided": _guided_dflash(target, block_size=3),
        "peagle_chain": build_drafter("peagle", target, head=build_peagle(target.model, vocab_size=64, depth=3,
                                                                          draft_vocab=torch.arange(64) + 64)),
    }[drafter]
    counts, accepted = sampled_first_three(target, d, prompt, RUNS, T, TOP_K)
    expected = exact_joint(target.model, prompt, T, TOP_K)
    assert chi_square_pvalue(counts, expected, RUNS) > 1e-3
    if drafter.startswith(("draft_model", "oracle", "dflash_guided")):
        assert accepted > RUNS // 4  # drafts are really accepted (and rejected: p != q) in this test


def _guided_dflash(target, block_size: int):
    """A DFlash drafter whose block rows are the target's own logits (sharpened: p != q) along its greedy
    continuation of the committed text: each position drafted independently of the tokens sampled before it, as a
    real block, yet accepted often."""
    torch.manual_seed(0)
    head = build_dflash(target.model, block_size=block_size, num_layers=1)
    drafter = build_drafter("dflash", target, head=head)
    committed = {}
    real_block, real_propose = head.draft_block, drafter.propose

    def propose(seq, max_depth, sampling):
        committed["seq"] = seq[0].tolist()
        return real_propose(seq, max_depth, sampling)

    def draft_block(anchor_id, anchor_pos, cache):
        out = real_block(anchor_id, anchor_pos, cache)  # [1, S-1, V]: its checks still run
        ctx, rows = list(committed["seq"]), []
        assert anchor_pos == len(ctx) - 1 and int(anchor_id) == ctx[-1]
        for _ in range(out.shape[1]):
            logits = target.model(torch.tensor([ctx])).logits[0, -1].float()
            rows.append(logits * 1.5)
            ctx.append(int(logits.argmax()))
        return torch.stack(rows)[None]

    drafter.propose, head.draft_block = propose, draft_block
    return drafter
