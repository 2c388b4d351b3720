"""Shared by the GGUF export tests: a target GGUF holding only a tokenizer (what publish.export.write_gguf copies)."""

from __future__ import annotations

from typing import Optional

from gguf import GGUFWriter


def tokenizer_gguf(path, n_vocab: int, arch: str, add_bos: Optional[bool] = None, name: Optional[str] = None):
    """`n_vocab` tokens t0..t{n-1} (bos 1, eos 2) in a GGUF of architecture `arch`; `add_bos` writes
    tokenizer.ggml.add_bos_token when given, `name` general.name. -> path."""
    w = GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    w.add_token_types([1] * n_vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
