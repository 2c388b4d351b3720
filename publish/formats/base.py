"""What every head type's exports and imports share (each method's methods/<name>/formats.py uses it;
publish/formats/__init__.py gathers those modules from the registry).

    Export, GGUFExport     what a converter returns: an export folder's files, or a GGUF file's keys and tensors
    layer_config, ...      the engines' layer config from the target's, the verifier's name, the speculators block
    write_export,          an export folder on disk (atomic, under core/ownership.py's rule) and its record and
    read_export_folder     weights read back (each head type maps the weights back to its own state)
    write_gguf, diff_gguf  a GGUF file on disk, with the tokenizer copied from the target's GGUF; two compared
    gguf_rope              a draft layer's RoPE as the GGUF keys and rope_freqs tensor llama.cpp reads (the
                           GGUF writers of the head types llama.cpp drafts with)
    check_dims, ...        checks an importer of another trainer's checkpoint runs whatever the head type
    config_int, ...        values of another trainer's config.json read as what they must be, or one line
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from selfspec.core.atomic import save_tensors, with_errno
from selfspec.core.errors import UserError, reading
from selfspec.core.ownership import Kind, check_output, owned_dir, owned_path
from selfspec.heads.checkpoint import DIGEST_KEY
from selfspec.heads.layers import llama_layers_config, recorded_layer

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
RECORD_NAME = "selfspec.json"  # the head's own record, so an export can be read back and traced to its run
TOKEN_MAP_NAME = "hot_token_map.pt"  # SGLang EAGLE-1 reduced vocabulary (--speculative-token-map)
DEFAULT_SPEC_TOKENS = 5  # speculators_config.proposal_methods[0].speculative_tokens (vLLM's num_speculative_tokens)
# Target families whose own decoder layer is the Llama layer the engines' EAGLE loaders build: a layer=target head
# of theirs exports (other families' heads export when trained with layer=llama).
LLAMA_LIKE = ("llama",)
# A Llama layer's weights (speculators names, EAGLE-3's hidden_norm included): what an engine's draft layer holds.
LLAMA_LAYER_KEYS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                    *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
# Config keys an engine rebuilds the layer from; always written, even where equal to transformers' defaults.
ESSENTIAL = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "hidden_act", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
             "mlp_bias")

GGUF_TYPES = ("f32", "bf16", "q8_0")  # --outtype values of the converter that this writer reproduces
GGUF_FILE_TYPE = {"f32": 0, "bf16": 32, "q8_0": 7}  # gguf LlamaFileType: ALL_F32, MOSTLY_BF16, MOSTLY_Q8_0


@dataclass
class Export:
    config: dict[str, Any]  # config.json
    tensors: dict[str, torch.Tensor]  # model.safetensors
    files: dict[str, bytes] = field(default_factory=dict)  # other files, by name
    usage: list[str] = field(default_factory=list)  # how to serve it (printed by scripts/export.py)


@dataclass
class GGUFExport:
    arch: str  # general.architecture: the llama.cpp draft type (the method's name)
    kv: list[tuple[str, Any, str, Optional[str]]]  # (key, value, GGUFValueType name, array item type name)
    # GGUF name -> (numpy array in torch's [out, in] order, GGMLQuantizationType name)
    tensors: dict[str, tuple[Any, str]]
    usage: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- layers and config


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


def layer_source(record: dict[str, Any], target_config):
    """The config an export describes the head's decoder layer with: the target's own for a layer=target head or a
    Llama target (so their exports stay byte for byte what they were), else the LlamaConfig the layer=llama head was
    built from, with the target's vocabulary size (what engines size their embedding and lm_head by)."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    if recorded_layer(record["head"]) == "target" or cfg.model_type in LLAMA_LIKE:
        return target_config
    return llama_layers_config(target_config, int(record["head"].get("num_layers") or 1), vocab_size=cfg.vocab_size)


def verifier_id(record: dict[str, Any]) -> str:
    """The target as engines name it: the Hub id of an embedded target, else what the head recorded."""
    from selfspec.publish.card import target_hub_id

    return target_hub_id(record["target"]) or str(record["target"]["name_or_path"])


