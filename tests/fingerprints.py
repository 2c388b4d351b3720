"""The target fingerprint as selfspec computed it before issue 63 (target/model.py identity_of then): the first 16
embedding rows rounded to bf16, hashed with the shapes. Heads, runs and features caches recorded then (the shipped
heads among them) hold it; the tests check they still match their own target and no other."""

import hashlib

import torch


def fingerprint_before_issue_63(target) -> str:
    cfg, emb = target.model.config, target.model.get_input_embeddings().weight
    probe = emb[:16].detach().float().to(torch.bfloat16).view(torch.int16)
    shape = f"{cfg.model_type}:{cfg.hidden_size}:{emb.shape[0]}:{cfg.num_hidden_layers}:".encode()
    return hashlib.sha256(shape + probe.numpy().tobytes()).hexdigest()[:16]
