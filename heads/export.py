"""Exporting heads to the layouts serving engines load, and reading such exports back.

`convert(record, state, target_config, fmt)` is pure: a selfspec head (its config.json record and state dict)
and the target's HF config in, an `Export` (config.json dict, tensors, extra files, serving hints) out.
`write_export` puts it on disk; `read_export` maps an export back to a selfspec (record, state).

Layouts, with the engine source each one follows (names and shapes checked in tests/hub/test_export.py):

    eagle        original EAGLE / vLLM `method: "eagle"` (vllm/model_executor/models/llama_eagle.py): a Llama config
                 with num_hidden_layers = the head's layers; `fc.weight` [H, 2H], `layers.N.*`; no embed_tokens or
                 lm_head (vLLM then shares the target's), no input_layernorm on layer 0, no final norm.
    speculators  the speculators config format (config.json with speculators_model_type + speculators_config).
                 EAGLE-1: speculators' EagleSpeculatorConfig ("eagle": fusion_fc.*, transformer.*); EAGLE-3:
                 Eagle3SpeculatorConfig ("eagle3": fc, layers.0.*, norm, lm_head, d2t, t2d).
    sglang       SGLang LlamaForCausalLMEagle (python/sglang/srt/models/llama_eagle.py: fc WITH a bias; a reduced
                 vocabulary goes in --speculative-token-map) or LlamaForCausalLMEagle3 (llama_eagle3.py).

What an engine would silently serve wrong is refused here with the reason: vLLM builds the EAGLE-1 fc without a
bias and its weight loader ignores unexpected `.bias` tensors; vLLM's EAGLE-1 model has no draft->target id map.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from heads.errors import UserError

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
RECORD_NAME = "selfspec.json"  # the head's own record, so an export can be read back and traced to its run
TOKEN_MAP_NAME = "hot_token_map.pt"  # SGLang EAGLE-1 reduced vocabulary (--speculative-token-map)
EMBED_STUB = "model.embed_tokens.weight"  # the EAGLE-1 head's unused 1-row embedding; never exported
DEFAULT_SPEC_TOKENS = 5  # speculators_config.proposal_methods[0].speculative_tokens (vLLM's num_speculative_tokens)
# Target families whose decoder layer the engines' EAGLE loaders rebuild (they all use Llama layers).
LLAMA_LIKE = ("llama",)
# Config keys an engine rebuilds the layer from; always written, even where equal to transformers' defaults.
ESSENTIAL = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "hidden_act", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias")


@dataclass
class Export:
    config: dict[str, Any]  # config.json
    tensors: dict[str, torch.Tensor]  # model.safetensors
    files: dict[str, bytes] = field(default_factory=dict)  # other files, by name
    usage: list[str] = field(default_factory=list)  # how to serve it (printed by scripts/export.py)


# ---------------------------------------------------------------------------------------------- shared pieces


def layer_config(target_config, num_layers: int, dtype: torch.dtype, **extra: Any) -> dict[str, Any]:
    """The target's own (text) config with the head's layer count: what the engines build the layer(s) from.
    rope_theta is repeated at the top level for loaders that predate transformers' rope_parameters."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    d = {k: v for k, v in cfg.to_diff_dict().items()
         if not k.startswith("_") and k not in ("transformers_version", "architectures", "dtype", "torch_dtype",
                                                 "auto_map", "quantization_config")}
    for k in ESSENTIAL:  # to_diff_dict drops values equal to defaults; engines may build another class's defaults
        if getattr(cfg, k, None) is not None:
            d.setdefault(k, getattr(cfg, k))
    d["model_type"] = cfg.model_type
    d["num_hidden_layers"] = num_layers
    rope = d.get("rope_parameters") or getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        d.setdefault("rope_parameters", rope)
        d["rope_theta"] = rope["rope_theta"]
    d["torch_dtype"] = str(dtype).removeprefix("torch.")
    d.update(extra)
    return d


def verifier_id(record: dict[str, Any]) -> str:
    """The target as engines name it: the Hub id of an embedded target, else what the head recorded."""
    from heads.hub import target_hub_id

    return target_hub_id(record["target"]) or str(record["target"]["name_or_path"])


def _eagle1_layers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """selfspec EAGLE-1 state -> EAGLE layout: `model.` prefix dropped, the embedding stub and draft_vocab left out."""
    out = {}
    for k, v in state.items():
        if k in (EMBED_STUB, "draft_vocab"):
            continue
        out[k.removeprefix("model.")] = v
    return out


def _check_eagle1(record: dict[str, Any], fmt: str, engine: str) -> None:
    model_type = record["target"].get("model_type")
    if model_type not in LLAMA_LIKE:
        raise UserError(f"format={fmt}: {engine}'s EAGLE loaders rebuild Llama decoder layers; this head's layer is "
                        f"a '{model_type}' layer and would be served wrong (only {', '.join(LLAMA_LIKE)} targets export)")