def check_llama_layer(record: dict[str, Any], state: dict[str, torch.Tensor], fmt: str, engine: str) -> None:
    """A layer=target head of a non-Llama family has no layer the engine can build: refused, with what it lacks."""
    model_type = record["target"].get("model_type")
    if model_type in LLAMA_LIKE or recorded_layer(record["head"]) == "llama":
        return
    own = sorted({k.split("layers.0.", 1)[1] for k in state if "layers.0." in k} - set(LLAMA_LAYER_KEYS))
    lacks = f"a place for {', '.join(own)}" if own else f"the '{model_type}' layer's own activation, scales or norms"
    raise UserError(f"format={fmt}: {engine}'s EAGLE loaders rebuild Llama decoder layers; this head's layer is the "
                    f"target family's '{model_type}' layer (head layer=target) and would be served wrong ({engine}'s "
                    f"Llama layer lacks {lacks}): retrain it with draft.layer=llama (the default)")


def sglang_flags(spec_tokens: int) -> str:
    """SGLang's launch flags for a chain of `spec_tokens` drafts (one draft per step, the root verified too)."""
    return (f"--speculative-num-steps {spec_tokens} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {spec_tokens + 1}")


def float_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    return next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)


def check_target_config(record: dict[str, Any], target_config) -> None:
    """The config the export copies (RoPE, norms, sizes) must be the one the head was trained for: its model type and
    shapes (the fingerprint needs weights), from a complete recorded identity."""
    from selfspec.target.model import check_recorded_identity

    check_recorded_identity(record["target"])
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    rec = record["target"]
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if key in rec and rec[key] is not None and getattr(cfg, key, None) != rec[key]:
            raise UserError(f"target config {key}={getattr(cfg, key, None)} but the head was trained for "
                            f"'{rec.get('name_or_path')}' with {key}={rec[key]}: the export would copy another "
                            "target's settings (RoPE, norms); export it with the target it was trained for")


# ---------------------------------------------------------------------------------------------- speculators config


def _proposal(spec_tokens: int) -> dict[str, Any]:
    return {"proposal_type": "greedy", "speculative_tokens": spec_tokens, "verifier_accept_k": 1,
            "accept_tolerance": 0.0}


def speculators_block(record: dict[str, Any], target_config, algorithm: str, spec_tokens: int) -> dict[str, Any]:
    return {"algorithm": algorithm, "proposal_methods": [_proposal(spec_tokens)], "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_id(record), "architectures": _architectures(target_config)}}


def _architectures(target_config) -> list[str]:
    """The verifier's architectures as its config.json names them (a config built in code has none: its class's)."""
    if getattr(target_config, "architectures", None):
        return list(target_config.architectures)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(target_config), None)
    return [cls.__name__] if cls is not None else []


