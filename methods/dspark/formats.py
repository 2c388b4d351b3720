"""DSpark heads (head.py) out to the layouts engines load, and DSpark checkpoints of other trainers in: DFlash's
layouts (methods/dflash/formats.py, which writes and reads the body) plus the two heads' tensors and the keys that
say the block is read anchor-first.

The heads' tensor names are speculators' (models/dspark/model_definitions.py) in every folder layout, selfspec's
included: `markov_head.markov_w1.weight` [V_target, r], `markov_head.markov_w2.weight` [V_draft, r],
`confidence_head.proj.{weight [1, H + r], bias [1]}`.

    speculators  DFlash's config with speculators_model_type "dspark", architectures ["DSparkSpeculator"],
                 sample_from_anchor true, markov_rank, markov_head_type "vanilla", enable_confidence_head,
                 confidence_head_with_markov true (speculators' DSparkSpeculatorConfig, models/dspark/config.py), and
                 block_size speculative tokens. vLLM serves it with its `dspark` method.
    sglang       DFlash's z-lab folder with architectures ["DSparkDraftModel"] and the same DSpark keys: what
                 llama.cpp's converter reads (conversion/qwen.py DSparkModel: sample_from_anchor from the config,
                 markov_head_type "vanilla" only, has_confidence_head from the tensors' names).
    gguf         llama.cpp 11434's `dflash` draft with markov_w1, markov_w2 and conf_proj.{weight,bias}
                 (src/models/dflash.cpp load_arch_tensors: a draft holding markov_w1 is DSpark) and
                 dflash.sample_from_anchor / dflash.has_confidence_head, in the order the converter writes them;
                 `llama-server -md head.gguf --spec-type draft-dspark`.

Refused as DFlash's are (a reduced draft vocabulary, another hidden size, a RoPE llama.cpp computes otherwise), and
on import: a Markov head other than "vanilla", a block not read anchor-first, a confidence head without the Markov
features.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from selfspec.core.errors import UserError
from selfspec.methods.dflash import formats as dflash
from selfspec.publish.formats.base import Export, GGUFExport, gguf_qtype, gguf_tensor, speculators_block

ZLAB_ARCH = "DSparkDraftModel"  # llama.cpp's converter is registered under it (conversion/qwen.py DSparkModel)
SPECULATORS_ARCH = "DSparkSpeculator"  # speculators DSparkSpeculatorConfig's default architectures
# the two heads' tensors: selfspec / speculators name -> llama.cpp GGUF name (gguf-py tensor_mapping.py, with the
# converter's "model." prefix)
GGUF_OWN = {"markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
            "confidence_head.proj.weight": "conf_proj.weight", "confidence_head.proj.bias": "conf_proj.bias"}


def _split(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(DFlash's body, the two heads' tensors)."""
    return ({k: v for k, v in state.items() if k not in GGUF_OWN},
            {k: v for k, v in state.items() if k in GGUF_OWN})


