"""methods/peagle/train.py: the loss's labels and masks against a slot-by-slot reading, parallel_acceptance against
decoding's drafter, training, resume, a warm start from an EAGLE-3 head, and the one-line refusals, on tiny targets."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from selfspec.target.model import load_target
from selfspec.methods.peagle.drafter import PEagleDrafter
from selfspec.methods.peagle.acceptance import parallel_hits
from selfspec.heads.checkpoint import load_head
from selfspec.methods.peagle.head import build_peagle, run_parallel
from selfspec.methods.peagle.train import PEagleLossConfig, main, parallel_loss
from recipe_runs import assert_refused_in_one_line, head_weights, resumed_at_step_3
from tolerance import approx

TINY = ["target=tiny-llama", "data=tiny", "data.max_length=96", "train.eval_every=0", "train.eval_prompts=0",
        "train.log_every=1", "draft.depth=3", "draft.vocab_size=64"]


def _batch(seed: int = 0, b: int = 2, t: int = 24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (b, t), generator=g)
    attn, loss_mask = torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long)
    for i in range(b):
        n = t if i == 0 else t - 7
        attn[i, :n], loss_mask[i, 3:n] = 1, 1
    return {"input_ids": ids * attn, "attention_mask": attn, "loss_mask": loss_mask}


@pytest.mark.kernels  # two kernel paths compared (tests/tolerance.py); make test reruns it capped
def test_loss_scores_each_depth_against_the_token_it_drafts(llama4):
    """Every anchor at every depth (ratio 1): the loss equals a direct reading, anchor by anchor and depth by depth,
    of soft CE between the head's depth-d row at anchor a and the target's distribution at a+1+d."""
    torch.manual_seed(0)
    head = build_peagle(llama4.model, depth=3)
    batch = _batch()
    cfg = PEagleLossConfig(down_sample_ratio=1.0, down_sample_ratio_min=1.0, decay=0.5)
    loss, stats = parallel_loss(head, head, llama4.model, batch, cfg)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        out = llama4.model(ids, attention_mask=attn, output_hidden_states=True)
        aux = head.aux_states(out.hidden_states)
        p = torch.softmax(out.logits.float(), -1)  # full vocabulary: the head's draft vocabulary is all of it
        next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
        t = ids.shape[1]
        outs = run_parallel(head, aux, next_ids, attn, [torch.arange(t)] * 2)
    valid = (batch["loss_mask"] * attn).float()
    # the head's rows one at a time against the loss's batch: norm, lm_head, log-softmax, the sum over V, the mean
    tol = {"k": max(head.lm_head.weight.shape[0], head.fc.in_features), "ops": 5}
    total = 0.0
    for d in range(3):
        num = den = 0.0
        for b in range(ids.shape[0]):
            for a in range(t):
                j = a + 1 + d
                if j + 1 >= t or not valid[b, j + 1]:
                    continue
                with torch.no_grad():
                    logq = F.log_softmax(head.logits(outs[d][b, a]).float(), -1)
                num += float(-(p[b, j] * logq).sum())
                den += 1
        assert stats[f"ce_{d}"] == approx(num / den, **tol)
        total += 0.5 ** d * num / den
    assert float(loss.detach()) == approx(total, k=tol["k"], ops=tol["ops"] + 1)  # and the sum over depths


def test_parallel_hits_agree_with_the_drafter(llama4):
    torch.manual_seed(1)
    head = build_peagle(llama4.model, depth=3, vocab_size=40, draft_vocab=torch.arange(40) * 3).eval()
    ids = torch.randint(0, 120, (1, 20))
    start = 6
    hits, drafts = parallel_hits(head, llama4, [(ids, start)], 3, chunk=4)
    drafter = PEagleDrafter(head, llama4.model.get_output_embeddings().weight.shape[0])
    with torch.no_grad():
        aux = head.aux_states(llama4.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states)
    want = torch.zeros(3)
    count = 0
    for a in range(start - 1, 20 - 3 - 1):
        drafter.reset(ids)
        with torch.no_grad():
            drafter.observe(ids[:, :a + 2], aux[:, :a + 1], 0)
            tokens = head.to_target_ids(head.logits(drafter.drafts).argmax(-1))
        ok = (tokens == ids[0, a + 2:a + 5]).long().cumprod(0)
        want += ok.float()
        count += 1
    assert drafts == count and torch.equal(hits, want)


def test_trains_and_writes_a_loadable_head(tmp_path):
    out = tmp_path / "run"
    result = main(TINY + ["train.max_steps=4", "train.lr=3e-3", "train.eval_every=2", "draft.num_layers=2",
                          "train.eval_prompts=2", "train.eval_new_tokens=16", f"output_dir={out}"])
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["head"]["type"] == "peagle" and cfg["head"]["num_layers"] == 2 and cfg["head"]["depth"] == 3
    assert cfg["head"]["vocab_size"] == 64 and cfg["training"]["steps"] == 4
    assert {"acc_0", "acc_1", "acc_2"} <= set(result) and result["heldout"]["chains"] > 0
    head = load_head(str(out / "head"), load_target("tiny:llama"), expected_type="peagle")
    assert head.d2t.shape == (64,) and head.depth == 3
    torch.manual_seed(0)  # the recipe's init with train.seed=0: training must have moved the mask and the new layer
    fresh = build_peagle(load_target("tiny:llama").model, depth=3, num_layers=2,
                         draft_vocab=head.draft_token_ids()).state_dict()
    trained = head_weights(out)
    for key in ("mask_hidden", "layers.1.mlp.up_proj.weight", "fc.weight"):
        assert not torch.equal(trained[key], fresh[key]), key


def test_resume_continues_exactly(tmp_path, capsys):
    common = TINY + ["train.max_steps=6", "train.save_every=3", "train.batch_size=2"]
    a, b = resumed_at_step_3(main, common, tmp_path, capsys)  # COD anchors: torch's RNG, which the checkpoint restores
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_warm_start_from_an_eagle3_head(tmp_path):
    from selfspec.methods.eagle3.train import main as eagle3_main

    e3 = tmp_path / "e3"
    eagle3_main(["target=tiny-llama", "data=tiny", "data.max_length=96", "train.eval_every=0", "train.eval_prompts=0",
                 "train.max_steps=2", "ttt.steps=2", "draft.vocab_size=64", f"output_dir={e3}"])
    out = tmp_path / "p"
    main(TINY + ["train.max_steps=1", "train.lr=1e-9", "draft.vocab_size=32", "draft.num_layers=2",
                 f"draft.init_from={e3 / 'head'}", f"output_dir={out}"])
    a, b = load_file(str(e3 / "head" / "model.safetensors")), head_weights(out)
    assert torch.equal(a["d2t"], b["d2t"])  # the vocabulary is kept (vocab_size=32 said and ignored)
    torch.testing.assert_close(a["fc.weight"], b["fc.weight"], atol=1e-6, rtol=0)  # lr ~0: the warm start itself
    assert "layers.1.self_attn.q_proj.weight" in b and "mask_hidden" in b


@pytest.mark.parametrize("bad, message", [
    ("draft.depth=1", "peagle depth must be an integer in [2, 16]"),
    ("draft.depth=40", "peagle depth must be an integer in [2, 16]"),
    ("draft.num_layers=0", "peagle num_layers must be an integer in [1, 8]"),
    ("draft.mask_token_id=100000", "peagle mask_token_id=100000 is outside the target's embedding rows"),
    ("draft.aux_layers=[0,9]", "draft.aux_layers=[0, 9]: each must be a target layer id"),
    ("peagle.down_sample_ratio=0", "peagle.down_sample_ratio must be in (0, 1]"),
    ("draft=eagle3", "methods/peagle/train.py trains draft=peagle heads, not 'eagle3'"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, bad, message):
    base = [a for a in TINY if not a.startswith("draft.")] if bad.startswith("draft=") else TINY
    assert_refused_in_one_line(main, base + [bad], tmp_path, capsys, message)


def test_warm_start_from_another_targets_head_is_refused(tmp_path, capsys):
    from selfspec.methods.eagle3.train import main as eagle3_main

    e3 = tmp_path / "e3"
    eagle3_main(["target=tiny-qwen3", "data=tiny", "data.max_length=96", "train.eval_every=0", "train.eval_prompts=0",
                 "train.max_steps=1", "ttt.steps=1", f"output_dir={e3}"])
    out = tmp_path / "p"
    capsys.readouterr()  # the EAGLE-3 run's own output
    with pytest.raises(SystemExit) as e:
        main(TINY + ["train.max_steps=1", f"draft.init_from={e3 / 'head'}", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and not out.exists(), err