def is_speculators(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """A speculators folder (its config names the type; EAGLE-1's tensors are speculators' own names)."""
    return "speculators_model_type" in cfg or any(k.startswith("fusion_fc.") for k in tensors)


# ---------------------------------------------------------------------------------------------- disk


def _export_files(folder: Path) -> Optional[list[str]]:
    """An export written before exports carried an owner file: its selfspec.json record proves it (core/ownership)."""
    record = json.loads((folder / RECORD_NAME).read_text())
    if isinstance(record, dict) and record.get("library") == "selfspec":
        return [CONFIG_NAME, WEIGHTS_NAME, RECORD_NAME, TOKEN_MAP_NAME]
    return None


def _gguf_of_selfspec(path: Path) -> bool:
    """A GGUF write_gguf wrote: its general.name says so."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.name")
    return field is not None and str(field.contents()).endswith("(selfspec)")


EXPORT_KIND = Kind("export", folder=True, mine=_export_files)
GGUF_KIND = Kind("GGUF draft", folder=False, mine=_gguf_of_selfspec)


def write_export(export: Export, record: dict[str, Any], out: str | Path, overwrite: bool = False,
                 inputs=()) -> Path:
    """config.json + model.safetensors + extra files + selfspec.json (the source record) into `out`, built in a
    temp folder beside it and swapped in whole (selfspec.core.ownership.owned_dir: only over an export of ours,
    never over the user's files or an input; one writer at a time): a failed or killed export leaves the old
    folder (or none), never half of one. `export` comes from `convert`, which has checked everything already."""
    out = Path(out)
    check_output(out, "out", EXPORT_KIND, overwrite, inputs)
    bad = [k for k, v in export.tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise UserError(f"refusing to export: {', '.join(bad)} hold NaN or inf")
    with owned_dir(out, "out", EXPORT_KIND, overwrite, inputs) as tmp:
        save_tensors({k: v.contiguous() for k, v in export.tensors.items()}, tmp / WEIGHTS_NAME,
                     metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(export.config, indent=2) + "\n")
        for name, data in export.files.items():
            (tmp / name).write_bytes(data)
        # the record without the digest of selfspec's weights: the files beside it hold them in an engine's layout
        record = {k: v for k, v in record.items() if k != DIGEST_KEY}
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return out


def read_export_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An export folder selfspec wrote -> (its selfspec.json record, its weights as the engine's layout names them);
    the head type's reader (publish/formats READERS) maps the weights back to a selfspec state."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / RECORD_NAME).exists():
        raise UserError(f"'{folder}' has no {RECORD_NAME}: only exports written by selfspec can be read back")
    fix = "; export the head again"
    with reading("export record", folder / RECORD_NAME, fix=fix):
        record = json.loads((folder / RECORD_NAME).read_text())
    if (not isinstance(record, dict) or not isinstance(record.get("head"), dict)
            or not isinstance(record["head"].get("type"), str) or not isinstance(record.get("target"), dict)):
        raise UserError(f"'{folder / RECORD_NAME}' is not a selfspec head record (head type, target){fix}")
    with reading("export weights", folder / WEIGHTS_NAME, fix=fix):
        tensors = load_file(str(folder / WEIGHTS_NAME))
    return record, tensors


# ---------------------------------------------------------------------------------------------- GGUF (llama.cpp)


def target_gguf_path(record: dict[str, Any], target_gguf: Optional[str]) -> Path:
    """The GGUF whose tokenizer the draft copies: `target_gguf`, else the embedded target's packaged GGUF."""
    if target_gguf:
        path = Path(target_gguf)
        if not path.is_file():
            raise UserError(f"target_gguf '{target_gguf}' is not a file")
        return path
    from selfspec.target.model import EMBEDDED, embedded_gguf

    name = str(record["target"]["name_or_path"])
    if not name.startswith("embedded:") or name.removeprefix("embedded:") not in EMBEDDED:
        raise UserError("format=gguf: pass target_gguf=<the target's GGUF>: llama.cpp checks that draft and target "
                        "vocabularies are equal, so the draft copies the target's tokenizer from it")
    return embedded_gguf(name)


def _tokenizer_kv(path: Path, vocab_size: int) -> list[tuple[str, Any, str, Optional[str]]]:
    """Every `tokenizer.*` key of a GGUF file, with its types."""
    from gguf import GGUFReader, GGUFValueType

    try:
        fields = GGUFReader(str(path)).fields
    except (ValueError, OSError) as e:
        raise UserError(f"cannot read '{path}' as a GGUF file: {e}") from e
    out = []
    for key, f in fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[-1]).name if vtype == GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype.name, sub))
    tokens = next((v for k, v, _, _ in out if k == "tokenizer.ggml.tokens"), None)
    if tokens is None or len(tokens) != vocab_size:
        raise UserError(f"'{path}' has {'no tokenizer' if tokens is None else f'{len(tokens)} tokens'}, but the "
                        f"head's target has {vocab_size}: pass the target's own GGUF as target_gguf")
    return out


def _named_as(kv: list, record: dict[str, Any], target_gguf: Path) -> list:
    """kv with general.name's target part (verifier_id) replaced by the target GGUF's own general.name, where it has
    one. llama.cpp sets token attributes by the model's name (llama-vocab.cpp: a name holding "phi3" or "phi-3" marks
    <s>, </s> and <unk>, and throws `unordered_map::at` where the vocabulary lacks one), and the draft's vocabulary is
    the target GGUF's: under the target's name llama.cpp reads it as it reads the target's. Under the verifier id (a
    Hub id, or a local path holding the family's name) it aborted the tiny Phi-3 target's drafts, whose borrowed
    vocabulary has no </s>, while the target itself loaded."""
    from gguf import GGUFReader

    field = GGUFReader(str(target_gguf)).fields.get("general.name")
    if field is None or not str(field.contents()).strip():
        return kv
    ours = verifier_id(record)
    return [(k, str(field.contents()) + v[len(ours):], t, sub) if k == "general.name" and v.startswith(ours)
            else (k, v, t, sub) for k, v, t, sub in kv]