def _keys(record: dict[str, Any], own: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The DSpark keys of a speculators or z-lab config."""
    return {"sample_from_anchor": True, "markov_rank": int(record["head"]["markov_rank"]),
            "markov_head_type": "vanilla", "enable_confidence_head": "confidence_head.proj.weight" in own,
            "confidence_head_with_markov": True}


def _with_heads(tensors: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**tensors, **{k: v.to(next(iter(tensors.values())).dtype) for k, v in own.items()}}


def to_speculators(record, state, target_config, spec_tokens: Optional[int] = None) -> Export:
    """speculators' DSpark config format (`vllm serve <out>`); a pass drafts block_size tokens, whatever
    `spec_tokens` says."""
    body, own = _split(state)
    out = dflash.to_speculators(record, body, target_config)
    block = int(record["head"]["block_size"])
    out.config.update({"architectures": [SPECULATORS_ARCH], "speculators_model_type": "dspark", **_keys(record, own),
                       "speculators_config": speculators_block(record, target_config, "dspark", block)})
    out.tensors = _with_heads(out.tensors, own)
    out.usage = [u.replace('"method": "dflash"', '"method": "dspark"').replace(
        f'"num_speculative_tokens": {block - 1}', f'"num_speculative_tokens": {block}') for u in out.usage]
    return out


def to_sglang(record, state, target_config, spec_tokens: Optional[int] = None) -> Export:
    """The z-lab-style DSparkDraftModel folder llama.cpp's convert_hf_to_gguf.py converts (--target-model-dir)."""
    body, own = _split(state)
    out = dflash.to_sglang(record, body, target_config)
    out.config.update({"architectures": [ZLAB_ARCH], **_keys(record, own)})
    out.tensors = _with_heads(out.tensors, own)
    out.usage = [f"llama.cpp: convert_hf_to_gguf.py <out> --target-model-dir <target folder> (or format=gguf), "
                 f"then llama-server -m <target.gguf> -md <draft.gguf> --spec-type draft-dspark --spec-draft-n-max "
                 f"{int(record['head']['block_size'])}"]
    return out


def to_gguf(record: dict[str, Any], state: dict[str, torch.Tensor], target_config, outtype: str = "f32") -> GGUFExport:
    """DFlash's GGUF of the body, the two heads' tensors where the converter puts them (its tensors follow the
    export's safetensors keys sorted by name), and its two DSpark keys after the DFlash ones it writes."""
    body, own = _split(state)
    if "markov_head.markov_w1.weight" not in own:
        raise UserError("format=gguf: this dspark state has no markov_head.markov_w1.weight (llama.cpp reads a draft "
                        "without it as DFlash)")
    out = dflash.to_gguf(record, body, target_config, outtype)
    qtype = gguf_qtype(outtype)
    gguf_of = {**{k: dflash.gguf_name(k) for k in body if dflash.gguf_name(k) in out.tensors}, **GGUF_OWN}
    written = {}
    for name in [n for n in out.tensors if n not in gguf_of.values()]:  # generated ones first (rope_freqs)
        written[name] = out.tensors[name]
    for key in sorted(gguf_of):
        if key in own:
            data = own[key].detach().to(torch.float32).cpu().contiguous().numpy()
            # conversion/base.py: 1-D tensors stay F32 whatever --outtype says (conf_proj.bias)
            written[GGUF_OWN[key]] = _quantized(data, gguf_qtype("f32") if data.ndim <= 1 else qtype)
        elif gguf_of[key] in out.tensors:
            written[gguf_of[key]] = out.tensors[gguf_of[key]]
    a = dflash.GGUF_ARCH
    extra = [(f"{a}.sample_from_anchor", True, "BOOL", None),
             (f"{a}.has_confidence_head", "confidence_head.proj.weight" in own, "BOOL", None)]
    at = next(i for i, k in enumerate(out.kv) if k[0] == f"{a}.target_layers") + 1
    kv = [("general.name", f"{k[1]}".replace("DFlash draft", "DSpark draft"), *k[2:]) if k[0] == "general.name"
          else k for k in out.kv[:at]] + extra + out.kv[at:]
    block = int(record["head"]["block_size"])
    usage = [f"llama-server -m <target.gguf> -md <out> --spec-type draft-dspark --spec-draft-n-max {block} "
             "[--spec-draft-p-min P: stop at the first slot whose confidence is below P]"] + out.usage[1:]
    return GGUFExport(out.arch, kv, written, usage)


def _quantized(data, qtype) -> tuple[Any, str]:
    """gguf_tensor, and where the rows do not divide into the type's blocks (q8_0's 32: a Markov rank of 8, a
    confidence row of H + r) F16, as conversion/base.py falls back on gguf.QuantError."""
    from gguf import GGMLQuantizationType, QuantError

    try:
        return gguf_tensor(data, qtype)
    except QuantError:
        return gguf_tensor(data, GGMLQuantizationType.F16)


def read_back(record: dict[str, Any], tensors: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """An export of ours (speculators or sglang) -> the selfspec state: the names are the same."""
    return dict(tensors)


def detect(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """A z-lab-style DSpark folder: its config says so, or it holds a Markov head; tried before DFlash (whose tensors
    it holds too). A speculators folder is layout=speculators, whatever its tensors."""
    return "speculators_model_type" not in cfg and (
        ZLAB_ARCH in (cfg.get("architectures") or [])
        or any(k.removeprefix("model.") == "markov_head.markov_w1.weight" for k in tensors))


def import_zlab(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """layout=dspark: a z-lab-style DSparkDraftModel folder (dflash_config.target_layer_ids as they are)."""
    return _import("dflash", cfg, tensors, target, aux_layers, src)


def import_speculators(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """layout=speculators, speculators_model_type dspark (DSparkSpeculatorConfig; aux ids = hidden_states ids)."""
    return _import("speculators", cfg, tensors, target, aux_layers, src)


def _import(layout: str, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """A DSpark checkpoint -> (selfspec head config, state): the body as DFlash's importer reads it, then the two
    heads, checked against what selfspec's head computes."""
    if cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise UserError(f"'{src}': markov_head_type {cfg['markov_head_type']!r}; selfspec's DSpark head (and "
                        "llama.cpp's) computes the vanilla Markov bias only")
    if cfg.get("sample_from_anchor", True) is not True:
        raise UserError(f"'{src}' was trained with sample_from_anchor=false (the anchor slot drafts nothing); "
                        "selfspec's DSpark head drafts from the anchor's slot too")
    if all(k.startswith("model.") for k in tensors):  # a wrapper's prefix
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    body, own = _split(tensors)
    w1 = own.get("markov_head.markov_w1.weight")
    if w1 is None or "markov_head.markov_w2.weight" not in own:
        raise UserError(f"'{src}' has no Markov head (markov_head.markov_w1/markov_w2): import it as a DFlash head")
    conf = own.get("confidence_head.proj.weight")
    if conf is not None and not cfg.get("confidence_head_with_markov", True):
        raise UserError(f"'{src}': its confidence head reads the hidden state alone; selfspec's (and llama.cpp's) "
                        "reads it with the Markov embedding")
    head_cfg, state = dflash._import(layout, {k: v for k, v in cfg.items() if k != "sample_from_anchor"}, body,
                                     target, aux_layers, src)
    head_cfg.update(type="dspark", markov_rank=int(w1.shape[-1]), confidence_head=conf is not None)
    return head_cfg, {**state, **own}


EXPORTERS = {"speculators": to_speculators, "sglang": to_sglang, "gguf": to_gguf}
IMPORTERS = {"dspark": import_zlab, "speculators": import_speculators}
