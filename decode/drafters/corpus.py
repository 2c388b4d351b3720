"""A corpus of earlier outputs for the suffix drafter (SuffixDecoding's global tree), as a static suffix array: the
corpus's token windows of `depth` tokens sorted once, so a pattern's occurrences are one contiguous range found by
binary search, and their continuations are the next column of that range (sorted too: counted in runs).

    load_corpus(path, tokenizer, depth)   a generate output_file (JSONL, its "completion" fields), a JSONL of
                                          {"text": ...} or of chats ({"messages": [...]}: their assistant turns, e.g.
                                          data/regenerated/), or a plain UTF-8 text file (one document)
    Corpus.match(tail) / .children(node)  the interface decode/drafters/suffix._expand walks

Memory: N tokens x depth int32 (16 x 4 bytes a token by default); files over MAX_BYTES are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from selfspec.core.errors import UserError

MAX_BYTES = 64 * 2**20  # a corpus this large is ~16M tokens: its index would take ~1 GB and minutes to build
MAX_DEPTH = 16  # the corpus's windows: a match of 15 tokens is already specific


class Corpus:
    """Suffix array over documents of token ids. A node is (lo, hi, m): the sorted windows lo..hi-1 begin with the
    same m tokens."""

    def __init__(self, documents: list[list[int]], depth: int):
        self.depth = min(depth, MAX_DEPTH)
        stream = np.concatenate([np.asarray(d + [-1], dtype=np.int32) for d in documents if d] or
                                [np.zeros(0, np.int32)])
        n = len(stream)
        padded = np.concatenate([stream, np.full(self.depth, -1, np.int32)])
        windows = np.lib.stride_tricks.sliding_window_view(padded, self.depth)[:n]  # [n, depth]
        order = np.lexsort(windows.T[::-1]) if n else np.zeros(0, np.int64)  # column 0 the primary key
        self.sorted = np.asfortranarray(windows[order])  # columns contiguous: each narrowing step is one slice
        self.tokens = int((stream >= 0).sum())

    def _narrow(self, lo: int, hi: int, k: int, t: int) -> tuple[int, int]:
        col, t = self.sorted[lo:hi, k], np.int32(t)  # an int32 needle: a Python int would cast the column first
        return lo + int(np.searchsorted(col, t, "left")), lo + int(np.searchsorted(col, t, "right"))

    def _find(self, pattern: list[int]) -> Optional[tuple[int, int, int]]:
        lo, hi = 0, len(self.sorted)
        for k, t in enumerate(pattern):
            lo, hi = self._narrow(lo, hi, k, t)
            if lo >= hi:
                return None
        return lo, hi, len(pattern)

    def match(self, tail: list[int]) -> Optional[tuple[tuple[int, int, int], int]]:
        """The longest suffix of `tail` (< depth tokens) that occurs with a continuation (binary search: having one
        is monotone in the length)."""
        tail = tail[max(0, len(tail) - self.depth + 1):]
        lo, hi, best = 1, len(tail), None
        while lo <= hi:
            m = (lo + hi) // 2
            node = self._find(tail[len(tail) - m:])
            if node is not None and self.sorted[node[1] - 1, m] >= 0:  # -1 (a document's end) sorts first
                best, lo = (node, m), m + 1
            else:
                hi = m - 1
        return best

    def children(self, node: tuple[int, int, int]) -> list[tuple[int, tuple[int, int, int], float]]:
        lo, hi, m = node
        if m >= self.depth:
            return []
        col = self.sorted[lo:hi, m]
        starts = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
        ends = np.r_[starts[1:], len(col)]
        real = col[starts] >= 0
        total = int((ends - starts)[real].sum())
        return [(int(col[a]), (lo + int(a), lo + int(b), m + 1), (int(b) - int(a)) / total)
                for a, b, r in zip(starts, ends, real) if r]


_LOADED: dict[tuple, Corpus] = {}  # the last corpus built, for the next drafter over the same file


def load_corpus(path: str, tokenizer, depth: int) -> Corpus:
    """The corpus file as a Corpus (read_documents says what it refuses); the same file, unchanged, for the same
    tokenizer and depth is built once per process (a benchmark builds one drafter per method)."""
    if not Path(path).is_file():
        read_documents(path)  # its one-line refusal
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, getattr(tokenizer, "name_or_path", id(tokenizer)),
           len(tokenizer), min(depth, MAX_DEPTH))
    if key not in _LOADED:
        ids = tokenizer(read_documents(path), add_special_tokens=False)["input_ids"]
        _LOADED.clear()
        _LOADED[key] = Corpus([list(d) for d in ids], depth)
    return _LOADED[key]


def read_documents(path: str) -> list[str]:
    """The corpus file's documents; one-line UserError when it is missing, not a file, too large, not UTF-8 text, a
    malformed JSONL or empty."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"suffix corpus '{path}' does not exist")
    if not p.is_file():
        raise UserError(f"suffix corpus '{path}' is not a regular file")
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise UserError(f"suffix corpus '{path}' is {size / 2**20:.0f} MiB; at most {MAX_BYTES // 2**20} MiB of "
                        f"earlier outputs (keep the most recent)")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"suffix corpus '{path}' is not UTF-8 text ({e.reason} at byte {e.start})") from e
    if "\x00" in text:
        raise UserError(f"suffix corpus '{path}' is not text (it holds NUL bytes)")
    documents = _documents(path, text)
    if not any(d.strip() for d in documents):
        raise UserError(f"suffix corpus '{path}' holds no text")
    return documents


def _documents(path: str, text: str) -> list[str]:
    """JSONL: each line's "completion" (a generate output_file) or "text"; otherwise the whole file is one document."""
    lines = text.split("\n")
    first = next((line for line in lines if line.strip()), "")
    if not first.lstrip().startswith("{"):
        return [text]
    docs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"suffix corpus {path}:{i} is not valid JSON ({e.msg}); a JSONL corpus holds one "
                            f"object per line") from e
        doc = obj.get("completion", obj.get("text")) if isinstance(obj, dict) else None
        if isinstance(obj, dict) and doc is None and isinstance(obj.get("messages"), list):  # a chat: its answers
            answers = [m.get("content") for m in obj["messages"]
                       if isinstance(m, dict) and m.get("role") == "assistant"]
            if answers and all(isinstance(a, str) for a in answers):
                docs.extend(answers)
                continue
        if not isinstance(doc, str):
            raise UserError(f'suffix corpus {path}:{i} has no "completion" or "text" string, nor assistant "messages"')
        docs.append(doc)
    return docs
