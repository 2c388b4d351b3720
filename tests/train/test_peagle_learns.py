"""P-EAGLE's mask slots can learn: on token chains where the anchor's next token fixes every later one, the slots'
top-1 approaches the anchor's within a few hundred steps of methods/peagle/train.py's own loss. A slot sees no token
and no hidden state of its own, only the real pairs before it (heads/peagle.parallel_layout); if that read were broken,
the slots would stay near the majority-token rate (~0.07 here) whatever the anchor learns."""

import torch

from selfspec.target.model import load_target
from selfspec.methods.peagle.head import build_peagle
from selfspec.methods.peagle.train import PEagleLossConfig, parallel_loss

CHAIN = 16  # tokens 3..18, each followed by one fixed other


def _chains(lookup: torch.Tensor, g: torch.Generator, b: int = 8, t: int = 24) -> dict:
    x = torch.empty(b, t, dtype=torch.long)
    x[:, 0] = torch.randint(0, CHAIN, (b,), generator=g) + 3
    for i in range(1, t):
        x[:, i] = lookup[x[:, i - 1]]
    ones = torch.ones(b, t, dtype=torch.long)
    return {"input_ids": x, "attention_mask": ones, "loss_mask": ones}


def test_mask_slots_learn_what_the_anchor_makes_predictable():
    torch.manual_seed(0)
    target = load_target("tiny:llama", tiny={"num_hidden_layers": 2})
    lookup = torch.zeros(target.model.config.vocab_size, dtype=torch.long)
    lookup[torch.arange(CHAIN) + 3] = torch.randperm(CHAIN) + 3
    g = torch.Generator().manual_seed(0)
    head = build_peagle(target.model, depth=3)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    cod = PEagleLossConfig(down_sample_ratio=0.7, down_sample_ratio_min=0.2, decay=0.8)
    for _ in range(200):
        loss, _ = parallel_loss(head, head, target.model, _chains(lookup, g), cod)
        opt.zero_grad()
        loss.backward()
        opt.step()
    batch = _chains(lookup, g, b=16)
    with torch.no_grad():  # every anchor at every depth
        _, stats = parallel_loss(head, head, target.model, batch, PEagleLossConfig(1.0, 1.0, 0.8))
        labels = target.model(batch["input_ids"]).logits.argmax(-1)
    majority = labels.unique(return_counts=True)[1].max().item() / labels.numel()
    anchor, slots = stats["acc_0"], [stats["acc_1"], stats["acc_2"]]
    assert majority < 0.1 and anchor > 0.4, (majority, stats)
    assert all(s > 0.5 * anchor and s > 4 * majority for s in slots), (majority, stats)