def _refuse_vllm_eagle1(record: dict[str, Any], fmt: str) -> None:
    head = record["head"]
    if head.get("fc_bias"):
        raise UserError(f"format={fmt} refused: this head has an fc bias, and vLLM builds the EAGLE fc without one and "
                        "silently drops `fc.bias` (llama_eagle.py fc bias=False; AutoWeightsLoader ignores unexpected "
                        "'.bias'), so it would serve a different head; retrain with draft.fc_bias=false, or use format=sglang")
    if head.get("vocab_size"):
        raise UserError(f"format={fmt} refused: this head drafts over a reduced vocabulary ({head['vocab_size']} tokens) "
                        "and vLLM's EAGLE-1 model (llama_eagle.py) has no draft->target id map; retrain with "
                        "draft.vocab_size=null, or use format=sglang (it takes the map as --speculative-token-map)")


def _proposal(spec_tokens: int) -> dict[str, Any]:
    return {"proposal_type": "greedy", "speculative_tokens": spec_tokens, "verifier_accept_k": 1,
            "accept_tolerance": 0.0}


def _speculators_block(record: dict[str, Any], target_config, algorithm: str, spec_tokens: int) -> dict[str, Any]:
    return {"algorithm": algorithm, "proposal_methods": [_proposal(spec_tokens)], "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_id(record), "architectures": _architectures(target_config)}}


def _architectures(target_config) -> list[str]:
    """The verifier's architectures as its config.json names them (a config built in code has none: its class's)."""
    if getattr(target_config, "architectures", None):
        return list(target_config.architectures)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(target_config), None)
    return [cls.__name__] if cls is not None else []


def _float_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    return next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)


# ---------------------------------------------------------------------------------------------- EAGLE-3 pieces