def write_gguf(export: GGUFExport, record: dict[str, Any], out: str | Path, tokenizer_from: Path,
               overwrite: bool = False, inputs=()) -> Path:
    """Write the GGUF file atomically (a temp file beside `out`, renamed over it once complete), after every
    check: the tokenizer is read and matched to the target vocabulary before anything is written, and `out` is
    new, a GGUF draft this function wrote, or (overwrite=true) any file but an input (core/ownership.py)."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    out = Path(out)
    if out.is_dir():
        raise UserError(f"format=gguf writes one file; out '{out}' is a folder (pass out=<folder>/head.gguf)")
    inputs = [*inputs, ("target_gguf", tokenizer_from)]
    check_output(out, "out", GGUF_KIND, overwrite, inputs)
    tok = _tokenizer_kv(tokenizer_from, int(record["target"]["vocab_size"]))
    # the converter's order: its own keys, the target's tokenizer keys, then (DFlash) the mask id last, as
    # llama.cpp's DFlashModel.set_vocab writes it
    late = [x for x in export.kv if x[0] == "tokenizer.ggml.mask_token_id"]
    kv = [x for x in _named_as(export.kv, record, tokenizer_from) if x not in late] + \
        [x for x in tok if x[0] != "tokenizer.ggml.mask_token_id"] + late
    with owned_path(out, "out", GGUF_KIND, overwrite, inputs) as tmp:
        w = GGUFWriter(str(tmp), export.arch)
        for key, value, vtype, sub in kv:
            w.add_key_value(key, value, GGUFValueType[vtype], sub_type=GGUFValueType[sub] if sub else None)
        for name, (data, qtype) in export.tensors.items():
            t = GGMLQuantizationType[qtype]
            w.add_tensor(name, data, raw_dtype=None if t in (GGMLQuantizationType.F32, GGMLQuantizationType.I64) else t)
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        except OSError as e:  # a full disk: numpy's tofile reports a short write without its errno
            raise with_errno(e, tmp) from e
    return out


def check_gguf_tensors(src: dict[str, torch.Tensor], expect: dict[str, tuple[int, ...]], loader: str) -> None:
    """The head's tensors against the shapes llama.cpp's `loader` expects ([out, in], as torch holds them), and none
    holding NaN or inf: one line naming the first that does not fit."""
    for k, shape in expect.items():
        if k not in src or tuple(src[k].shape) != shape:
            raise UserError(f"format=gguf: {k} is {tuple(src[k].shape) if k in src else 'missing'}, llama.cpp's "
                            f"{loader} loader expects {shape}")
    for k, v in src.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise UserError(f"format=gguf: {k} holds NaN or inf; the head is broken, refusing to export it")


def gguf_qtype(outtype: str):
    """The GGML type of `outtype` (f32 | bf16 | q8_0), as the converter's --outtype."""
    from gguf import GGMLQuantizationType

    return {"f32": GGMLQuantizationType.F32, "bf16": GGMLQuantizationType.BF16,
            "q8_0": GGMLQuantizationType.Q8_0}[outtype]


def gguf_tensor(data, qtype) -> tuple[Any, str]:
    """One tensor as write_gguf takes it: F32 data as it is, other types quantized by gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return (data if qtype == GGMLQuantizationType.F32 else quantize(data, qtype)), qtype.name


def diff_gguf(a: str | Path, b: str | Path,
              ignore: tuple[str, ...] = ("general.name", "general.size_label")) -> list[str]:
    """What differs between two GGUF files (keys, their types and values; tensor names, types, shapes and bytes):
    how `make check-llamacpp` holds write_gguf to llama.cpp's own converter. Empty when they agree."""
    import numpy as np
    from gguf import GGUFReader

    ra, rb = GGUFReader(str(a)), GGUFReader(str(b))
    skip = set(ignore) | {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    fa = {k: f for k, f in ra.fields.items() if k not in skip}
    fb = {k: f for k, f in rb.fields.items() if k not in skip}
    out = [f"key only in {a}: {k}" for k in sorted(set(fa) - set(fb))]
    out += [f"key only in {b}: {k}" for k in sorted(set(fb) - set(fa))]
    for k in sorted(set(fa) & set(fb)):
        if list(fa[k].types) != list(fb[k].types):
            out.append(f"{k}: types {fa[k].types} vs {fb[k].types}")
        elif fa[k].contents() != fb[k].contents():
            out.append(f"{k}: values differ")
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    out += [f"tensor only in {a}: {k}" for k in sorted(set(ta) - set(tb))]
    out += [f"tensor only in {b}: {k}" for k in sorted(set(tb) - set(ta))]
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            out.append(f"{k}: {x.tensor_type.name}{list(x.shape)} vs {y.tensor_type.name}{list(y.shape)}")
        elif not np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            out.append(f"{k}: bytes differ")
    return out


# ---------------------------------------------------------------------------------------------- GGUF RoPE

# What llama.cpp's EAGLE-3 and DFlash drafts compute a yarn RoPE with, whatever the GGUF says: neither draft graph
# (src/models/<draft type>.cpp) reads the rope.scaling.yarn_* keys, so beta_fast / beta_slow are
# llama-hparams.h's defaults and the attention factor is 0.1 ln(factor) + 1 (llama-context.cpp get_mscale);
# transformers' yarn defaults are the same. The other RoPE keys (type, factor, original context, freq_base) every
# architecture reads in llama-model.cpp load_hparams, and the drafts pass their rope_freqs tensor to ggml_rope_ext.
LLAMACPP_YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}


