"""Importing draft heads trained elsewhere (the original EAGLE, speculators, SpecForge) as selfspec heads, so that
`load_head`, scripts/eval_heads.py and the decoders take them as they take heads trained here.

`imported_head(src, target, fmt)` reads a folder or weights file that selfspec did not write, maps its tensors onto
the head selfspec builds for `target` and loads them (every name and shape checked); `import_head` is the same as
(record, state); `write_import` saves the head as a selfspec head folder (atomic, under core/ownership.py's rule). The
record is heads.checkpoint.head_record's with the target's own identity (the one load_head checks), plus
`imported_from` = {layout, path, sha256 of the weights file}.

Layouts (`fmt`), with the source each one follows:

    eagle        SafeAILab EAGLE-1/2 (eagle/model/cnets1.py and cnets.py `Model`): config.json a LlamaConfig whose
                 num_hidden_layers is the head's; `fc.weight` [H, 2H] (`fc.bias` optional), `layers.N.*` with no
                 input_layernorm on layer 0, and `embed_tokens.weight` [V, H], the target's frozen embedding (its
                 shape is checked, then it is dropped: the head shares the target's). The weights are model.safetensors,
                 pytorch_model.bin, or the model.safetensors of accelerate's save_state (a `module.` prefix of a
                 wrapped model is removed; such folders hold no config.json: pass config=). vLLM `eagle` and SGLang
                 LlamaForCausalLMEagle folders use the same names.
    speculators  the speculators config format, EAGLE-1 (`speculators_model_type: eagle`: fusion_fc.*, transformer.*)
                 or EAGLE-3 (`eagle3`: fc, layers.0.*, norm, lm_head, d2t, t2d), read with publish/export.py's own
                 renames. Its `eagle_aux_hidden_state_layer_ids` count as vLLM's do: HF hidden_states ids, as ours.
    eagle3       SpecForge / SafeAILab EAGLE-3 (`LlamaForCausalLMEagle3`, specforge/modeling/draft/llama3_eagle.py):
                 `midlayer.*` (our `layers.0.*`), `fc.weight` [H, 3H], `norm.weight`, `lm_head.weight` [V_draft, H],
                 `d2t`, `t2d`. Its `eagle_config.eagle_aux_hidden_state_layer_ids` count as SGLang's do: id k is the
                 OUTPUT of layer k (set_eagle3_layers_to_capture adds 1), i.e. HF id k + 1. Without them: aux_layers=.
    dflash       SpecForge / z-lab DFlash (`DFlashDraftModel`: Qwen3 config.json with dflash_config.target_layer_ids,
                 mask_token_id, block_size; `fc`, `hidden_norm`, `layers.N.*`, `norm`); speculators' DFlash is
                 layout=speculators (`speculators_model_type: dflash`, aux_hidden_state_layer_ids = ids + 1).
                 Read by publish/dflash.py import_dflash.

What the selfspec head would compute differently is refused in one line, with what: a config whose layer dimensions
differ from the target's, an EAGLE-1 input norm on layer 0 or HASS layernorms, EAGLE-3 norm_before_residual, any
tensor without a place in the head or missing from the checkpoint. A folder with selfspec.json is an export selfspec
wrote: it is read back with publish/export.py's read_export, its record (training, metrics) kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from selfspec.core.errors import UserError, reading
from selfspec.core.target import file_sha256
from selfspec.core.ownership import check_output, owned_dir
from selfspec.heads.checkpoint import HEAD_KIND, build_head, head_record, write_head_files
from selfspec.publish.export import EMBED_STUB, LLAMA_LAYER_KEYS, RECORD_NAME, eagle1_state, eagle3_state, read_export

LAYOUTS = ("auto", "eagle", "speculators", "eagle3", "dflash")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # looked for in this order in a src folder
# Config keys the head's layer is rebuilt from, taken from the TARGET's config: a checkpoint stating another value
# was trained as another layer (or for another target) and would compute something else here.
DIMS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "hidden_act", "rope_theta")
EMBED = "embed_tokens.weight"  # the target's embedding, which EAGLE trainers save with the head


def import_head(src: str | Path, target, fmt: str = "auto", config: Optional[str] = None,
                aux_layers: Optional[Sequence[int]] = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(record, state) of the selfspec head `src` holds, for `target` (a core.target.Target)."""
    head = imported_head(src, target, fmt, config, aux_layers)
    return head.record, {k: v.detach().to("cpu") for k, v in head.state_dict().items()}


