"""Self-distillation data: the target itself writes the assistant turns of the data's conversations.

    python scripts/regenerate.py target=smollm2-135m data=sharegpt out=regenerated.jsonl data.max_conversations=2000

For each conversation, every assistant turn is regenerated given the earlier turns AS REGENERATED (so a later
answer follows the target's own earlier answers), in batches with left padding. Output: one OpenAI-shape line
per conversation, {"id", "messages": [{role, content}]}, the same ids as the source (so the held-out split is
unchanged); train on it with data=jsonl data.path=<out>. Rerunning with the same out= resumes: ids already
written are skipped, and a torn last line left by an interrupted run is dropped first.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from data.config import DataConfig
from heads.cli import entry
from heads.errors import UserError
from heads.target import TargetConfig


@dataclass
class RegenerateConfig:
    # The model that writes the answers (the target the drafter will serve).
    target: TargetConfig = field(default_factory=TargetConfig)
    # Conversations whose user turns are answered; data.max_conversations caps how many.
    data: DataConfig = field(default_factory=DataConfig)
    # Output JSONL file; appended to, so a rerun resumes where an interrupted one stopped.
    out: str = "???"
    # Longest answer per assistant turn, in tokens; a turn cut here ends its conversation.
    max_new_tokens: int = 512
    # Prompts generated together (left-padded); bigger is faster on a GPU, uses more memory.
    batch_size: int = 8
    # 0: greedy (the target's own most likely answer); > 0: sampled at this temperature.
    temperature: float = 0.0
    # Nucleus sampling threshold when temperature > 0 (1.0 disables it).
    top_p: float = 1.0
    # Seed of the sampler (used when temperature > 0).
    seed: int = 0
    # Longest prompt (history + user turn) in tokens; None: data.max_length. A longer one ends the conversation.
    max_prompt_tokens: Optional[int] = None
    # Answer only the first n user turns of each conversation (None: all). 1 = single-turn data, the cheapest.
    max_turns: Optional[int] = None
    # Skip the first n conversations: several processes (each with its own out=) split the work this way.
    skip: int = 0


@entry("regenerate", RegenerateConfig)
def main(cfg: RegenerateConfig) -> dict:
    from accelerate import Accelerator
    from omegaconf import OmegaConf
    from tqdm import tqdm
    from transformers import set_seed

    from data.conversations import load_conversations
    from data.tokenize import end_of_turn_ids, resolve_chat_template
    from heads.target import load_target_from_config

    if OmegaConf.is_missing(cfg, "out") or not cfg.out:
        raise UserError("say where to write: out=FILE.jsonl")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
        raise UserError(f"need temperature >= 0 and 0 < top_p <= 1, got {cfg.temperature} and {cfg.top_p}")
    out = Path(cfg.out)
    done = resume_ids(out)
    conversations, stats = load_conversations(cfg.data)
    if cfg.skip:
        conversations = conversations.select(range(min(cfg.skip, len(conversations)), len(conversations)))
    todo = [row for row in conversations if row["id"] not in done]
    print(f"[selfspec] {len(conversations)} conversations from {stats['source']}; {len(done)} already in {out}, "
          f"{len(todo)} to go", flush=True)

    device = Accelerator().device
    target = load_target_from_config(cfg.target, device=device)
    tokenizer = target.tokenizer
    template = resolve_chat_template(tokenizer, cfg.data.chat_template)
    set_seed(cfg.seed)
    generation = dict(
        max_new_tokens=cfg.max_new_tokens, do_sample=cfg.temperature > 0,
        eos_token_id=end_of_turn_ids(tokenizer, template),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        **({"temperature": cfg.temperature, "top_p": cfg.top_p} if cfg.temperature > 0 else
           {"temperature": None, "top_p": None, "top_k": None}),
    )
    max_prompt = cfg.max_prompt_tokens or cfg.data.max_length

    out.parent.mkdir(parents=True, exist_ok=True)
    totals = {"written": 0, "tokens": 0, "cut_turns": 0, "dropped": 0}
    t0 = time.time()
    with open(out, "a", encoding="utf-8") as f, tqdm(total=len(todo), unit="conv", desc="regenerating") as bar:
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start: start + cfg.batch_size]
            results = regenerate_batch(target.model, tokenizer, template, [r["messages"] for r in batch],
                                       generation, max_prompt, device, totals, cfg.max_turns)
            for row, messages in zip(batch, results):
                if any(m["role"] == "assistant" for m in messages):
                    # One write of a whole line, then flush: an interruption can only tear the last line.
                    f.write(json.dumps({"id": row["id"], "messages": messages}, ensure_ascii=False) + "\n")
                    totals["written"] += 1
                else:
                    totals["dropped"] += 1  # its first prompt alone was longer than max_prompt_tokens
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{totals['tokens'] / max(time.time() - t0, 1e-9):.1f}")
    summary = {"out": str(out), "resumed": len(done), **totals, "seconds": round(time.time() - t0, 1)}
    print(json.dumps(summary), flush=True)
    return summary


def regenerate_batch(model, tokenizer, template: str, conversations: list[list[dict[str, str]]],
                     generation: dict[str, Any], max_prompt: int, device, totals: dict[str, int],
                     max_turns: Optional[int] = None):
    """Rewrite the assistant turns of several conversations, turn by turn. Returns the new message lists."""
    import torch

    stops = set(generation["eos_token_id"])
    # Normalised conversations are [system?] (user, assistant)+: keep the system turn, replay the user turns.
    histories = [[m for m in conv[:1] if m["role"] == "system"] for conv in conversations]
    users = [[m["content"] for m in conv if m["role"] == "user"][:max_turns] for conv in conversations]
    alive = [True] * len(conversations)
    for turn in range(max((len(u) for u in users), default=0)):
        active, prompts = [], []
        for k, history in enumerate(histories):
            if not alive[k] or turn >= len(users[k]):
                continue
            messages = history + [{"role": "user", "content": users[k][turn]}]
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt:
                alive[k] = False
                continue
            active.append(k)
            prompts.append(ids)
        if not active:
            break
        width = max(len(p) for p in prompts)
        pad = generation["pad_token_id"]
        # Left padding: every prompt ends at the same column, so generated tokens line up.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [B, T]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.no_grad():
            generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generation)
        for k, row in zip(active, generated[:, width:].tolist()):
            end = next((i for i, t in enumerate(row) if t in stops), None)
            answer = row[:end] if end is not None else row
            totals["tokens"] += len(answer) + (end is not None)
            histories[k] += [{"role": "user", "content": users[k][turn]},
                             {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)}]
            if end is None:  # cut at max_new_tokens: later turns would answer a history it never finished
                totals["cut_turns"] += 1
                alive[k] = False
    return histories


def resume_ids(path: Path) -> set[str]:
    """Ids already written to `path`. A torn last line (no newline: the previous run was interrupted while
    writing it) is cut off the file; any other unreadable line is refused rather than guessed at."""
    if not path.exists():
        return set()
    done: set[str] = set()
    good_end = 0  # byte offset just after the last complete line
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # the torn tail: dropped below
            try:
                record = json.loads(line)
                done.add(str(record["id"]))
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{path}:{lineno}: not a line this script writes ({type(e).__name__}); "
                                "pass a new out= file") from None
            good_end += len(line)
    if good_end < path.stat().st_size:
        print(f"[selfspec] {path}: dropping a torn last line left by an interrupted run "
              f"({path.stat().st_size - good_end} bytes)", flush=True)
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done


if __name__ == "__main__":
    main()