def gguf_rope(rope: dict, head_dim: int, arch: str) -> tuple[list[tuple[str, Any, str, Optional[str]]], Optional[Any]]:
    """A draft layer's `rope_parameters` -> the rope.scaling.* keys and the rope_freqs tensor (or None) llama.cpp's
    converter writes for a Llama layer's: nothing for default RoPE; rope_freqs for llama3; type and factor for
    linear; type, factor, original context and the yarn keys present for yarn. A RoPE type it does not reproduce, or
    a yarn RoPE llama.cpp's `arch` draft would compute otherwise than the head trained with, is refused."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return [], None
    if kind == "llama3":
        return [], _llama3_rope_freqs(rope, head_dim)
    if kind not in ("linear", "yarn"):
        raise UserError(f"format=gguf: the target's RoPE type '{kind}' is not one llama.cpp's {arch} draft computes "
                        "as transformers does (this writer reproduces default, llama3, linear and yarn)")
    need = ("factor",) if kind == "linear" else ("factor", "original_max_position_embeddings")
    missing = [k for k in need if rope.get(k) is None]
    if missing:  # the converter would write no scaling at all and llama.cpp would compute plain RoPE
        raise UserError(f"format=gguf: a {kind} RoPE without {' or '.join(missing)}: llama.cpp would compute "
                        "unscaled RoPE")
    key = f"{arch}.rope.scaling"
    kv = [(f"{key}.type", kind, "STRING", None), (f"{key}.factor", float(rope["factor"]), "FLOAT32", None)]
    if kind == "linear":
        return kv, None
    _check_llamacpp_yarn(rope, arch)
    kv.append((f"{key}.original_context_length", int(rope["original_max_position_embeddings"]), "UINT32", None))
    named = {"yarn_ext_factor": rope.get("extrapolation_factor"),
             "yarn_attn_factor": rope.get("attention_factor", rope.get("attn_factor")),
             "yarn_beta_fast": rope.get("beta_fast"), "yarn_beta_slow": rope.get("beta_slow")}
    return kv + [(f"{key}.{k}", float(v), "FLOAT32", None) for k, v in named.items() if v is not None], None


def gguf_rope_notes(rope: dict) -> list[str]:
    """What a GGUF cannot carry of the head's RoPE, as a line for the export's usage (empty when nothing)."""
    if rope.get("rope_type") == "yarn" and rope.get("truncate") is False:  # gpt-oss (docs/targets.md)
        return ["note: llama.cpp rounds yarn's correction range outwards (ggml_rope_yarn_corr_dims); this head "
                "trained with truncate=false, so a few middle frequencies differ from its training RoPE"]
    return []


def _check_llamacpp_yarn(rope: dict, arch: str) -> None:
    """The head's yarn RoPE, as transformers computes it (modeling_rope_utils _compute_yarn_parameters), must be the
    one llama.cpp's draft computes (LLAMACPP_YARN_BETAS). Not checked: `truncate` (gpt-oss: false), as llama.cpp
    always rounds the correction range outwards (ggml_rope_yarn_corr_dims), for targets too (gguf_rope_notes)."""
    for k, want in LLAMACPP_YARN_BETAS.items():
        if float(rope.get(k) or want) != want:
            raise UserError(f"format=gguf: the head's yarn {k} {rope[k]:g} is not the {want:g} llama.cpp's {arch} "
                            "draft computes with (it reads no yarn beta keys)")
    factor = float(rope["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    ours = rope.get("attention_factor")
    if ours is None:
        ours = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"]) if rope.get("mscale") and \
            rope.get("mscale_all_dim") else mscale()
    if not math.isclose(ours, mscale(), rel_tol=1e-6):
        raise UserError(f"format=gguf: the head's yarn attention factor {ours:g} is not the {mscale():g} "
                        f"llama.cpp's {arch} draft computes (0.1 ln(factor) + 1)")


def _llama3_rope_freqs(rope: dict, head_dim: int):
    """Llama 3.1's RoPE as ggml's rope_freqs [head_dim / 2] F32: what each default frequency is divided by (1 in the
    high band, `factor` in the low band, smoothed between), in llama.cpp's converter's own float32 arithmetic
    (conversion/llama.py generate_extra_tensors), so the bytes are its bytes."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:  # [] float32 scalars, as the converter iterates them
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            out.append(1)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