def imported_head(src: str | Path, target, fmt: str = "auto", config: Optional[str] = None,
                  aux_layers: Optional[Sequence[int]] = None):
    """The head built for `target` with `src`'s weights loaded, bound, in eval mode; `.record` is its record.
    `config` is a config.json given apart from the weights; `aux_layers` (HF hidden_states ids) the target layers
    an EAGLE-3 head reads, for checkpoints that do not say."""
    if fmt not in LAYOUTS:
        raise UserError(f"unknown layout '{fmt}'; use one of {', '.join(LAYOUTS)}")
    src = Path(src)
    weights = check_src(src, config)
    if src.is_dir() and (src / RECORD_NAME).exists():
        if fmt != "auto" or aux_layers is not None:  # its record says both: a second answer would be ignored
            raise UserError(f"'{src}' is an export selfspec wrote: its {RECORD_NAME} names the layout and the "
                            "layers it reads; drop layout= and aux_layers=")
        return _selfspec_export(src, weights, target)
    cfg = _read_config(src, config)
    tensors = _read_weights(weights)
    layout = fmt if fmt != "auto" else _detect(cfg, tensors, src)
    if layout != "speculators" and "speculators_model_type" in cfg:
        raise UserError(f"'{src}' is a speculators folder (speculators_model_type: {cfg['speculators_model_type']}); "
                        "use layout=speculators or auto")
    head_cfg, state = _map(layout, cfg, tensors, target, aux_layers, src)
    head = _load(head_cfg, state, target, src)
    head.record = head_record(head, target.identity, imported_from=_source(layout, src, weights))
    return head


def write_import(head, out: str | Path, overwrite: bool = False, inputs=()) -> Path:
    """Save an imported head as a selfspec head folder, built beside `out` and swapped in whole, under the
    ownership rule (core/ownership.py: only over a selfspec head, with overwrite=true, holding nothing else)."""
    with owned_dir(out, "out", HEAD_KIND, overwrite, inputs) as tmp:
        write_head_files(head, tmp, head.record)
    return Path(out)


def check_out(out: str | Path, overwrite: bool = False, inputs=()) -> None:
    """`out` must be new or empty, or (with overwrite) a selfspec head folder holding nothing else, and no input."""
    check_output(out, "out", HEAD_KIND, overwrite, inputs)


def check_src(src: str | Path, config: Optional[str] = None) -> Path:
    """The weights file of `src` (a folder or the file itself), and `config` a file if given: what a run can check
    before loading the target. Returns the weights file."""
    if config is not None and not Path(config).is_file():
        raise UserError(f"config '{config}' is not a file")
    return _weights_file(Path(src))


# ---------------------------------------------------------------------------------------------- reading


def _weights_file(src: Path) -> Path:
    if src.is_file():
        return src
    if not src.is_dir():
        raise UserError(f"src '{src}' not found: pass a head folder or its weights file")
    for name in WEIGHT_FILES:
        if (src / name).is_file():
            return src / name
    raise UserError(f"no weights in '{src}': expected {' or '.join(WEIGHT_FILES)} (or pass the weights file as src=)")


def _read_config(src: Path, config: Optional[str]) -> dict[str, Any]:
    """`config` if given, else the src folder's config.json, else {} (a bare weights file or an accelerate state
    folder: the dimensions are then checked by the tensors' shapes alone)."""
    path = Path(config) if config is not None else src / "config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read '{path}' as JSON ({type(e).__name__})") from e
    if not isinstance(cfg, dict):
        raise UserError(f"'{path}' is not a config (a JSON object)")
    if cfg.get("library") == "selfspec":
        raise UserError(f"'{path}' belongs to a selfspec head already: load it as it is (head=...)")
    return cfg


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A state dict of tensors from safetensors or a weights-only torch file; nothing pickled is ever run."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with reading("weights file", path):
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                ours = "selfspec_config" in (f.metadata() or {})
            tensors = {} if ours else load_file(str(path))
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
            ours = isinstance(tensors, dict) and "selfspec_config" in tensors
    if ours:  # a run's ckpt.pt, a single-file head, a checkpoint's head.safetensors: a head with its record already
        run_head = path.parent / "head"
        also = f", or the run's head folder {run_head}" if (run_head / "config.json").is_file() else ""
        raise UserError(f"'{path}' is a head selfspec wrote (a training run's single-file head, with its record): "
                        f"there is nothing to import; use it as it is (head={path}{also})")
    if not isinstance(tensors, dict) or not tensors or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise UserError(f"'{path}' is not a state dict of tensors")
    if all(k.startswith("module.") for k in tensors):  # accelerate's save_state of a DDP-wrapped model
        tensors = {k.removeprefix("module."): v for k, v in tensors.items()}
    return tensors


