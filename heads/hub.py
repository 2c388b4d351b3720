"""Publishing heads on the Hugging Face Hub: the staged folder (config.json, model.safetensors, README.md model
card), the upload, and one-line messages for the ways an upload fails.

A published repo is exactly a head folder plus its card, so `load_head("<user>/<name>", target)` reads it back
like any folder. Nothing here imports decode/ or train/; the card is rendered from the head's own config.json
and, when one sits beside the head, the last benchmark's bench.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from heads.atomic import atomic_dir
from heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, read_head
from heads.errors import UserError
from heads.target import EMBEDDED

CARD_NAME = "README.md"
UPLOADED = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME)  # exactly what a published repo holds
BENCH_NAME = "bench.json"

# Licenses of the targets we know, inherited by their heads (a head is trained on the target's outputs and
# is useless without it). Unknown targets get no license line: the card tells the reader to check the base's.
TARGET_LICENSES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0",
    "HuggingFaceTB/SmolLM2-360M-Instruct": "apache-2.0",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": "apache-2.0",
    "Qwen/Qwen2.5-0.5B-Instruct": "apache-2.0",
    "Qwen/Qwen2.5-1.5B-Instruct": "apache-2.0",
    "Qwen/Qwen3-1.7B": "apache-2.0",
    "google/gemma-3-270m-it": "gemma",
    "meta-llama/Llama-3.2-1B-Instruct": "llama3.2",
    "meta-llama/Llama-3.1-8B-Instruct": "llama3.1",
}
# Training-data names (data.path) with a Hub dataset id, for the card's `datasets:` metadata.
DATASETS = {None: "anon8231489123/ShareGPT_Vicuna_unfiltered", "sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}


# ---------------------------------------------------------------------------------------------- names


def target_hub_id(identity: dict[str, Any]) -> Optional[str]:
    """The Hub id of the head's target: embedded targets map to their origin; tiny/local targets have none."""
    name = str(identity.get("name_or_path") or "")
    if name.startswith("embedded:"):
        entry = EMBEDDED.get(name.split(":", 1)[1])
        return entry[0] if entry else None
    if name.startswith(("tiny:", ".", "/", "~")) or name.count("/") != 1 or Path(name).exists():
        return None
    return name