# ---------------------------------------------------------------------------------------------- importing

# Config keys the head's layer is rebuilt from, taken from the TARGET's config: a checkpoint stating another value
# was trained as another layer (or for another target) and would compute something else here.
DIMS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "hidden_act", "rope_theta")
EMBED = "embed_tokens.weight"  # the target's embedding, which EAGLE trainers save with the head


def config_int(value: Any, key: str, src: Path) -> int:
    """A value of another trainer's config.json that must be an integer (a token id, a draft length), else one line
    naming it as the file holds it: int(None) or int([1]) would be an internal error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"'{src}': {key} is {json.dumps(value)} in its config, not an integer; fix its config.json")
    return value


def config_layer_ids(value: Any, key: str, src: Path) -> list[int]:
    """A value of another trainer's config.json that must list target layers (integers), else one line."""
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise UserError(f"'{src}': {key} is {json.dumps(value)} in its config, not a list of integer layer ids; fix "
                        "its config.json")
    return value


def config_dict(cfg: dict[str, Any], key: str, src: Path) -> dict[str, Any]:
    """A section of another trainer's config.json ({} where it is absent or null), else one line."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise UserError(f"'{src}': {key} is {json.dumps(value)} in its config, not a section ({{...}}); fix its "
                        "config.json")
    return value or {}


def layer_kind(state: dict[str, torch.Tensor]) -> str:
    """The peers' EAGLE drafts are Llama layers (heads/layers.py layer=llama); a checkpoint whose layers hold more
    (a Qwen2 layer's q/k/v biases) was trained as its target family's own layer (layer=target)."""
    keys = (k.removeprefix("model.") for k in state)
    own = {k.split(".", 2)[2] for k in keys if k.startswith("layers.")}  # layers.N.<key>
    return "llama" if own <= set(LLAMA_LAYER_KEYS) else "target"


def _rope_theta(cfg: dict[str, Any]) -> Optional[float]:
    for d in (cfg, cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}):
        if isinstance(d, dict) and d.get("rope_theta") is not None:
            return float(d["rope_theta"])
    return None


def check_dims(layer_cfg: dict[str, Any], target, src: Path) -> None:
    """The checkpoint's layer config against the target's: the head is rebuilt from the target's."""
    ours = target.model.config.get_text_config().to_dict()
    ours.update(hidden_size=target.identity["hidden_size"], vocab_size=target.identity["vocab_size"])
    for key in DIMS:
        if key == "rope_theta":
            a, b = _rope_theta(layer_cfg), _rope_theta(ours)
        else:
            a, b = layer_cfg.get(key), ours.get(key)
        if a is not None and b is not None and a != b:
            raise UserError(f"'{src}' was trained for a target with {key}={a}, but target "
                            f"'{target.identity['name_or_path']}' has {key}={b}; pass the target it was trained for")


def without_embedding(tensors: dict[str, torch.Tensor], target, src: Path) -> dict[str, torch.Tensor]:
    """Drop the trainer's copy of the target's embedding, after checking it is the target's shape."""
    emb = tensors.get(EMBED)
    if emb is not None:
        want = list(target.model.get_input_embeddings().weight.shape)
        if list(emb.shape) != want:
            raise UserError(f"'{src}': {EMBED} (the target's embedding, [vocab, hidden]) is {list(emb.shape)}, but "
                            f"target '{target.identity['name_or_path']}' has {want}; pass the target it was trained "
                            "for")
    return {k: v for k, v in tensors.items() if k != EMBED}
