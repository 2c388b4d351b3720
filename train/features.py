"""What a recipe reads to train: the training set (`training_data`: token ids and loss masks, plus the target's
features read from an offline cache or streamed from a vLLM worker) and the frozen target's teacher signals
(`feature_model`: the target as the loop runs it; `soft_labels`: its distribution over the draft vocabulary). The
feature containers themselves (OfflineFeatures, EngineFeatures, FeatureMemo) are selfspec.data.features."""

from __future__ import annotations

from selfspec.core.cli import read_once
from selfspec.core.errors import UserError
from selfspec.data.config import DataConfig


def feature_model(model, dtype: str):
    """The frozen target as the loop runs it for features and soft labels: itself, or a copy in `dtype`."""
    import copy

    from selfspec.target.model import _dtype

    want = _dtype(dtype, "train.features_dtype")
    if next(model.parameters()).dtype == want:
        return model
    return copy.deepcopy(model).to(want)  # frozen and in eval mode like the original


def training_data(data_cfg, target, accelerator, layers=(), offline_hint: str = ""):
    """The training set every recipe reads, and `token_rows()`: its (input_ids, loss_mask) pairs (for draft
    vocabularies). online: token ids + assistant loss mask (rank 0 tokenises first and fills the datasets cache);
    offline: the same plus the target's features and the residual streams `layers` (hidden_states indices),
    precomputed by scripts/cache_features.py; vllm: the same rows as offline, streamed from a vLLM worker.
    `offline_hint` ends the missing-folder message (e.g. its extra_layers). `data_cfg` (the composed `data.*` or a
    DataConfig) is read once, here: what reads the data below gets a DataConfig."""
    from selfspec.data.features import OfflineFeatures

    data_cfg = read_once(data_cfg, DataConfig)
    if data_cfg.features == "offline":
        if not data_cfg.features_dir:
            raise UserError(f"data.features=offline needs data.features_dir=<folder from scripts/cache_features.py"
                            f"{offline_hint}>")
        train_set = OfflineFeatures(data_cfg.features_dir, target.identity, layers=layers)
        return train_set, train_set.token_rows
    if data_cfg.features in ("online", "vllm"):
        from selfspec.data.tokenize import build_dataset

        if data_cfg.features == "vllm":
            check_vllm_source(data_cfg, target, accelerator)
        with accelerator.main_process_first():
            train_set = build_dataset(data_cfg, target.tokenizer, "train", context=target.context).with_format(None)
        if data_cfg.features == "vllm":
            streamed = vllm_features(data_cfg, target, train_set, layers)
            return streamed, streamed.token_rows
        return train_set, lambda: ((r["input_ids"], r["loss_mask"]) for r in train_set)
    raise UserError(f"data.features must be online, offline or vllm, not '{data_cfg.features}'")


def check_vllm_source(data_cfg, target, accelerator) -> None:
    """data.features=vllm can run here: one process, a vLLM new enough, a target folder vLLM can load, a final norm."""
    from selfspec.target.model import local_folder
    from selfspec.target.vllm_worker import check_vllm_python

    if accelerator.num_processes > 1:
        raise UserError(f"data.features=vllm streams from one vLLM worker: run one process, not "
                        f"{accelerator.num_processes} (or cache the features once: scripts/cache_features.py "
                        "engine=vllm)")
    check_vllm_python(data_cfg.vllm_python)
    if local_folder(target.identity["name_or_path"]) is None:
        raise UserError(f"data.features=vllm: target '{target.identity['name_or_path']}' has no local HF folder for "
                        "vLLM; use an embedded target or a local model folder")
    if getattr(target.model.get_decoder(), "norm", None) is None:
        raise UserError("data.features=vllm needs the target's final norm (its decoder's `norm`): vLLM returns the "
                        "last layer's state without it")


_feature_workers: list = []  # the vLLM workers streaming this process's features (vllm_features)


def close_feature_workers() -> None:
    """Stop the vLLM workers of data.features=vllm: at the end of a run (train.loop.close), else at exit (a
    worker holds a whole engine's memory: a recipe called twice in one process must not keep the first one's)."""
    while _feature_workers:
        _feature_workers.pop().close()


def vllm_features(data_cfg, target, train_set, layers):
    """`train_set` with its features streamed from a vLLM worker that lives until the run ends."""
    import atexit

    from selfspec.target.model import local_folder
    from selfspec.target.vllm_worker import VllmWorker
    from selfspec.data.features import EngineFeatures, engine_layers

    n = target.identity["num_hidden_layers"]
    longest = max((len(r["input_ids"]) for r in train_set), default=1)
    folder = local_folder(target.identity["name_or_path"])
    print(f"[selfspec] data.features=vllm: starting vLLM on {folder} (layers {engine_layers(layers, n)}) ...",
          flush=True)
    worker = VllmWorker(data_cfg.vllm_python, str(folder), max_model_len=longest + 1,
                        layers=engine_layers(layers, n), dtype=str(target.model.dtype).removeprefix("torch."))
    _feature_workers.append(worker)
    atexit.register(close_feature_workers)
    return EngineFeatures(train_set, worker, layers, n, target.model.get_decoder().norm)


def soft_labels(target_model, hidden, draft_vocab=None, argmax=None):
    """The target's next-token distribution from its post-norm features `hidden` [B, T, H], restricted to the
    draft vocabulary (target ids [V_draft], None = all): (p [B, T, V_draft] fp32, inside [B, T] float, 1 where the
    target's argmax is a draft token: only those positions can ever be accepted, so only they are scored).

    Only the draft vocabulary's rows of the lm_head are computed for p. `inside` needs the argmax over the FULL
    vocabulary: pass it as `argmax` [B, T] when known (the feature memo keeps it), else it is computed here, which
    costs the whole lm_head (on SmolLM2, 6x the draft rows' cost and more than the head's own step)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import record_function

    from selfspec.target.model import lm_logits

    # torch.profiler ranges (scripts/profile_step.py), nothing without a profiler
    with torch.no_grad(), record_function("soft labels"):
        h = hidden.to(target_model.dtype)
        if draft_vocab is None:
            full = lm_logits(target_model, h).float()  # [B, T, V]
            return F.softmax(full, dim=-1), torch.ones(full.shape[:-1], device=full.device)
        if argmax is None:
            with record_function("target argmax"):
                argmax = lm_logits(target_model, h).argmax(-1)
        vocab = draft_vocab.to(h.device)
        in_vocab = torch.zeros(target_model.get_output_embeddings().weight.shape[0], dtype=torch.bool, device=h.device)
        in_vocab[vocab] = True
        return F.softmax(lm_logits(target_model, h, rows=vocab).float(), dim=-1), in_vocab[argmax].float()