def check_repo_id(repo_id: str) -> str:
    """'<user or org>/<name>' with the Hub's characters, or a UserError saying so."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not repo_id or repo_id.startswith("<") or repo_id.count("/") != 1:
        raise UserError(f"repo_id must be '<user or org>/<name>' (got '{repo_id}')")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UserError(f"repo_id '{repo_id}' is not a valid Hub id: {' '.join(str(e).split())[:160]}") from e
    return repo_id


# ---------------------------------------------------------------------------------------------- model card


def model_card(record: dict[str, Any], repo_id: str, bench: Optional[dict[str, Any]] = None,
               n_params: Optional[int] = None) -> str:
    """README.md: Hub YAML metadata (base_model, library_name, license, tags, datasets) and a readable card."""
    head, target, training = record["head"], record["target"], record.get("training") or {}
    base = target_hub_id(target)
    license_id = TARGET_LICENSES.get(base or "")
    data = training.get("data") or {}
    dataset = DATASETS.get(data.get("path")) if data else None
    head_type = head.get("type", "eagle")

    meta = [("base_model", base), ("library_name", "selfspec"), ("license", license_id),
            ("pipeline_tag", "text-generation")]
    lines = ["---"] + [f"{k}: {v}" for k, v in meta if v]
    lines += ["tags:"] + [f"- {t}" for t in ("speculative-decoding", head_type, "draft-model", "selfspec")]
    if dataset:
        lines += ["datasets:", f"- {dataset}"]
    lines += ["---", ""]

    base_link = f"[{base}](https://huggingface.co/{base})" if base else f"`{target.get('name_or_path')}`"
    lines += [f"# {repo_id.split('/', 1)[1]}", "",
              f"An {_describe_type(head_type)} draft head for {base_link}, trained with selfspec on the frozen "
              "target. It proposes tokens that the target verifies, so output is exactly the target's own "
              "(greedy, and sampling with the exact acceptance rule); only the speed changes.", ""]

    lines += ["## Head", "", "| | |", "|---|---|"]
    vocab = head.get("vocab_size")
    rows = [("type", f"`{head_type}`: fc(2H -> H) + {head.get('num_layers', 1)} {target.get('model_type', '')} "
                     "decoder layer(s), the target's embedding and lm_head (not stored)"),
            ("parameters", f"{n_params / 1e6:.2f}M" if n_params else None),
            ("fc bias", "yes (not servable by vLLM: use selfspec or SGLang)" if head.get("fc_bias") else "no"),
            ("draft vocabulary", f"{vocab} most frequent target tokens (`draft_vocab` in the weights)" if vocab
             else f"the target's full vocabulary ({target.get('vocab_size')})"),
            ("target", f"`{target.get('name_or_path')}`" + (f" = {base}" if base and base != target.get("name_or_path") else "")
             + (f" @ {target['revision']}" if target.get("revision") else "")),
            ("target shape", f"{target.get('model_type')}, hidden {target.get('hidden_size')}, "
                             f"{target.get('num_hidden_layers')} layers, vocab {target.get('vocab_size')}"),
            ("target fingerprint", f"`{target.get('fingerprint')}` (heads are refused by any other target)"),
            ("format", f"selfspec head format {record.get('format_version')}")]
    lines += [f"| {k} | {v} |" for k, v in rows if v] + [""]

    lines += ["## Training", ""] + _training_lines(training) + [""]
    lines += ["## Results", ""] + _results_lines(record.get("metrics") or {}, bench) + [""]
    lines += ["## Usage", "", "With selfspec (loads the head by id and checks it belongs to the target):", "",
              "```bash", f"python decode/generate.py head={repo_id} prompt=\"Explain KV caches.\"", "```", ""]
    lines += _serving_lines(repo_id, head, base)
    lines += ["## Files", "",
              "- `config.json`: the selfspec head record (head type and config, target identity, training, metrics)",
              "- `model.safetensors`: the head's weights (`fc.weight`, `model.layers.*`"
              + (", `draft_vocab`" if vocab else "") + "; `model.embed_tokens.weight` is an unused 1-row stub)", ""]
    if not license_id:
        lines += ["License: the base model's license applies to this head; check it before use.", ""]
    return "\n".join(lines)


def _describe_type(head_type: str) -> str:
    return {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3"}.get(head_type, head_type)


def _training_lines(training: dict[str, Any]) -> list[str]:
    if not training:
        return ["No training record in config.json."]
    data, tc = training.get("data") or {}, training.get("train") or {}
    data_name = data.get("path") or "sharegpt (embedded ShareGPT V3 copy)"
    out = [f"- recipe: `{training.get('recipe', '?')}`",
           f"- data: `{data_name}`" + (f", at most {data['max_conversations']} conversations" if data.get("max_conversations") else "")
           + (f", max length {data['max_length']}" if data.get("max_length") else "")
           + (f", system prompt {data['system_prompt']!r}" if data.get("system_prompt") else "")
           + (f" ({training['sequences']} sequences)" if training.get("sequences") else "")]
    run = [("steps", training.get("steps")), ("epochs", training.get("epochs")),
           ("train seconds", training.get("train_seconds")), ("tokens/s", training.get("tokens_per_s")),
           ("processes", training.get("processes"))]
    out.append("- run: " + ", ".join(f"{k} {v}" for k, v in run if v is not None))
    hp = [("training-time test steps", (training.get("ttt") or {}).get("steps")),
          ("lr", tc.get("lr")), ("schedule", tc.get("schedule")), ("warmup", tc.get("warmup_steps")),
          ("batch", tc.get("batch_size")), ("grad accum", tc.get("grad_accum")), ("w_feat", tc.get("w_feat")),
          ("w_tok", tc.get("w_tok")), ("noise", tc.get("noise_std")), ("clip by value", tc.get("grad_clip_value")),
          ("precision", tc.get("mixed_precision"))]
    out.append("- hyper-parameters: " + ", ".join(f"{k} {v}" for k, v in hp if v is not None))
    if training.get("final_loss") is not None:
        out.append(f"- final loss {training['final_loss']:.4f}, top-1 agreement {training.get('final_acc') or 0:.3f}")
    if training.get("draft_vocab_coverage") is not None:
        out.append(f"- draft vocabulary covers {100 * training['draft_vocab_coverage']:.1f}% of training tokens")
    return out


def _results_lines(metrics: dict[str, Any], bench: Optional[dict[str, Any]]) -> list[str]:
    """tau (tokens committed per target pass, bonus token included; plain decoding = 1.00) and speedup."""
    if bench and bench.get("methods"):
        shown = {k: (bench[k].get("name_or_path") if isinstance(bench[k], dict) else bench[k])
                 for k in ("target", "device", "dtype", "prompts") if bench.get(k)}
        out = ["From the last benchmark (`bench.json`" + "".join(f", {k} {v}" for k, v in shown.items()) + "):", "",
               "| method | tau | tokens/s | speedup | output identical to target |", "|---|---|---|---|---|"]
        for name, m in bench["methods"].items():
            out.append(f"| {name} | {_num(m.get('tau'), 2)} | {_num(m.get('tokens_per_s'), 1)} | "
                       f"{_num(m.get('speedup'), 2, 'x')} | {_yes(m.get('identical'))} |")
        return out + ["", "tau = tokens committed per target pass over all prompts (the bonus token counts; plain "
                          "decoding = 1.00); speedup = all tokens / all seconds, against HF `generate` greedy on the "
                          "same prompts, machine and dtype, in one run."]
    if metrics.get("tau") is not None:
        acc = " ".join(f"{metrics[k]:.2f}" for k in sorted(metrics) if k.startswith("acc") and isinstance(metrics[k], float))
        return [f"Held-out greedy chain drafting during training: tau {metrics['tau']:.2f} (tokens per target pass, "
                f"bonus included; plain decoding = 1.00)" + (f", acceptance by position {acc}" if acc else "") + ".",
                "No speed benchmark yet (`bench.json` beside the head)."]
    return ["No evaluation recorded yet."]


def _num(v: Any, digits: int, suffix: str = "") -> str:
    return f"{v:.{digits}f}{suffix}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _yes(v: Any) -> str:
    return "yes" if v is True else "no" if v is False else "-"


def _serving_lines(repo_id: str, head: dict[str, Any], base: Optional[str]) -> list[str]:
    base = base or "<target>"
    out = ["With vLLM or SGLang: convert the head with selfspec's exporter first (their layouts differ from "
           "selfspec's; `scripts/export.py` refuses what an engine would silently serve wrong).", ""]
    if head.get("type") == "eagle" and (head.get("fc_bias") or head.get("vocab_size")):
        why = "an fc bias" if head.get("fc_bias") else "a reduced draft vocabulary"
        out += [f"This head has {why}, which vLLM's EAGLE-1 loader cannot express; SGLang can:", ""]
    else:
        out += ["```bash", f"python scripts/export.py head={repo_id} format=eagle out=eagle-head", "```", "",
                "```python", "from vllm import LLM, SamplingParams",
                f"llm = LLM(model=\"{base}\", speculative_config={{\"method\": \"eagle\", \"model\": \"eagle-head\", "
                "\"num_speculative_tokens\": 5})",
                "print(llm.generate([\"Explain KV caches.\"], SamplingParams(temperature=0, max_tokens=128))[0].outputs[0].text)",
                "```", ""]
    out += ["```bash", f"python scripts/export.py head={repo_id} format=sglang out=sglang-head",
            f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE "
            "--speculative-draft-model-path sglang-head --speculative-num-steps 5 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 6" + (" --speculative-token-map sglang-head/hot_token_map.pt"
                                                  if head.get("vocab_size") and head.get("type") == "eagle" else ""),
            "```", ""]
    return out


# ---------------------------------------------------------------------------------------------- staging


def find_bench(head_dir: Path) -> Optional[Path]:
    """bench.json beside the head folder (`<run>/head` -> `<run>/bench.json`), or inside it."""
    for p in (head_dir.parent / BENCH_NAME, head_dir / BENCH_NAME):
        if p.is_file():
            return p
    return None


def stage(head: str, folder: str | Path, repo_id: str, bench: Optional[str] = None) -> Path:
    """Write exactly the folder that would be uploaded: config.json, model.safetensors (copied byte for byte
    from a head folder, or written from a single-file checkpoint) and the rendered README.md. Everything is read
    and checked first; the folder is built beside `folder` and swapped in whole (heads/atomic.py), so a failure
    leaves a previous staging as it was."""
    record, state = read_head(head)  # validates it is a readable selfspec head before anything is written
    src = Path(head).expanduser()
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"out '{folder}' is a file; pass an empty or new folder")
    if folder.exists() and any(folder.iterdir()):
        extra = sorted(p.name for p in folder.iterdir() if p.name not in UPLOADED)
        if extra:
            raise UserError(f"out folder '{folder}' holds other files ({', '.join(extra[:3])}); pass an empty or new folder")
    bench_path = Path(bench) if bench else (find_bench(src) if src.is_dir() else None)
    bench_data = _read_bench(bench_path) if bench_path else None
    n_params = sum(v.numel() for k, v in state.items() if v.is_floating_point() and k != "model.embed_tokens.weight")
    card = model_card(record, repo_id, bench_data, n_params)
    with atomic_dir(folder) as tmp:
        if src.is_dir():
            for name in (CONFIG_NAME, WEIGHTS_NAME):
                shutil.copyfile(src / name, tmp / name)
        else:
            from safetensors.torch import save_file

            (tmp / CONFIG_NAME).write_text(json.dumps(record, indent=2, default=str) + "\n")
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CARD_NAME).write_text(card)  # fsynced with the folder before the swap
    return folder


def _read_bench(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"bench file '{path}' is unreadable ({type(e).__name__}); fix or remove it") from e
    if not isinstance(data, dict) or not isinstance(data.get("methods", {}), dict):
        raise UserError(f"bench file '{path}' has no 'methods' mapping; fix or remove it")
    return data


# ---------------------------------------------------------------------------------------------- upload


def hub_token() -> str:
    """HF_TOKEN, or the token cached by `hf auth login`; a one-line UserError when neither exists."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise UserError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (a token with write access)")
    return token


