"""methods/dspark/train.py and methods/dspark/acceptance.py: the block loss (labels one position after DFlash's, each
slot chained on the token before it, the confidence target), the held-out count against the drafter's own
proposals, two training steps that move every part of the head and write a loadable one, resume, and the one-line
refusals, on tiny targets (every tiny family: tests/train/test_families.py, through the registry's `tiny`)."""

import json

import pytest
import torch
import torch.nn.functional as F

from selfspec.target.model import load_target
from selfspec.decode.draft import Sampling
from selfspec.decode.drafters import build_drafter
from selfspec.heads.checkpoint import load_head
from selfspec.methods.dspark.acceptance import block_acceptance, block_hits
from selfspec.methods.dspark.head import build_dspark
from selfspec.methods.dspark.train import block_loss, main
from recipe_runs import assert_refused_in_one_line, head_weights, resumed_at_step_3
from tolerance import approx

TINY = ["target=tiny-llama", "data=tiny", "data.max_length=96", "train.eval_every=0", "train.eval_prompts=0",
        "train.log_every=1", "draft=dspark", "draft.block_size=4", "draft.num_layers=2", "draft.markov_rank=8",
        "dspark.anchors=16"]


def _batch(seed: int = 0, b: int = 3, t: int = 40):
    """Right-padded rows with a prompt (loss_mask 0) then an answer (loss_mask 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (b, t), generator=g)
    attn, loss_mask = torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long)
    for i in range(b):
        n, p = int(torch.randint(10, t + 1, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        attn[i, :n], loss_mask[i, p:n] = 1, 1
        loss_mask[i, p + 3] = 0  # a hole in the answer (a template token)
    return {"input_ids": ids * attn, "attention_mask": attn, "loss_mask": loss_mask}


def _manual(head, target, batch, anchors, valid, gamma, alpha):
    """The docstring's loss one slot at a time: slot k of anchor a predicts the target's argmax at a+k, chained on
    x_a (k = 0) or the target's argmax at a+k-1; the confidence BCE against the slot's greedy hit."""
    ids = batch["input_ids"]
    with torch.no_grad():
        out = target.model(ids, attention_mask=batch["attention_mask"], output_hidden_states=True)
        greedy = out.logits.argmax(-1)
        hidden = head(head.context(head.target_states(out.hidden_states)), ids, anchors, valid)
    num = den = cnum = cden = 0.0
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not valid[b, n]:
                continue
            a = int(anchors[b, n])
            for k in range(head.block_size):
                if not batch["loss_mask"][b, a + k + 1]:
                    continue
                prev = ids[b, a] if k == 0 else greedy[b, a + k - 1]
                with torch.no_grad():
                    logits, conf = head.block_logits(hidden[b, n, k], prev)
                label, w = int(greedy[b, a + k]), float(torch.exp(torch.tensor(-k / gamma)))
                num += w * -float(F.log_softmax(logits, -1)[label])
                den += w
                hit = float(logits.argmax() == label)
                cnum += w * float(F.binary_cross_entropy_with_logits(conf, torch.tensor(hit)))
                cden += w
    return num / den + alpha * cnum / cden


@pytest.mark.kernels  # the head's pass over many blocks against one slot at a time (tests/tolerance.py)
def test_the_loss_scores_the_next_token_chained_on_the_one_before(llama4):
    torch.manual_seed(0)
    head = build_dspark(llama4.model, block_size=4, num_layers=2, markov_rank=8, tokenizer=llama4.tokenizer).train()
    with torch.no_grad():
        for p in head.markov_head.parameters():
            p.normal_()  # a Markov bias that matters: a wrong previous token would change the loss
    batch = _batch()
    torch.manual_seed(3)
    loss, stats = block_loss(head, head, llama4.model, batch, 6, "ce", 2.0, 0.5)
    torch.manual_seed(3)  # the same anchors (the sampler draws from torch's RNG)
    from selfspec.methods.dflash.train import sample_anchors

    anchors, valid = sample_anchors(batch["loss_mask"], batch["attention_mask"], 5, 6)
    want = _manual(head.eval(), llama4, batch, anchors, valid, 2.0, 0.5)
    assert float(loss.detach()) == approx(want, k=llama4.model.config.hidden_size, ops=20)
    assert stats["blocks"] == int(valid.sum()) > 6 and {"acc_1", "acc_4", "conf_loss"} <= set(stats)
    loss.backward()
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)


def test_held_out_count_equals_the_drafters_own_greedy_blocks(llama4):
    """eval.block_hits (teacher-forced, many anchors per pass) counts what the drafter proposes and gets accepted:
    from a fresh cache at every anchor, its greedy block's matching prefix."""
    torch.manual_seed(0)
    vocab = torch.tensor([40, 41, 42])  # a 3-token draft vocabulary and text over it: drafts often match
    head = build_dspark(llama4.model, block_size=4, num_layers=2, markov_rank=8, draft_vocab=vocab).eval()
    g = torch.Generator().manual_seed(1)
    ids = vocab[torch.randint(0, 3, (1, 24), generator=g)]
    drafter = build_drafter("dspark", llama4, head=head)
    with torch.no_grad():  # the head's own block after position 12 continues the text: accepted in full there
        ctx = head.context(head.target_states(llama4.model(ids, output_hidden_states=True).hidden_states))
        drafter.cache = head.extend_cache(head.new_cache(), ctx[:, :12])
        ids[0, 13:17] = torch.tensor(drafter.propose(ids[:, :13], 4, Sampling()).tokens)
        ctx = head.context(head.target_states(llama4.model(ids, output_hidden_states=True).hidden_states))
        hits, blocks = torch.zeros(4), 0
        for a in range(5, 24 - 4):
            drafter.cache = head.extend_cache(head.new_cache(), ctx[:, :a])
            drafts = torch.tensor(drafter.propose(ids[:, :a + 1], 4, Sampling()).tokens)
            hits += (drafts == ids[0, a + 1:a + 5]).long().cumprod(0).float()
            blocks += 1
    got, n = block_hits(head, llama4, [(ids, 5)], chunk=4)
    assert torch.equal(got, hits) and n == blocks == 15 and hits[-1] >= 1 and hits[0] > hits[-1]
    ev = block_acceptance(head, llama4, [(ids, 5)])
    assert ev["tau"] == pytest.approx(1 + float(hits.sum()) / blocks) and ev["chains"] == blocks


