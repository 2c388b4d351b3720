"""scripts/llamacpp-spec-gate.patch in a real llama-server (F32, greedy, the embedded target and the shipped EAGLE-3
head): the cost gate and EAGLE-3's lazy feature reading change which rounds draft, never what the server answers.

- LLAMA_SPEC_GATE=0 (llama.cpp's own drafting) and =open (every round drafts, the target's features read lazily, in
  one batch when the head drafts) make the same drafts: the same number of drafts, of drafted tokens, and of
  accepted tokens at every draft position. A long prompt (over the 512 rows a stash holds before process() reads it)
  and prompts that share the chat template's prefix (the server reuses its cache: the stash goes back) are among them.
- The default (gate on) alone and beside the n-gram drafter (`--spec-type ngram-simple,draft-eagle3`) answer every
  prompt with plain llama.cpp's tokens.
- scripts/llamacpp-host-sampling.patch: with no GPU device our build samples the draft on the host, LLAMA_SPEC_GATE=0
  in the draft's graph (llama.cpp's default): the drafts compared above are the same either way.
- DFlash's lazy injection does the same for a block head: =0 and =open make the same drafts (the rows the target kept
  go into the draft's KV cache in one batch when the head drafts, as llama.cpp's own injects every batch and then drops
  the rejected rows), and the default answers with plain llama.cpp's tokens alone and beside the n-gram drafter.
- Every greedy request opens with the gate's probe: its first round (not scored) and PROBE more draft, whatever the
  requests before it made of the head (a head benched on one request is tried on the next).

Needs llama.cpp's tree (its converter makes the target's GGUF) and a built llama-server ($SELFSPEC_LLAMACPP_SERVER, or
make llamacpp's build); without them it skips in one line. Marked `llamacpp_server`: make check-llamacpp runs it.
"""

import pytest

from llamacpp_converter import DFLASH_HEAD, HEAD, N, serve, served_eagle3

pytestmark = pytest.mark.llamacpp_server


def _per_position(m: dict) -> list[float]:
    key = 'spec_decode_num_accepted_tokens_per_pos_total{{position="{}"}}'
    return [m.get(key.format(k), 0.0) for k in range(8)]


# (head, its llama.cpp draft type, its chain or block, what its server logs for the lazy path)
LAZY = [(HEAD, "eagle3", "5", "lazy feature reading"), (DFLASH_HEAD, "dflash", "3", "lazy injection")]


@pytest.mark.parametrize("head_dir, kind, n_max, lazy", LAZY, ids=["eagle3", "dflash"])
def test_the_gate_and_lazy_reading_change_which_rounds_draft_never_the_answer(tmp_path, head_dir, kind, n_max, lazy):
    binary, prompts, base, head = served_eagle3(tmp_path, head_dir)
    assert len(prompts[-1]) > 600  # two prefill batches of the draft's 512: the stash is read in process()
    spec = ["-md", str(head), "--spec-draft-n-max", n_max, "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    plain, _ = serve(binary, base, tmp_path / "plain.log", prompts, N)

    runs = {}
    for mode in ("0", "open"):
        runs[mode] = serve(binary, base + spec + ["--spec-type", f"draft-{kind}"], tmp_path / f"{kind}-{mode}.log",
                           prompts, N, env=(("LLAMA_SPEC_GATE", mode),))
        assert runs[mode][0] == plain, mode
    (_, own), (_, lazy_run) = runs["0"], runs["open"]
    counts = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total")
    assert [own[k] for k in counts] == [lazy_run[k] for k in counts] and own[counts[0]] > 0
    assert _per_position(own) == _per_position(lazy_run) and _per_position(own)[0] > 0, (own, lazy_run)
    assert f"{lazy} on" in (tmp_path / f"{kind}-open.log").read_text()
    assert f"{lazy} off" in (tmp_path / f"{kind}-0.log").read_text()
    if kind == "eagle3":  # scripts/llamacpp-host-sampling.patch: the same drafts as in the graph
        host = "the draft is sampled on the host"
        logs = [(tmp_path / f"{kind}-{mode}.log").read_text() for mode in ("open", "0")]
        assert host in logs[0] and host not in logs[1]

    for types in (f"draft-{kind}", f"ngram-simple,draft-{kind}"):  # our build's default: the gate on
        log = tmp_path / f"gated-{types}.log"
        served, _ = serve(binary, base + spec + ["--spec-type", types], log, prompts, N)
        assert served == plain, types
        assert f"cost gate on, {lazy} on" in log.read_text()


PROBE = 4  # scripts/llamacpp-spec-gate.patch: common_speculative_gate::PROBE


def test_every_request_opens_with_the_gates_probe(tmp_path):
    """The gated EAGLE-3 head alone, one server, the same 48-token request six times (each at least 8 rounds: a chain
    of at most 5): each request's drafts, read from /metrics after it, count at least its first round and the PROBE
    rounds after it, on any host, whether the head pays there or not; the answers are plain llama.cpp's."""
    from selfspec.engines.llamacpp import Server, free_port

    binary, prompts, base, head = served_eagle3(tmp_path)
    ids = prompts[1]
    plain, _ = serve(binary, base, tmp_path / "plain.log", [ids], N)
    spec = ["-md", str(head), "--spec-draft-n-max", "5", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
            "--spec-type", "draft-eagle3"]
    s = Server(binary, base + spec, free_port(), tmp_path / "gated.log", 120)
    try:
        drafts = []
        for _ in range(6):
            before = s.metrics().get("spec_decode_num_drafts_total", 0.0)
            assert s.complete(ids, N)["tokens"] == plain[0]
            drafts.append(s.metrics()["spec_decode_num_drafts_total"] - before)
    finally:
        s.stop()
    assert all(d >= PROBE + 1 for d in drafts), drafts
    assert "cost gate on" in (tmp_path / "gated.log").read_text()