def upload(folder: str | Path, repo_id: str, private: bool = False, revision: Optional[str] = None,
           commit_message: Optional[str] = None) -> str:
    """create_repo(exist_ok) + upload_folder of the staged files; returns the commit URL.

    Safe to rerun after an interruption: upload_folder is idempotent (files the Hub already holds with the
    same content are not sent again, and an unchanged folder makes no new commit)."""
    from huggingface_hub import HfApi

    token = hub_token()
    api = HfApi(token=token)
    message = commit_message or f"Upload selfspec head ({', '.join(UPLOADED)})"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), allow_patterns=list(UPLOADED),
                                 revision=revision, commit_message=message)
    except Exception as e:  # mapped to one line below; anything unrecognised is re-raised as is
        raise hub_error(e, repo_id, "upload to") from e
    return str(getattr(info, "commit_url", info))


def hub_error(e: BaseException, repo_id: str, action: str = "reach") -> BaseException:
    """A Hub/network failure as a one-line UserError saying what to do; other exceptions come back unchanged."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(e, UserError):
        return e
    if isinstance(e, OfflineModeIsEnabled):
        return UserError(f"cannot {action} '{repo_id}': HF_HUB_OFFLINE is set; unset it, or stage the folder with "
                         "dry_run=true out=<folder>")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status is not None:
        detail = _server_message(e)
        if status == 401:
            return UserError(f"the Hub rejected the token (401) for '{repo_id}': run `hf auth login` again or set "
                             f"HF_TOKEN to a valid token{detail}")
        if status == 403:
            return UserError(f"no write access to '{repo_id}' (403): the repo or namespace belongs to someone else, or "
                             f"the token is read-only; use your own user/org or a write token{detail}")
        if status == 404:
            return UserError(f"'{repo_id}' not found (404) or not visible with this token{detail}")
        return UserError(f"the Hub answered {status} for '{repo_id}'{detail}; rerunning is safe (the upload is idempotent)")
    if is_network_error(e):
        from huggingface_hub import constants

        return UserError(f"cannot {action} the Hub at {constants.ENDPOINT} ({type(e).__name__}); check the network "
                         "or HF_ENDPOINT, then rerun: the upload is idempotent")
    return e


def _server_message(e: BaseException) -> str:
    msg = getattr(e, "server_message", None) or ""
    msg = " ".join(str(msg).split())[:160]
    return f" (Hub: {msg})" if msg else ""


def is_network_error(e: BaseException) -> bool:
    """Connection/timeout errors of whichever HTTP client huggingface_hub uses (httpx, its fork, requests)."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "TimeoutException", "NetworkError", "TransportError",
                         "ConnectionError", "RemoteProtocolError", "ReadTimeout", "ProxyError"})