def test_two_steps_move_every_part_and_write_a_loadable_head(tmp_path):
    out = tmp_path / "run"
    result = main(TINY + ["train.max_steps=2", "train.lr=3e-3", "draft.vocab_size=64", "train.eval_every=2",
                          "train.eval_prompts=2", "train.eval_new_tokens=16", f"output_dir={out}"])
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["head"] == {"type": "dspark", "block_size": 4, "num_layers": 2, "target_layer_ids": [0],
                           "mask_token_id": 261, "vocab_size": 64, "markov_rank": 8, "confidence_head": True}
    assert cfg["training"]["steps"] == 2 and cfg["training"]["recipe"] == "methods/dspark/train.py"
    assert result["heldout"]["chains"] > 0 and {"acc_1", "acc_4"} <= set(result)
    target = load_target("tiny:llama")
    head = load_head(str(out / "head"), target, expected_type="dspark")
    assert head.d2t.shape == (64,) and head.markov_head.markov_w2.weight.shape == (64, 8)
    torch.manual_seed(0)  # the recipe's init with train.seed=0: training must have moved every part
    fresh = build_dspark(target.model, block_size=4, num_layers=2, markov_rank=8, tokenizer=target.tokenizer,
                         draft_vocab=head.draft_token_ids()).state_dict()
    trained = head_weights(out)
    assert trained.keys() == fresh.keys()
    for name in ("fc.weight", "layers.1.mlp.up_proj.weight", "markov_head.markov_w1.weight",
                 "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"):
        assert not torch.equal(trained[name], fresh[name]), name


def test_kl_loss_and_the_confidence_weight_reach_the_weights(tmp_path):
    common = TINY + ["train.max_steps=2", "train.lr=3e-3"]
    runs = {"ce": [], "kl": ["dspark.loss=kl"], "no_conf": ["dspark.confidence_alpha=0"]}
    for name, extra in runs.items():
        main(common + extra + [f"output_dir={tmp_path / name}"])
    ce, kl, no_conf = (head_weights(tmp_path / name) for name in runs)
    assert not torch.equal(ce["fc.weight"], kl["fc.weight"])
    assert not torch.equal(ce["confidence_head.proj.weight"], no_conf["confidence_head.proj.weight"])


def test_resume_continues_exactly(tmp_path, capsys):
    common = TINY + ["train.max_steps=6", "train.save_every=3", "train.batch_size=2", "draft.vocab_size=64"]
    a, b = resumed_at_step_3(main, common, tmp_path, capsys)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bad, message", [
    ("draft=dflash", "methods/dspark/train.py trains draft=dspark heads, not 'dflash'"),
    ("dspark.loss=mse", "dspark.loss='mse'"),
    ("dspark.anchors=0", "dspark.anchors must be >= 1"),
    ("dspark.confidence_alpha=-1", "dspark.confidence_alpha must be >= 0"),
    ("draft.markov_rank=0", "dspark markov_rank=0"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, bad, message):
    base = [a for a in TINY if not a.startswith("draft")] if bad.startswith("draft=") else TINY  # dflash's schema
    assert_refused_in_one_line(main, base + [bad], tmp_path, capsys, message)
