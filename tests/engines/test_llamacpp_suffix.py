"""scripts/llamacpp-suffix.patch in a real llama-server (F32, greedy, the embedded target): `--spec-type suffix`
drafts where the text repeats and answers every prompt with plain llama.cpp's tokens, alone and beside the shipped
EAGLE-3 head (`suffix,draft-eagle3`, the hybrid rows' lookup); its knobs reach it (--spec-suffix-n-max 1 drafts one
token a round, --spec-suffix-min-match 1000 none), and a knob out of range stops the server in one line.

Needs llama.cpp's tree (its converter makes the target's GGUF) and a built llama-server ($SELFSPEC_LLAMACPP_SERVER, or
make llamacpp's build); without them it skips in one line. Marked `llamacpp_server`: make check-llamacpp runs it.
"""

import pytest

from selfspec.core.errors import UserError

from llamacpp_converter import N, serve, served_eagle3

pytestmark = pytest.mark.llamacpp_server


def test_the_suffix_drafter_drafts_repeats_and_never_changes_the_answer(tmp_path):
    binary, prompts, base, head = served_eagle3(tmp_path)
    plain, _ = serve(binary, base, tmp_path / "plain.log", prompts, N)

    served, m = serve(binary, base + ["--spec-type", "suffix"], tmp_path / "suffix.log", prompts, N)
    assert served == plain
    drafts, drafted = m["spec_decode_num_drafts_total"], m["spec_decode_num_draft_tokens_total"]
    assert drafts > 0 and m["spec_decode_num_accepted_tokens_total"] > 0  # the summarised text repeats
    assert drafted > drafts  # a long match drafts more than one token

    served, m = serve(binary, base + ["--spec-type", "suffix", "--spec-suffix-n-max", "1"],
                      tmp_path / "suffix-1.log", prompts, N)
    assert served == plain and m["spec_decode_num_draft_tokens_total"] == m["spec_decode_num_drafts_total"] > 0
    served, m = serve(binary, base + ["--spec-type", "suffix", "--spec-suffix-min-match", "1000"],
                      tmp_path / "suffix-never.log", prompts, N)  # no match is that long: no draft
    assert served == plain and m.get("spec_decode_num_drafts_total", 0.0) == 0

    spec = ["-md", str(head), "--spec-draft-n-max", "5", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0.5"]
    served, m = serve(binary, base + spec + ["--spec-type", "suffix,draft-eagle3"], tmp_path / "hybrid.log", prompts, N)
    assert served == plain and m["spec_decode_num_accepted_tokens_total"] > 0


def test_a_suffix_knob_out_of_range_stops_the_server(tmp_path):
    binary, prompts, base, _ = served_eagle3(tmp_path)
    log = tmp_path / "bad.log"
    with pytest.raises(UserError):
        serve(binary, base + ["--spec-type", "suffix", "--spec-suffix-alpha", "0"], log, prompts[:1], 4)
    assert "suffix alpha must be in (0, 1024]" in log.read_text()