def _detect(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], src: Path) -> str:
    from selfspec.publish.dflash import is_dflash

    if "speculators_model_type" not in cfg and is_dflash(cfg, tensors):  # before eagle: fc + layers.* too
        return "dflash"
    if "speculators_model_type" in cfg or any(k.startswith("fusion_fc.") for k in tensors):
        return "speculators"
    if any(k.startswith("midlayer.") for k in tensors) or "d2t" in tensors or "layers.0.hidden_norm.weight" in tensors:
        return "eagle3"
    if "fc.weight" in tensors and any(k.startswith("layers.") for k in tensors):
        return "eagle"
    raise UserError(f"cannot tell the layout of '{src}' (tensors {', '.join(sorted(tensors)[:3])}, ...); pass "
                    "layout=eagle|speculators|eagle3|dflash")


def _source(layout: str, src: Path, weights: Path) -> dict[str, Any]:
    return {"layout": layout, "path": str(src.resolve()), "sha256": file_sha256(weights)}


# ---------------------------------------------------------------------------------------------- mapping


def _map(layout: str, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target, aux_layers, src: Path):
    """-> (head config with its "type", state in selfspec's names)."""
    if layout == "speculators":
        kind = cfg.get("speculators_model_type")
        layer_cfg = cfg.get("transformer_layer_config") or {}
        if kind == "eagle":
            if cfg.get("layernorms"):
                raise UserError(f"'{src}': speculators EAGLE-1 with layernorms=true (HASS: norms on the embedding and "
                                "before the lm_head) has no place in selfspec's EAGLE-1 head")
            return _eagle1(tensors, {**layer_cfg, "num_hidden_layers": 1}, target, aux_layers, src)
        if kind == "eagle3":
            return _eagle3(tensors, cfg, layer_cfg, cfg.get("eagle_aux_hidden_state_layer_ids"), target, aux_layers,
                           src)
        if kind == "dflash":
            return _dflash(layout, cfg, tensors, target, aux_layers, src)
        if kind is None:
            raise UserError(f"layout=speculators reads speculators_model_type from config.json; '{src}' has none: "
                            "pass config=")
        raise UserError(f"'{src}': speculators_model_type '{kind}' cannot be imported (known: eagle, eagle3, dflash)")
    if layout == "eagle":
        return _eagle1(tensors, cfg, target, aux_layers, src)
    if layout == "dflash":
        return _dflash(layout, cfg, tensors, target, aux_layers, src)
    sglang_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    recorded = None if sglang_ids is None else [int(k) + 1 for k in sglang_ids]  # SGLang: output of layer k
    return _eagle3(tensors, cfg, cfg, recorded, target, aux_layers, src)


