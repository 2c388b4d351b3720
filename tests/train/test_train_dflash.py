"""methods/dflash/train.py: the anchor sampler, the block loss (labels, masks, levers), block_acceptance against
decoding's draft_block, training, resume, offline features, two processes, a bf16 target and the one-line refusals,
on tiny targets."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from selfspec.target.model import load_target
from selfspec.methods.dflash.acceptance import block_acceptance, block_hits
from selfspec.heads.checkpoint import load_head
from selfspec.methods.dflash.head import build_dflash
from selfspec.methods.dflash.train import block_loss, main, sample_anchors
from recipe_runs import assert_refused_in_one_line, head_weights, resumed_at_step_3
from tolerance import approx

ROOT = Path(__file__).resolve().parents[2]
TINY = ["target=tiny-llama", "data=tiny", "data.max_length=96", "train.eval_every=0", "train.eval_prompts=0",
        "train.log_every=1",
        "draft.block_size=4", "draft.num_layers=2", "dflash.anchors=16"]


def _batch(seed: int = 0, b: int = 3, t: int = 40):
    """Right-padded rows with a prompt (loss_mask 0) then an answer (loss_mask 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (b, t), generator=g)
    attn, loss_mask = torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long)
    for i in range(b):
        n, p = int(torch.randint(8, t + 1, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        attn[i, :n], loss_mask[i, p:n] = 1, 1
        loss_mask[i, p + 2] = 0  # a hole in the answer (a template token)
    return {"input_ids": ids * attn, "attention_mask": attn, "loss_mask": loss_mask}


def test_anchor_sampler_keeps_blocks_inside_the_answer():
    for seed in range(30):
        batch = _batch(seed)
        attn, lm = batch["attention_mask"], batch["loss_mask"]
        for s, n in [(4, 8), (8, 100), (2, 1)]:
            torch.manual_seed(seed)
            anchors, valid = sample_anchors(lm, attn, s, n)
            for i in range(attn.shape[0]):
                length = int(attn[i].sum())
                allowed = {a for a in range(length) if lm[i, a] and a + s - 1 < length}
                got = anchors[i][valid[i]].tolist()
                assert len(got) == min(n, len(allowed)) == len(set(got)) and set(got) <= allowed
                assert got == sorted(got) and not bool(valid[i, len(got):].any())  # valid first, ascending


def _manual_ce(head, target, batch, anchors, valid, gamma):
    """The docstring's loss, one block position at a time: labels are the target's argmax at a+k-1."""
    ids = batch["input_ids"]
    with torch.no_grad():
        out = target.model(ids, attention_mask=batch["attention_mask"], output_hidden_states=True)
    greedy = out.logits.argmax(-1)
    with torch.no_grad():
        hidden = head(head.context(head.target_states(out.hidden_states)), ids, anchors, valid)
        logq = F.log_softmax(head.logits(hidden[:, :, 1:]), -1)
    num = den = 0.0
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not valid[b, n]:
                continue
            for k in range(1, head.block_size):
                pos = int(anchors[b, n]) + k
                if not batch["loss_mask"][b, pos]:
                    continue
                w = float(torch.exp(torch.tensor(-(k - 1) / gamma)))
                num += w * -float(logq[b, n, k - 1, greedy[b, pos - 1]])
                den += w
    return num / den


@pytest.mark.kernels  # two kernel paths compared (tests/tolerance.py); make test reruns it capped
def test_ce_scores_the_targets_greedy_tokens_with_the_position_decay(llama4):
    torch.manual_seed(0)
    head = build_dflash(llama4.model, block_size=4, num_layers=2, tokenizer=llama4.tokenizer).train()
    batch = _batch(1)
    torch.manual_seed(5)
    loss, stats = block_loss(head, head, llama4.model, batch, 6, "ce", 2.0)
    torch.manual_seed(5)
    anchors, valid = sample_anchors(batch["loss_mask"], batch["attention_mask"], 4, 6)
    # the loss's logits and its reductions against these: norm, lm_head, log-softmax over V, the weighted mean
    v = llama4.model.get_output_embeddings().weight.shape[0]
    assert loss.item() == approx(_manual_ce(head, llama4, batch, anchors, valid, 2.0), k=v, ops=4)
    assert stats["blocks"] == int(valid.sum()) and {"acc_1", "acc_2", "acc_3"} <= set(stats)


def test_levers_reach_the_loss(llama4):
    """dflash.loss and dflash.gamma change what is optimised, not only what is logged."""
    torch.manual_seed(0)
    head = build_dflash(llama4.model, block_size=4, num_layers=2, tokenizer=llama4.tokenizer).train()
    batch = _batch(2)

    def loss(kind, gamma):
        torch.manual_seed(3)
        return block_loss(head, head, llama4.model, batch, 6, kind, gamma)[0].item()

    assert loss("ce", 2.0) != pytest.approx(loss("kl", 2.0), rel=1e-3)
    assert loss("ce", 0.3) != pytest.approx(loss("ce", 100.0), rel=1e-3)
    assert loss("ce", 2.0) == loss("ce", 2.0)  # and nothing else varies


def test_kl_loss_trains_other_weights(tmp_path):
    common = TINY + ["train.max_steps=2", "train.lr=3e-3"]
    main(common + ["dflash.loss=ce", f"output_dir={tmp_path / 'ce'}"])
    main(common + ["dflash.loss=kl", f"output_dir={tmp_path / 'kl'}"])
    a, b = head_weights(tmp_path / "ce"), head_weights(tmp_path / "kl")
    assert not torch.equal(a["fc.weight"], b["fc.weight"])


def _slow_hits(head, target, ids, start):
    """Decoding's way: a fresh context cache of positions < a, then one draft_block from anchor a."""
    s = head.block_size
    hits, blocks = torch.zeros(s - 1), 0
    with torch.no_grad():
        ctx = head.context(head.target_states(target.model(ids, output_hidden_states=True).hidden_states))
        for a in range(start, ids.shape[1] - s + 1):
            cache = head.new_cache()
            head.extend_cache(cache, ctx[:, :a])
            drafts = head.to_target_ids(head.draft_block(ids[:, a], a, cache).argmax(-1))[0]
            ok = (drafts == ids[0, a + 1:a + s]).long().cumprod(0)
            hits += ok.float()
            blocks += 1
    return hits, blocks


def test_block_acceptance_equals_step_by_step_drafting(llama4):
    torch.manual_seed(0)
    # a 3-token draft vocabulary and text over it: drafts match often, so the count is not all zeros
    vocab = torch.tensor([40, 41, 42])
    head = build_dflash(llama4.model, block_size=4, num_layers=2, tokenizer=llama4.tokenizer, draft_vocab=vocab).eval()
    g = torch.Generator().manual_seed(1)
    ids = vocab[torch.randint(0, 3, (1, 20), generator=g)]
    with torch.no_grad():  # the head's own block from anchor 12 continues the text: that block is accepted in full
        cache = head.new_cache()
        head.extend_cache(cache, head.context(head.target_states(
            llama4.model(ids[:, :12], output_hidden_states=True).hidden_states)))
        ids[0, 13:16] = head.to_target_ids(head.draft_block(ids[:, 12], 12, cache).argmax(-1))[0]
    seqs = [(ids, 5), (ids[:, :9], 3), (ids[:, :8], 6)]  # the last one has no block that fits after its prompt
    hits, blocks = block_hits(head, llama4, seqs, chunk=4)  # chunks of anchors add up too
    slow = [_slow_hits(head, llama4, i, s) for i, s in seqs]
    assert torch.equal(hits, sum(h for h, _ in slow)) and blocks == sum(n for _, n in slow) == 12 + 3
    assert hits[-1] >= 1 and hits[0] > hits[-1]
    ev = block_acceptance(head, llama4, seqs)
    assert ev["tau"] == pytest.approx(1 + float(hits.sum()) / blocks) and ev["chains"] == blocks


def test_trains_and_writes_a_loadable_head(tmp_path):
    out = tmp_path / "run"
    result = main(TINY + ["train.max_steps=4", "train.lr=3e-3", "train.eval_every=2", "draft.vocab_size=64",
                          "train.eval_prompts=2", "train.eval_new_tokens=16", f"output_dir={out}"])
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["head"] == {"type": "dflash", "block_size": 4, "num_layers": 2, "target_layer_ids": [0],
                           "mask_token_id": 261, "vocab_size": 64}
    assert cfg["training"]["steps"] == 4 and "tau" in cfg["metrics"] and result["heldout"]["chains"] > 0
    assert {"acc_1", "acc_2", "acc_3"} <= set(result) and cfg["training"]["gamma"] == 2.5
    target = load_target("tiny:llama")
    folder, single = (load_head(str(p), target, expected_type="dflash") for p in (out / "head", out / "ckpt.pt"))
    assert folder.d2t.shape == (64,) and int(folder.t2d.sum()) == 64
    ids = torch.randint(0, 250, (1, 12))
    with torch.no_grad():
        logits = []
        for head in (folder, single):
            cache = head.new_cache()
            head.extend_cache(cache, head.context(head.target_states(
                target.model(ids, output_hidden_states=True).hidden_states)))
            logits.append(head.draft_block(ids[:, -1], 12, cache))
    assert torch.equal(logits[0], logits[1])
    torch.manual_seed(0)  # the recipe's init with train.seed=0: training must have moved the weights
    fresh = build_dflash(target.model, block_size=4, num_layers=2, tokenizer=target.tokenizer,
                         draft_vocab=folder.draft_token_ids()).state_dict()
    trained = head_weights(out)
    assert trained.keys() == fresh.keys() and not torch.equal(trained["fc.weight"], fresh["fc.weight"])
    assert not torch.equal(trained["layers.1.mlp.up_proj.weight"], fresh["layers.1.mlp.up_proj.weight"])


def test_resume_continues_exactly(tmp_path, capsys):
    common = TINY + ["train.max_steps=6", "train.save_every=3", "train.batch_size=2", "draft.vocab_size=64"]
    a, b = resumed_at_step_3(main, common, tmp_path, capsys)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fine_tune_keeps_the_shape_and_draft_vocabulary(tmp_path):
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    main(TINY + ["train.max_steps=2", "draft.vocab_size=64", f"output_dir={base}"])
    main(TINY + ["train.max_steps=2", "draft.vocab_size=32", "draft.block_size=6", f"dflash.init_from={base / 'head'}",
                 f"output_dir={tuned}"])
    a, b = head_weights(base), head_weights(tuned)
    assert torch.equal(a["d2t"], b["d2t"]) and not torch.equal(a["fc.weight"], b["fc.weight"])
    assert json.loads((tuned / "head" / "config.json").read_text())["head"]["block_size"] == 4


def test_offline_features(tmp_path, capsys):
    from selfspec.scripts.cache_features import main as cache_main

    feats, four = tmp_path / "feats", ["+target.tiny.num_hidden_layers=4"]
    cache_main(["target=tiny-llama", *four, "data=tiny", "data.max_length=96", "data.max_conversations=30",
                f"data.features_dir={feats}", "extra_layers=[1,3]"])  # the outputs of layer ids 0 and 2
    common = TINY + four + ["data.features=offline", f"data.features_dir={feats}", "data.max_conversations=30"]
    result = main(common + ["train.max_steps=2", "draft.target_layer_ids=[0,2]", f"output_dir={tmp_path / 'run'}"])
    assert result["steps"] == 2
    with pytest.raises(SystemExit) as e:  # layer id 1's output is hidden_states[2]: not cached
        main(common + ["draft.target_layer_ids=[1]", f"output_dir={tmp_path / 'run2'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no layer_2" in err and "extra_layers=[2]" in err, err


def test_bf16_target_trains(tmp_path):
    out = tmp_path / "bf16"
    result = main(TINY + ["target.dtype=bfloat16", "train.mixed_precision=bf16", "train.features_dtype=bfloat16",
                          "train.max_steps=2", f"output_dir={out}"])
    assert result["steps"] == 2 and all(torch.isfinite(v).all() for v in head_weights(out).values())
    head = load_head(str(out / "head"), load_target("tiny:llama", dtype="bfloat16"))
    assert head.fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("bad, message", [
    ("draft.block_size=1", "block_size=1: must be in [2, 64]"),
    ("draft.target_layer_ids=[0,5]", "target_layer_ids [0, 5]: each must be in [0, 0]"),
    ("draft.mask_token_id=100000", "mask_token_id=100000 is outside the target's vocabulary"),
    ("draft=eagle", "methods/dflash/train.py trains draft=dflash heads, not 'eagle'"),
    ("dflash.loss=mse", "dflash.loss='mse'"),
    ("dflash.anchors=0", "dflash.anchors must be >= 1"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, bad, message):
    base = [a for a in TINY if not a.startswith("draft.")] if bad.startswith("draft=") else TINY  # eagle's schema
    assert_refused_in_one_line(main, base + [bad], tmp_path, capsys, message)


def test_eval_heads_reports_a_dflash_head_at_its_block_size(tmp_path):
    """scripts/eval_heads.py scores a DFlash head as training's eval does: block_acceptance over the same sequences."""
    from selfspec.data.config import DataConfig
    from selfspec.data.tokenize import heldout_prompts
    from selfspec.eval.acceptance import greedy_continuations
    from selfspec.heads.checkpoint import head_record, save_head
    from selfspec.scripts import eval_heads

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_dflash(target.model, block_size=4, num_layers=1, tokenizer=target.tokenizer,
                        draft_vocab=torch.arange(40, 60)).eval()
    save_head(head, tmp_path / "head", head_record(head, target.identity))
    report = eval_heads.main(argv=["target=tiny-llama", "data=tiny", f"data.cache_dir={tmp_path / 'cache'}",
                                   f"+heads.d={tmp_path / 'head'}", "prompts=3", "new_tokens=16", "block=2"])
    d = report["heads"]["d"]
    cfg = DataConfig(path="synthetic", max_length=256, heldout_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    seqs = greedy_continuations(target, heldout_prompts(cfg, target.tokenizer, 3), 16)
    whole = block_acceptance(head, target, seqs)
    assert d["drafts"] == "block 4" and d["chains"] == whole["chains"] > 0 and d["tau"] == round(whole["tau"], 3)
    assert d["tau_first"] == {"4": round(whole["tau"], 3)}  # b = the head's own block: the whole block verified


def test_tau_first_verifies_only_the_first_drafts_of_each_block():
    from selfspec.eval.compare import first_drafts

    # 10 blocks of 16: 8 accept draft 1, 4 drafts 1-2, 2 drafts 1-3, 1 all 15
    hits = torch.tensor([8.0, 4.0, 2.0] + [1.0] * 12)
    taus = first_drafts([(hits[:], 6), (torch.zeros(15), 4)], 16)
    assert taus == {"4": 2.4, "8": 2.8, "16": 3.6}  # 1 + (8+4+2)/10, + 4 more hits, + 8 more
    assert first_drafts([(hits[:3], 10)], 4) == {"4": 2.4}  # blocks of 4: only b=4