def _eagle3_tensors(record: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """selfspec EAGLE-3 state -> the layout vLLM, SGLang and speculators share: fc.weight [H, k*H], layers.0.*
    (q/k/v over 2H, hidden_norm), norm.weight, lm_head.weight [draft_vocab, H], d2t [draft_vocab] long
    (target id = draft id + d2t[draft id]) and t2d [target_vocab] bool when the vocabulary is reduced."""
    target_vocab = int(record["target"]["vocab_size"])
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        k = k.removeprefix("model.")
        if k in ("embed_tokens.weight", "draft_vocab"):  # the target's embedding is shared; the map is rebuilt below
            continue
        out[k] = v
    missing = [k for k in ("fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight") if k not in out]
    if missing:
        raise UserError(f"this eagle3 head lacks {', '.join(missing)}; re-save it with the current selfspec")
    draft_vocab = state.get("draft_vocab")
    if draft_vocab is None and "d2t" in out:
        draft_vocab = out["d2t"] + torch.arange(out["d2t"].numel())
    if draft_vocab is not None and torch.equal(draft_vocab.cpu(), torch.arange(target_vocab)):
        out.pop("d2t", None), out.pop("t2d", None)  # the full vocabulary: vLLM then builds no map and refuses one
        draft_vocab = None
    if draft_vocab is not None:
        draft_vocab = draft_vocab.to(torch.long)
        out["d2t"] = draft_vocab - torch.arange(draft_vocab.numel())
        t2d = torch.zeros(target_vocab, dtype=torch.bool)
        t2d[draft_vocab] = True
        out["t2d"] = t2d
    rows = out["lm_head.weight"].shape[0]
    if draft_vocab is not None and rows != draft_vocab.numel():
        raise UserError(f"eagle3 head: lm_head has {rows} rows but the draft vocabulary {draft_vocab.numel()} ids")
    return out


def _aux_layers(record: dict[str, Any], fmt: str) -> list[int]:
    """HF output_hidden_states ids (heads/eagle3.py), the convention of eagle_aux_hidden_state_layer_ids too."""
    ids = record["head"].get("aux_layers")
    if not ids:
        raise UserError(f"format={fmt}: the eagle3 head record has no 'aux_layers' (the target layers it reads); "
                        "engines would guess them; re-save the head with the current selfspec")
    return [int(i) for i in ids]


# ---------------------------------------------------------------------------------------------- converters


def to_eagle(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """Original EAGLE / vLLM `method: "eagle"` layout."""
    head = record["head"]
    if head["type"] != "eagle":
        raise UserError(f"format=eagle is the EAGLE-1 layout; a '{head['type']}' head exports as format=speculators or sglang")
    _check_eagle1(record, "eagle", "vLLM")
    _refuse_vllm_eagle1(record, "eagle")
    tensors = _eagle1_layers(state)
    # vLLM rewrites LlamaForCausalLM -> EagleLlamaForCausalLM (transformers_utils/configs/eagle.py).
    config = layer_config(target_config, head.get("num_layers", 1), _float_dtype(state), architectures=["LlamaForCausalLM"])
    usage = [f'vllm.LLM(model="{verifier_id(record)}", speculative_config={{"method": "eagle", "model": "<out>", '
             f'"num_speculative_tokens": {spec_tokens}}})']
    return Export(config, tensors, usage=usage)


def to_speculators(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """The speculators format (`vllm serve <out>` reads method and verifier from it)."""
    head = record["head"]
    dtype = _float_dtype(state)
    if head["type"] == "eagle":
        _check_eagle1(record, "speculators", "speculators")
        _refuse_vllm_eagle1(record, "speculators")
        if head.get("num_layers", 1) != 1:
            raise UserError("format=speculators: speculators' EagleSpeculator holds one decoder layer; this head has "
                            f"{head['num_layers']}: use format=eagle")
        # speculators src/speculators/models/eagle.py: EagleSpeculator(fusion_fc, transformer, no layernorms).
        tensors = {}
        for k, v in _eagle1_layers(state).items():
            tensors["fusion_fc." + k[3:] if k.startswith("fc.") else "transformer." + k.removeprefix("layers.0.")] = v
        config = {
            "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
            "speculators_model_type": "eagle",
            "transformer_layer_architecture": "LlamaDecoderLayer",
            "transformer_layer_config": layer_config(target_config, 1, dtype),
            "layernorms": False,  # EAGLE-1/2: no embedding/pre-lm_head norms, no input norm on the layer
            "fusion_bias": False,
            "speculators_config": _speculators_block(record, target_config, "eagle", spec_tokens),
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        usage = ["speculators' EAGLE-1 type ('eagle') for speculators-aware tools; vLLM 0.32 reads only eagle3 (and "
                 "newer) speculators types: serve EAGLE-1 heads in vLLM with format=eagle"]
        return Export(config, tensors, usage=usage)
    if head["type"] == "eagle3":
        if record["target"].get("model_type") not in ("llama", "qwen3"):  # vLLM algos.py eagle3_arch_map
            raise UserError(f"format=speculators: vLLM serves EAGLE-3 heads of llama and qwen3 targets only, not "
                            f"'{record['target'].get('model_type')}'")
        tensors = _eagle3_tensors(record, state)
        hidden = int(record["target"]["hidden_size"])
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_config(target_config, 1, dtype, tie_word_embeddings=False),
            "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]),
            # Set explicitly: vLLM defaults it to True, speculators to False (REFERENCE.md).
            "norm_before_residual": bool(head.get("norm_before_residual", False)),
            "target_hidden_size": hidden if tensors["fc.weight"].shape[0] != hidden else None,
            "eagle_aux_hidden_state_layer_ids": _aux_layers(record, "speculators"),
            "speculators_config": _speculators_block(record, target_config, "eagle3", spec_tokens),
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        return Export(config, tensors, usage=[f"vllm serve <out>   (verifier {verifier_id(record)} and "
                                               f"{spec_tokens} speculative tokens are read from config.json)"])
    raise UserError(f"format=speculators does not know head type '{head['type']}' (known: eagle, eagle3)")


def to_sglang(record, state, target_config, spec_tokens: int = DEFAULT_SPEC_TOKENS) -> Export:
    """SGLang's EAGLE (LlamaForCausalLMEagle) or EAGLE-3 (LlamaForCausalLMEagle3) draft model folder."""
    head = record["head"]
    dtype = _float_dtype(state)
    base = verifier_id(record)
    flags = (f"--speculative-num-steps {spec_tokens} --speculative-eagle-topk 1 "
             f"--speculative-num-draft-tokens {spec_tokens + 1}")
    if head["type"] == "eagle":
        _check_eagle1(record, "sglang", "SGLang")
        tensors = _eagle1_layers(state)
        if "fc.bias" not in tensors:  # SGLang's fc is nn.Linear(2H, H) WITH a bias: give it the zeros we trained with
            w = tensors["fc.weight"]
            tensors["fc.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
        # tie_word_embeddings false: SGLang replaces embed_tokens and lm_head with the target's (set_embed_and_head),
        # which needs them to be two modules.
        config = layer_config(target_config, head.get("num_layers", 1), dtype, architectures=["LlamaForCausalLMEagle"],
                              tie_word_embeddings=False)
        files, usage = {}, [f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE "
                            f"--speculative-draft-model-path <out> {flags}"]
        if "draft_vocab" in state:
            # spec_utils.load_token_map: torch.load(weights_only=True) of the target ids, draft id i -> ids[i]
            buf = io.BytesIO()
            torch.save(state["draft_vocab"].to(torch.long).tolist(), buf)
            files[TOKEN_MAP_NAME] = buf.getvalue()
            usage[0] += f" --speculative-token-map <out>/{TOKEN_MAP_NAME}"
        return Export(config, tensors, files, usage)
    if head["type"] == "eagle3":
        _check_eagle1(record, "sglang", "SGLang")  # llama_eagle3.py builds Llama layers too
        if head.get("norm_before_residual"):
            raise UserError("format=sglang refused: SGLang's EAGLE-3 layer keeps the un-normed residual "
                            "(norm_before_residual=false) and this head was trained with it true; use format=speculators")
        tensors = _eagle3_tensors(record, state)
        extra = {"architectures": ["LlamaForCausalLMEagle3"], "tie_word_embeddings": False,
                 "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]),
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": _aux_layers(record, "sglang")}}
        config = layer_config(target_config, 1, dtype, **extra)
        return Export(config, tensors, usage=[f"python -m sglang.launch_server --model-path {base} "
                                               f"--speculative-algorithm EAGLE3 --speculative-draft-model-path <out> {flags}"])
    raise UserError(f"format=sglang does not know head type '{head['type']}' (known: eagle, eagle3)")


FORMATS: dict[str, Callable[..., Export]] = {"eagle": to_eagle, "speculators": to_speculators, "sglang": to_sglang}


def convert(record: dict[str, Any], state: dict[str, torch.Tensor], target_config, fmt: str,
            spec_tokens: int = DEFAULT_SPEC_TOKENS, dtype: Optional[torch.dtype] = None) -> Export:
    """Pick the converter; `dtype` casts floating tensors (e.g. bfloat16 halves the files)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format '{fmt}'; use one of {', '.join(FORMATS)}")
    check_target_config(record, target_config)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return FORMATS[fmt](record, state, target_config, spec_tokens=spec_tokens)


def check_target_config(record: dict[str, Any], target_config) -> None:
    """The config the export copies must be the one the head was trained for (shapes; the fingerprint needs weights)."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    rec = record["target"]
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if key in rec and rec[key] is not None and getattr(cfg, key, None) != rec[key]:
            raise UserError(f"target config {key}={getattr(cfg, key, None)} but the head was trained for "
                            f"'{rec.get('name_or_path')}' with {key}={rec[key]}")


# ---------------------------------------------------------------------------------------------- disk


def write_export(export: Export, record: dict[str, Any], out: str | Path) -> Path:
    """config.json + model.safetensors + extra files + selfspec.json (the source record) into `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / CONFIG_NAME).exists():
        raise UserError(f"out folder '{out}' is not empty and holds no export; pass a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in export.tensors.items()}, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(export.config, indent=2) + "\n")
    for name, data in export.files.items():
        (out / name).write_bytes(data)
    (out / RECORD_NAME).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return out


def read_export(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An EAGLE-1 export (any of the three layouts) back to a selfspec (record, state). The record comes from
    selfspec.json; the embedding stub is restored (zeros: it is never read) and SGLang's zero fc bias dropped."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / RECORD_NAME).exists():
        raise UserError(f"'{folder}' has no {RECORD_NAME}: only exports written by selfspec can be read back")
    record = json.loads((folder / RECORD_NAME).read_text())
    config = json.loads((folder / CONFIG_NAME).read_text())
    tensors = load_file(str(folder / WEIGHTS_NAME))
    if record["head"]["type"] == "eagle3":  # the engines' EAGLE-3 keys are selfspec's own
        return record, _eagle3_back(record, tensors)
    if record["head"]["type"] != "eagle":
        raise UserError(f"reading back '{record['head']['type']}' exports is not supported")
    state: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        if k.startswith("fusion_fc."):
            k = "fc." + k.removeprefix("fusion_fc.")
        elif k.startswith("transformer."):
            k = "layers.0." + k.removeprefix("transformer.")
        state[k if k.startswith("fc.") else "model." + k] = v
    if not record["head"].get("fc_bias") and "fc.bias" in state:
        if torch.count_nonzero(state["fc.bias"]):
            raise UserError(f"'{folder}': fc.bias is non-zero but the head was recorded without a bias")
        del state["fc.bias"]
    hidden = int((config.get("transformer_layer_config") or config)["hidden_size"])
    state[EMBED_STUB] = torch.zeros(1, hidden, dtype=state["fc.weight"].dtype)
    if (folder / TOKEN_MAP_NAME).exists():
        state["draft_vocab"] = torch.tensor(torch.load(folder / TOKEN_MAP_NAME, weights_only=True), dtype=torch.long)
    return record, state


def _eagle3_back(record: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Restore the identity map an export of a full-vocabulary EAGLE-3 head leaves out."""
    state = dict(tensors)
    if "d2t" not in state:
        vocab = int(record["target"]["vocab_size"])
        state["d2t"] = torch.zeros(vocab, dtype=torch.long)
        state["t2d"] = torch.ones(vocab, dtype=torch.bool)
    return state