def _eagle1(tensors, layer_cfg: dict[str, Any], target, aux_layers, src: Path):
    if aux_layers is not None:
        raise UserError("aux_layers is for EAGLE-3 heads; this is an EAGLE-1 checkpoint")
    _check_dims(layer_cfg, target, src)
    tensors = _without_embedding(tensors, target, src)
    state = eagle1_state({k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")})  # derived
    if "model.layers.0.input_layernorm.weight" in state:
        raise UserError(f"'{src}' has an input_layernorm on layer 0; EAGLE (and selfspec's EAGLE-1 head) feeds fc's "
                        "output straight into the layer, so this head would be served without it")
    if "fc.weight" not in state:
        raise UserError(f"'{src}' has no fc.weight (fusion_fc.weight): not an EAGLE-1 head")
    found = sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.")})
    n = int(layer_cfg.get("num_hidden_layers") or len(found))
    if found != list(range(n)):
        raise UserError(f"'{src}': its config says {n} decoder layer(s) but the weights hold layers {found}")
    hidden = state["fc.weight"].shape[0]
    state[EMBED_STUB] = torch.zeros(1, hidden, dtype=state["fc.weight"].dtype)  # never read: inputs_embeds
    return {"type": "eagle", "num_layers": n, "fc_bias": "fc.bias" in state, "layer": _layer_kind(state)}, state


def _dflash(layout: str, cfg: dict[str, Any], tensors, target, aux_layers, src: Path):
    """speculators (`dflash`), SpecForge and z-lab DFlash checkpoints: publish/dflash.py import_dflash."""
    from selfspec.publish.dflash import import_dflash

    if aux_layers is not None:
        raise UserError("aux_layers is for EAGLE-3 heads; a DFlash checkpoint names its target layers itself")
    return import_dflash(layout, cfg, tensors, target, src)


def _eagle3(tensors, cfg: dict[str, Any], layer_cfg: dict[str, Any], recorded: Optional[list[int]], target,
            aux_layers, src: Path):
    """`recorded`: the aux layers the checkpoint names, already in HF hidden_states ids."""
    _check_dims(layer_cfg, target, src)
    if cfg.get("norm_before_residual"):
        raise UserError(f"'{src}' was trained with norm_before_residual=true (the residual is the normed hidden "
                        "state); selfspec's EAGLE-3 layer keeps the un-normed one, as SpecForge and SGLang do")
    hidden = int(target.identity["hidden_size"])
    if cfg.get("target_hidden_size") not in (None, hidden):
        raise UserError(f"'{src}' fuses target states of width target_hidden_size={cfg['target_hidden_size']}, but "
                        f"target '{target.identity['name_or_path']}' has hidden_size={hidden}")
    tensors = _without_embedding(tensors, target, src)
    tensors = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
               for k, v in tensors.items()}
    if "fc.weight" not in tensors:
        raise UserError(f"'{src}' has no fc.weight: not an EAGLE-3 head")
    if aux_layers is not None and recorded is not None and [int(k) for k in aux_layers] != recorded:
        raise UserError(f"aux_layers={list(aux_layers)} but '{src}' names {recorded} (HF hidden_states ids); drop "
                        "aux_layers=")
    aux = [int(k) for k in aux_layers] if aux_layers is not None else recorded
    if aux is None:
        from selfspec.heads.eagle3 import default_aux_layers

        default = default_aux_layers(int(target.identity["num_hidden_layers"]))
        raise UserError(f"'{src}' does not say which target layers it reads: pass aux_layers=[...] (HF "
                        f"hidden_states ids; SafeAILab EAGLE-3, SpecForge and the engines default to {{2, L//2, L-3}} "
                        f"= {default} for this target)")
    width = tensors["fc.weight"].shape[1]
    if width != len(aux) * hidden:
        raise UserError(f"'{src}': fc.weight takes {width} inputs, but {len(aux)} aux layers of hidden size {hidden} "
                        f"give {len(aux) * hidden}")
    state = eagle3_state(tensors, int(target.identity["vocab_size"]))
    return {"type": "eagle3", "aux_layers": aux, "vocab_size": int(state["d2t"].numel()),
            "layer": _layer_kind(state)}, state


def _layer_kind(state: dict[str, torch.Tensor]) -> str:
    """The peers' EAGLE drafts are Llama layers (heads/eagle.py layer=llama); a checkpoint whose layers hold more
    (a Qwen2 layer's q/k/v biases) was trained as its target family's own layer (layer=target)."""
    keys = (k.removeprefix("model.") for k in state)
    own = {k.split(".", 2)[2] for k in keys if k.startswith("layers.")}  # layers.N.<key>
    return "llama" if own <= set(LLAMA_LAYER_KEYS) else "target"


def _rope_theta(cfg: dict[str, Any]) -> Optional[float]:
    for d in (cfg, cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}):
        if isinstance(d, dict) and d.get("rope_theta") is not None:
            return float(d["rope_theta"])
    return None


def _check_dims(layer_cfg: dict[str, Any], target, src: Path) -> None:
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


def _without_embedding(tensors: dict[str, torch.Tensor], target, src: Path) -> dict[str, torch.Tensor]:
    """Drop the trainer's copy of the target's embedding, after checking it is the target's shape."""
    emb = tensors.get(EMBED)
    if emb is not None:
        want = list(target.model.get_input_embeddings().weight.shape)
        if list(emb.shape) != want:
            raise UserError(f"'{src}': {EMBED} (the target's embedding, [vocab, hidden]) is {list(emb.shape)}, but "
                            f"target '{target.identity['name_or_path']}' has {want}; pass the target it was trained "
                            "for")
    return {k: v for k, v in tensors.items() if k != EMBED}


# ---------------------------------------------------------------------------------------------- loading


def _load(head_cfg: dict[str, Any], state: dict[str, torch.Tensor], target, src: Path):
    """Build the head for `target` and load `state` into it (heads.checkpoint.build_head), after refusing
    non-finite weights: a diverged run's head would otherwise fail only when it drafts."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise UserError(f"'{src}': {bad[0]} holds NaN or inf; its training diverged")
    return build_head(head_cfg, state, target, f"'{src}'")


def _selfspec_export(src: Path, weights: Path, target):
    """A folder selfspec's own export wrote: read_export knows its record and layout exactly."""
    from selfspec.core.target import check_identity

    record, state = read_export(src)
    check_identity(record["target"], target.identity)
    head = _load(record["head"], state, target, src)
    extra = {k: v for k, v in record.items() if k not in ("format_version", "library", "head", "target")}
    extra["imported_from"] = _source("selfspec-export", src, weights)
    head.record = head_record(head, target.identity, **extra)
    return head
