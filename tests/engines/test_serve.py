"""engines/: the engines serve_bench drives (selfspec's own, llama-server, vLLM's worker) on tiny targets or fakes,
the DFlash knob screening, and the cost model. The real llama.cpp and vLLM runs are `make check-llamacpp` /
`make check-vllm` (not tests)."""

import json
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from selfspec.core.errors import UserError
from selfspec.target.model import load_target
from selfspec.heads.checkpoint import head_record, save_head
from selfspec.methods.dflash.head import build_dflash
from selfspec.methods.eagle3.head import build_eagle3
from selfspec.engines import costs
from selfspec.engines.methods import Method, grid, grid_table, screen


@pytest.fixture(scope="module")
def target():
    return load_target("tiny:llama")


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """An EAGLE-3 head and a DFlash head (block 4) of tiny:llama, saved as checkpoints."""
    folder = tmp_path_factory.mktemp("heads")
    torch.manual_seed(0)
    e3 = build_eagle3(target.model, aux_layers=[0, 1, 1])
    d = build_dflash(target.model, block_size=4, num_layers=1)
    save_head(e3, folder / "e3", head_record(e3, target.identity, training={}, metrics={}))
    save_head(d, folder / "dflash", head_record(d, target.identity, training={}, metrics={}))
    return {"eagle3": str(folder / "e3"), "dflash": str(folder / "dflash")}


PROMPTS = [[1, 5, 9, 12, 40], [3, 7, 7, 7, 2, 90]]


# ---------------------------------------------------------------------------------------------- methods


def test_grid_crosses_the_knobs_and_screen_keeps_the_fastest():
    m = Method("dflash head", "dflash", 7, 0.0, "h")
    g = grid(m, [3, 7], [0.0, 0.5])
    assert [(c.num_draft, c.p_min) for c in g] == [(3, 0.0), (3, 0.5), (7, 0.0), (7, 0.5)]
    assert grid(m, [], []) == [m] and all(c.head == "h" for c in g)
    speed = {(3, 0.0): 1.0, (3, 0.5): 4.0, (7, 0.0): 2.0, (7, 0.5): 3.0}
    best, rows = screen(g, lambda c: {"tokens": [[0] * int(10 * speed[c.num_draft, c.p_min])], "seconds": [1.0],
                                      "tau": 1.5})
    assert (best.num_draft, best.p_min) == (3, 0.5) and [r.get("best", False) for r in rows] == [0, 1, 0, 0]
    table = grid_table({"llama.cpp F32": {"dflash head": rows}})
    assert "| llama.cpp F32 | dflash head | 3 | 0.5 | 40.0 | 1.50 | * |" in table


def test_screen_keeps_the_first_unless_another_beats_it_by_more_than_the_margin():
    m = Method("eagle3 head + lookup", "hybrid", 5, 0.5, "h", base="eagle3")
    kinds = [replace(m, lookup=k) for k in ("ngram-simple", "ngram-mod", "ngram-map-k")]

    def run(speed):
        return lambda c: {"tokens": [[0] * speed[c.lookup]], "seconds": [1.0], "tau": 2.0}

    near = {"ngram-simple": 100, "ngram-mod": 104, "ngram-map-k": 90}  # 4 % faster: within the margin, noise
    assert screen(kinds, run(near))[0].lookup == "ngram-mod"
    best, rows = screen(kinds, run(near), margin=0.05)
    assert best.lookup == "ngram-simple" and [r.get("best", False) for r in rows] == [1, 0, 0]
    far = {"ngram-simple": 100, "ngram-mod": 106, "ngram-map-k": 90}
    assert screen(kinds, run(far), margin=0.05)[0].lookup == "ngram-mod"


# ---------------------------------------------------------------------------------------------- selfspec


def test_selfspec_rows_of_both_heads_equal_plain_and_count_steps(target, heads):
    from selfspec.engines.selfspec_engine import selfspec_rows

    methods = [Method("plain", "none"), Method("eagle3 head", "eagle3", 3, 0.0, heads["eagle3"]),
               Method("dflash head", "dflash", 3, 0.0, heads["dflash"]), Method("ngram", "ngram", 3)]
    rows = selfspec_rows(target, methods, PROMPTS, 12, warmup=1)
    assert list(rows) == ["plain", "eagle3 head", "dflash head", "ngram"]
    for name, r in rows.items():  # greedy fp32 speculative decoding is lossless
        assert r["tokens"] == rows["plain"]["tokens"], name
        assert r["steps"] >= len(PROMPTS) and r["step_s"] > 0
    assert rows["plain"]["tau"] == 1.0 and rows["plain"]["verified_tokens"] == rows["plain"]["steps"] - len(PROMPTS)
    # a DFlash pass verifies the root + 3 drafts (fewer only where the token budget is nearly spent)
    d = rows["dflash head"]
    assert d["verified_tokens"] > 2 * (d["steps"] - len(PROMPTS)) and d["draft_s"] > 0


def test_selfspec_rows_repeats_decode_every_prompt_again_and_keep_the_mean(target, monkeypatch):
    """selfspec_repeats: all prompts once, then again, the rotation going on (as llama.cpp's rows); a prompt's
    seconds and counters are its decodes' means, its tokens the first decode's, and a later decode with other tokens
    is counted."""
    from selfspec.decode import engine
    from selfspec.engines.selfspec_engine import selfspec_rows

    calls = []

    def fake_generate(target, drafter, ids, n, temperature=0.0, seed=0, eos_token_ids=()):
        name = "plain" if drafter is None else "ngram"
        calls.append((name, tuple(ids)))
        k = sum(c[0] == name for c in calls)  # this drafter's k-th decode
        odd = name == "ngram" and k == 4  # its second decode of the second prompt
        passes = 2 if drafter is None else 1
        return types.SimpleNamespace(tokens=[9] * n if odd else list(range(n)), total_s=0.5 * k,
                                     committed_by_verify=passes + (0 if drafter is None else k), verify_passes=passes,
                                     drafted_tokens=0 if drafter is None else 2 * k, draft_s=0.1 * k,
                                     target_passes=passes + 1, accepted_by_position=[] if drafter is None else [k, 1])

    monkeypatch.setattr(engine, "generate", fake_generate)
    methods = [Method("plain", "none"), Method("ngram", "ngram", 3)]
    rows = selfspec_rows(target, methods, [[1], [2]], 4, warmup=0, repeats=2)
    assert calls == [("plain", (1,)), ("ngram", (1,)), ("ngram", (2,)), ("plain", (2,)),
                     ("plain", (1,)), ("ngram", (1,)), ("ngram", (2,)), ("plain", (2,))]
    ngram, plain = rows["ngram"], rows["plain"]
    assert plain["seconds"] == [pytest.approx((0.5 + 1.5) / 2), pytest.approx((1.0 + 2.0) / 2)]
    assert ngram["tokens"] == [[0, 1, 2, 3], [0, 1, 2, 3]] and ngram["repeats_differ"] == 1
    assert plain["repeats_differ"] == 0 and plain["repeats"] == 2 == ngram["repeats"]
    # ngram's decodes 1 and 3 are prompt 1's, 2 and 4 prompt 2's: accepted k, 1 pass each
    assert ngram["per_prompt"] == [{"accepted": 2.0, "drafts": 1.0, "accepted_by_position": [2.0, 1.0]},
                                   {"accepted": 3.0, "drafts": 1.0, "accepted_by_position": [3.0, 1.0]}]
    assert ngram["tau"] == pytest.approx((2 + 3 + 4 + 5) / 4) and ngram["steps"] == pytest.approx(4.0)
    assert ngram["verified_tokens"] == pytest.approx(2.0 + (2 + 4 + 6 + 8) / 2)
    assert ngram["draft_s"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 2)
    assert "repeats" not in selfspec_rows(target, methods, [[1]], 4, warmup=0)["plain"]
    with pytest.raises(UserError, match="repeats 0"):
        selfspec_rows(target, methods, [[1]], 4, warmup=0, repeats=0)


def test_selfspec_pass_costs_time_each_M_and_one_draft_pass(target, heads):
    from selfspec.decode.drafters import build_drafter
    from selfspec.engines.selfspec_engine import pass_costs

    drafts = {"eagle3 head": build_drafter("eagle3", target, head=heads["eagle3"], num_draft=3),
              "dflash head": build_drafter("dflash", target, head=heads["dflash"], num_draft=2)}
    out = pass_costs(target, list(range(3, 40)), [1, 2, 4], drafts, repeats=2)
    assert list(out["pass_ms"]) == [1, 2, 4] and out["c1_ms"] == out["pass_ms"][1] > 0
    assert out["draft_ms"]["eagle3 head"]["tokens"] == 3 and out["draft_ms"]["dflash head"]["tokens"] == 2
    assert out["context_tokens"] == 37


# ---------------------------------------------------------------------------------------------- llama.cpp


def test_llamacpp_rows_serve_each_head_by_its_type_and_read_tau_from_counters(tmp_path, monkeypatch):
    """One llama-server per method on its own port (the DFlash head as --spec-type draft-dflash with its own
    n-max and p-min); the prompts go to the servers in turn, the order rotated per prompt; tau = 1 + accepted /
    drafts from /metrics; steps = tokens - accepted, step_s = the server's decode time."""
    from selfspec.engines import llamacpp

    started, ports, requests, envs = {}, set(), [], {}

    class FakeServer:
        def __init__(self, binary, args, port, log, timeout_s, env=()):
            self.args, self.start_s, self.n = args, 0.1, 0
            self.name = log.name.removeprefix("server-f32-").removesuffix(".log")
            started[self.name] = args
            envs[self.name] = env
            ports.add(port)

        def complete(self, ids, n, cache_prompt=False):
            requests.append((self.name, tuple(ids)))
            return {"tokens": list(range(n)), "wall_s": 0.5,
                    "timings": {"predicted_per_second": 2 * n, "predicted_ms": 250.0}}

        def metrics(self):  # each request: 4 drafts of 3 tokens, 6 of them accepted: tau 1 + 6/4
            self.n += 1
            k = (self.n // 2) if "-md" in self.args else 0
            return {"spec_decode_num_drafts_total": 4.0 * k, "spec_decode_num_draft_tokens_total": 12.0 * k,
                    "spec_decode_num_accepted_tokens_total": 6.0 * k}

        def stop(self):
            pass

    monkeypatch.setattr(llamacpp, "Server", FakeServer)
    opts = llamacpp.ServerOptions("llama-server", args=["--no-repack"], head_args=["-td", "1"])
    methods = [Method("plain", "none"), Method("eagle3 head", "eagle3", 3, 0.5, "e3.gguf"),
               Method("dflash head", "dflash", 5, 0.2, "d.gguf"), Method("ngram", "ngram", 3)]
    rows = llamacpp.llamacpp_rows(opts, tmp_path / "t.gguf", methods, [[1, 2], [3]], tmp_path, "f32", 8, warmup=0)
    plain, e3, d = started["plain"], started["eagle3_head"], started["dflash_head"]
    assert all(a.count("--no-repack") == 1 for a in started.values())
    assert e3[-2:] == ["-td", "1"] and d[-2:] == ["-td", "1"] and "-td" not in plain + started["ngram"]
    assert d[d.index("-md") + 1] == "d.gguf" and d[d.index("--spec-type") + 1] == "draft-dflash"
    assert d[d.index("--spec-draft-n-max") + 1] == "5" and d[d.index("--spec-draft-p-min") + 1] == "0.2"
    assert e3[e3.index("--spec-type") + 1] == "draft-eagle3" and "-md" not in plain
    assert rows["dflash head"]["tau"] == pytest.approx(2.5) and rows["plain"]["tau"] == 1.0
    assert rows["dflash head"]["steps"] == 16 - 12 and rows["dflash head"]["step_s"] == pytest.approx(0.5)
    assert rows["dflash head"]["verified_tokens"] == 4 + 24 and rows["plain"]["steps"] == 16
    assert len(ports) == 4 and requests == [("plain", (1, 2)), ("eagle3_head", (1, 2)), ("dflash_head", (1, 2)),
                                            ("ngram", (1, 2)), ("eagle3_head", (3,)), ("dflash_head", (3,)),
                                            ("ngram", (3,)), ("plain", (3,))]


def test_llamacpp_rows_repeats_serve_every_prompt_again_and_keep_the_mean(tmp_path, monkeypatch):
    """llamacpp_repeats: all prompts once, then again, the rotation going on; a prompt's seconds and counters are its
    requests' means, its tokens the first request's, and a later request with other tokens is counted."""
    from selfspec.engines import llamacpp

    requests = []

    class FakeServer:
        def __init__(self, binary, args, port, log, timeout_s, env=()):
            self.name, self.n, self.calls = log.name.removeprefix("server-f32-").removesuffix(".log"), 0, 0
            self.start_s = 0.1

        def complete(self, ids, n, cache_prompt=False):
            requests.append((self.name, tuple(ids)))
            self.calls += 1
            odd = self.name == "ngram" and self.calls == 4  # its second request for the second prompt
            return {"tokens": [9] * n if odd else list(range(n)), "wall_s": 0.5 * self.calls,
                    "timings": {"predicted_per_second": 2 * n, "predicted_ms": 100.0 * self.calls}}

        def metrics(self):  # every request: 2 drafts, 3 accepted
            self.n += 1
            return {"spec_decode_num_drafts_total": 2.0 * (self.n // 2),
                    "spec_decode_num_draft_tokens_total": 4.0 * (self.n // 2),
                    "spec_decode_num_accepted_tokens_total": 3.0 * (self.n // 2)}

        def stop(self):
            pass

    monkeypatch.setattr(llamacpp, "Server", FakeServer)
    methods = [Method("plain", "none"), Method("ngram", "ngram", 3)]
    rows = llamacpp.llamacpp_rows(llamacpp.ServerOptions("llama-server"), tmp_path / "t.gguf", methods, [[1], [2]],
                                  tmp_path, "f32", 4, warmup=0, repeats=2)
    assert requests == [("plain", (1,)), ("ngram", (1,)), ("ngram", (2,)), ("plain", (2,)),
                        ("plain", (1,)), ("ngram", (1,)), ("ngram", (2,)), ("plain", (2,))]
    ngram, plain = rows["ngram"], rows["plain"]
    assert plain["seconds"] == [pytest.approx((0.5 + 1.5) / 2), pytest.approx((1.0 + 2.0) / 2)]
    assert ngram["tokens"] == [[0, 1, 2, 3], [0, 1, 2, 3]] and ngram["repeats_differ"] == 1
    assert plain["repeats_differ"] == 0 and plain["repeats"] == 2
    assert ngram["per_prompt"] == [{"accepted": 3.0, "drafts": 2.0}] * 2 and ngram["tau"] == pytest.approx(2.5)
    assert ngram["steps"] == 8 - 6 and ngram["step_s"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 2)
    assert ngram["verified_tokens"] == 2 + 8
    with pytest.raises(UserError, match="repeats 0"):
        llamacpp.llamacpp_rows(llamacpp.ServerOptions("llama-server"), tmp_path / "t.gguf", methods, [[1]], tmp_path,
                               "f32", 4, warmup=0, repeats=0)


def test_llamacpp_ngram_lengths_reach_each_kind_of_the_ngram_and_hybrid_rows():
    """llamacpp_ngram_match / _draft become the flags of the row's n-gram kind (llama.cpp keeps each kind's lengths
    apart, common/arg.cpp); plain and head rows get none, ngram-cache has none, None keeps llama.cpp's default."""
    from selfspec.engines import llamacpp

    opts = llamacpp.ServerOptions("llama-server", ngram_match=3, ngram_draft=8)
    ngram, hybrid = Method("ngram", "ngram", 5), Method("h", "hybrid", 5, 0.5, "e3.gguf", base="eagle3",
                                                        lookup="ngram-map-k")
    args = llamacpp.server_args(opts, Path("t.gguf"), ngram)
    assert args[args.index("--spec-ngram-simple-size-n") + 1] == "3"
    assert args[args.index("--spec-ngram-simple-size-m") + 1] == "8"
    args = llamacpp.server_args(opts, Path("t.gguf"), hybrid)
    assert args[args.index("--spec-ngram-map-k-size-n") + 1] == "3" and "--spec-ngram-simple-size-n" not in args
    assert args[args.index("--spec-type") + 1] == "ngram-map-k,draft-eagle3"
    for m in (Method("plain", "none"), Method("e", "eagle3", 5, 0.5, "e3.gguf")):
        assert not [a for a in llamacpp.server_args(opts, Path("t.gguf"), m) if a.startswith("--spec-ngram")]
    assert llamacpp.ngram_args("ngram-mod", 3, 8) == ["--spec-ngram-mod-n-match", "3", "--spec-ngram-mod-n-max", "8",
                                                      "--spec-ngram-mod-n-min", "1"]
    assert llamacpp.ngram_args("ngram-cache", 3, 8) == [] and llamacpp.ngram_args("ngram-simple", None, None) == []
    assert llamacpp.ngram_args("ngram-simple", None, 8) == ["--spec-ngram-simple-size-m", "8"]


def test_a_rows_own_ngram_lengths_win_over_the_options():
    """Method.ngram_lengths (what llamacpp_ngram_lengths screened) replaces the options' lengths in that row alone."""
    from selfspec.engines import llamacpp

    opts = llamacpp.ServerOptions("llama-server", ngram_match=3, ngram_draft=8)
    m = Method("h", "hybrid", 5, 0.5, "e3.gguf", base="eagle3", lookup="ngram-simple", ngram_lengths=(12, 48))
    args = llamacpp.server_args(opts, Path("t.gguf"), m)
    assert args[args.index("--spec-ngram-simple-size-n") + 1] == "12"
    assert args[args.index("--spec-ngram-simple-size-m") + 1] == "48" and args.count("--spec-ngram-simple-size-n") == 1
    assert m.knobs == "n=5 p=0.5 ngram-simple 12/48"


def _bench_llamacpp(tmp_path, monkeypatch, wall_s, options, head_ggufs=None):
    """bench_llamacpp at F32 with one EAGLE-3 head over two one-token prompts, the screens on the first, against fake
    llama-servers whose every request takes `wall_s(args)` seconds (the target's and head's conversions skipped;
    `head_ggufs` stands in for the head's export). Returns its rows, the screening grids and each server started,
    (log name, args)."""
    from omegaconf import OmegaConf

    from selfspec.engines import bench, llamacpp

    started = []

    class FakeServer:
        def __init__(self, binary, args, port, log, timeout_s, env=()):
            self.start_s, self.args = 0.1, args
            started.append((log.name, args))

        def complete(self, ids, n, cache_prompt=False):
            return {"tokens": [1] * n, "wall_s": wall_s(self.args), "timings": {"predicted_per_second": 2 * n}}

        def metrics(self):
            return {}

        def stop(self):
            pass

    monkeypatch.setattr(llamacpp, "Server", FakeServer)
    monkeypatch.setattr(llamacpp, "convert_target", lambda *a: tmp_path / "t.gguf")
    monkeypatch.setattr(bench, "head_ggufs", head_ggufs or (lambda *a: {"eagle3 head": tmp_path / "e3.gguf"}))
    cfg = OmegaConf.merge(OmegaConf.structured(bench.ServeBenchConfig), OmegaConf.from_dotlist(
        ["llamacpp_types=[f32]", "screen_prompts=1", "warmup=0", "max_new_tokens=4", *options]))
    grids = {}
    out = bench.bench_llamacpp(cfg, None, tmp_path, [{"name": "eagle3 head", "kind": "eagle3", "spec": "e3"}],
                               [[1], [2]], tmp_path, grids, {}, {})
    return out["llama.cpp F32"], grids.get("llama.cpp F32", {}), started


def test_llamacpp_ngram_lengths_are_screened_and_the_hybrids_take_the_kept_pair(tmp_path, monkeypatch):
    """llamacpp_ngram_lengths: each pair runs the n-gram row on the first screen_prompts prompts, the fastest pair
    (here the one that drafts 48: the fake server answers it twice as fast) is the n-gram row's and every hybrid
    row's whose lookup is an n-gram kind (ours and llama.cpp's own; lookup.kind=ngram: selfspec's hybrids take
    the n-gram lookup, so llama.cpp's the n-gram row's kind), the grid is printed and reported."""
    rows, grids, started = _bench_llamacpp(tmp_path, monkeypatch, lambda args: 0.25 if "48" in args else 0.5,
                                           ["llamacpp_ngram_lengths=[[3,8],[12,48]]", "lookup.kind=ngram"])
    assert [r["ngram_lengths"] for r in grids["ngram"]] == [[3, 8], [12, 48]]
    assert rows["ngram"]["ngram_lengths"] == [12, 48]
    hybrids = [n for n in rows if "lookup" in n]
    assert len(hybrids) == 2 and all(rows[n]["ngram_lengths"] == [12, 48] for n in hybrids)
    final = [args for name, args in started[-len(rows):] if "ngram" in name or "lookup" in name]
    assert final and all(a[a.index("--spec-ngram-simple-size-m") + 1] == "48" for a in final)
    alone = [a for name, a in started if name == "server-f32-eagle3_head.log"]
    assert alone and not [x for a in alone for x in a if x.startswith("--spec-ngram")]


@pytest.mark.parametrize("kind, first", [("suffix", "suffix"), ("ngram", "ngram-simple")])
@pytest.mark.parametrize("margin", [0.05, 0.0])
def test_llamacpp_hybrids_screen_selfspecs_lookup_first_and_keep_it_within_the_margin(tmp_path, monkeypatch,
                                                                                     kind, first, margin):
    """llamacpp_hybrid_ngrams lists the lookups beside the one selfspec's hybrids take (lookup.kind: our build's
    suffix drafter, else the n-gram row's kind, llamacpp_ngram), which is screened first even when the list leaves
    it out; a kind 3 % faster on the screen is noise at the default margin."""
    def wall_s(args):
        return 0.97 if "--spec-type" in args and args[args.index("--spec-type") + 1].startswith("ngram-mod,") else 1.0

    rows, grids, _ = _bench_llamacpp(tmp_path, monkeypatch, wall_s, [
        "llamacpp_hybrid_ngrams=[ngram-mod]", f"llamacpp_hybrid_margin={margin}", "llamacpp_own_rows=false",
        f"lookup.kind={kind}"])
    screened = grids["eagle3 head + lookup"]
    kept = first if margin else "ngram-mod"
    assert [r["lookup"] for r in screened] == [first, "ngram-mod"]
    assert [r["lookup"] for r in screened if r.get("best")] == [kept]
    assert rows["eagle3 head + lookup"]["lookup"] == kept


def test_llamacpp_hybrids_take_the_suffix_drafter_unless_told(tmp_path, monkeypatch):
    """With no lookups to screen, every hybrid row (ours and llama.cpp's own) drafts with our build's suffix drafter
    beside the head, as selfspec's hybrids with theirs, and with no n-gram lengths."""
    rows, grids, started = _bench_llamacpp(tmp_path, monkeypatch, lambda args: 1.0,
                                           ["llamacpp_ngram_lengths=[[3,8],[12,48]]"])
    hybrids = [n for n in rows if "lookup" in n]
    assert len(hybrids) == 2 and all(rows[n]["lookup"] == "suffix" and "ngram_lengths" not in rows[n]
                                     for n in hybrids)
    final = dict(started[-len(rows):])
    for log in ("server-f32-eagle3_head_+_lookup.log", "server-f32-eagle3_head_+_lookup_llama.cpps_own.log"):
        args = final[log]
        assert args[args.index("--spec-type") + 1] == "suffix,draft-eagle3"
        assert not [a for a in args if a.startswith("--spec-ngram")]
    assert "eagle3 head + lookup" not in grids


def test_llamacpp_suffix_row_and_hybrid_draft_with_selfspecs_suffix_knobs(tmp_path, monkeypatch):
    """Our build's suffix drafter (scripts/llamacpp-suffix.patch) gets a row of its own and is a lookup the hybrids
    screen, both with selfspec's `lookup` knobs (as vLLM's suffix row) and no n-gram lengths; llama.cpp's own rows
    leave it out (it has no gate to turn off)."""
    from selfspec.engines.bench import llamacpp_own

    rows, grids, started = _bench_llamacpp(tmp_path, monkeypatch, _suffix_faster,
                                           ["llamacpp_hybrid_ngrams=[ngram-simple]", "lookup.alpha=2.0",
                                            "lookup.depth=12",
                                            "llamacpp_own_rows=false", "llamacpp_ngram_match=3",
                                            "llamacpp_ngram_draft=8", "llamacpp_suffix_min_match=3"])
    knobs = ["--spec-suffix-depth", "12", "--spec-suffix-min-prob", "0.5", "--spec-suffix-alpha", "2",
             "--spec-suffix-n-max", "16", "--spec-suffix-min-match", "3"]
    final = dict(started[-len(rows):])
    suffix, hybrid = final["server-f32-suffix.log"], final["server-f32-eagle3_head_+_lookup.log"]
    assert suffix[suffix.index("--spec-type") + 1] == "suffix" and suffix[-len(knobs):] == knobs
    assert hybrid[hybrid.index("--spec-type") + 1] == "suffix,draft-eagle3" and "-md" in hybrid
    assert hybrid[hybrid.index("--spec-suffix-depth"):][:len(knobs)] == knobs
    assert not [a for a in suffix + hybrid if a.startswith("--spec-ngram")]
    assert rows["suffix"]["num_draft"] == 16 and rows["eagle3 head + lookup"]["lookup"] == "suffix"
    assert [r["lookup"] for r in grids["eagle3 head + lookup"]] == ["suffix", "ngram-simple"]
    assert llamacpp_own([Method("suffix", "suffix", 16)]) == []


def _suffix_faster(args):
    """A server's fake request time: a suffix server (alone or a hybrid's lookup) twice as fast as any other, so that
    the hybrids' screen keeps the suffix."""
    return 0.5 if "--spec-type" in args and args[args.index("--spec-type") + 1].startswith("suffix") else 1.0


def test_llamacpp_suffix_drafts_from_two_matched_tokens_unless_told(tmp_path, monkeypatch):
    """llamacpp_suffix_min_match's default reaches the suffix servers: 2 (a 1-token match's draft costs llama.cpp
    more than it returns, docs/hybrid.md), while selfspec's `lookup` knobs stay SuffixDecoding's."""
    rows, _, started = _bench_llamacpp(tmp_path, monkeypatch, _suffix_faster,
                                       ["llamacpp_hybrid_ngrams=[suffix]", "llamacpp_own_rows=false"])
    final = dict(started[-len(rows):])
    for log in ("server-f32-suffix.log", "server-f32-eagle3_head_+_lookup.log"):
        args = final[log]
        assert args[args.index("--spec-suffix-min-match") + 1] == "2"
        assert args[args.index("--spec-suffix-alpha") + 1] == "1"


@pytest.mark.parametrize("told, min_prob", [([], "0.5"), (["llamacpp_suffix_min_prob=0.7"], "0.7"),
                                            (["llamacpp_suffix_min_prob=null", "lookup.min_prob=0.2"], "0.2")])
def test_llamacpp_suffix_drafts_likely_paths_in_its_row_and_the_hybrids(tmp_path, monkeypatch, told, min_prob):
    """llamacpp_suffix_min_prob reaches the suffix row and the hybrids' suffix alike, 0.5 unless told (llama.cpp
    verifies the first drafter's chain, so an ambiguous suffix draft would pre-empt the head), null hands it
    `lookup.min_prob`, which selfspec's own suffix (a tree beside the head) keeps at 0.1."""
    rows, _, started = _bench_llamacpp(tmp_path, monkeypatch, _suffix_faster,
                                       ["llamacpp_hybrid_ngrams=[suffix]", "llamacpp_own_rows=false", *told])
    final = dict(started[-len(rows):])
    for log in ("server-f32-suffix.log", "server-f32-eagle3_head_+_lookup.log"):
        args = final[log]
        assert args[args.index("--spec-suffix-min-prob") + 1] == min_prob


def test_llamacpp_own_rows_run_the_same_servers_without_the_gate(tmp_path, monkeypatch):
    """llamacpp_own_rows: each head and hybrid row again as llama.cpp itself drafts (LLAMA_SPEC_GATE=0 in that
    server's environment alone, scripts/llamacpp-spec-gate.patch), with the same arguments; plain and n-gram rows get
    none, and our build's rows keep the environment they were started in."""
    from selfspec.engines import llamacpp
    from selfspec.engines.bench import llamacpp_own

    started = {}

    class FakeServer:
        def __init__(self, binary, args, port, log, timeout_s, env=()):
            self.start_s = 0.1
            started[log.name] = (args, env)

        def complete(self, ids, n, cache_prompt=False):
            return {"tokens": [1] * n, "wall_s": 0.5, "timings": {"predicted_per_second": 2 * n}}

        def metrics(self):
            return {}

        def stop(self):
            pass

    monkeypatch.setattr(llamacpp, "Server", FakeServer)
    ours = [Method("plain", "none"), Method("eagle3 head", "eagle3", 3, 0.5, "e3.gguf"), Method("ngram", "ngram", 3),
            Method("eagle3 head + lookup", "hybrid", 3, 0.5, "e3.gguf", base="eagle3", lookup="ngram-mod")]
    own = llamacpp_own(ours)
    assert [m.name for m in own] == ["eagle3 head, llama.cpp's own", "eagle3 head + lookup, llama.cpp's own"]
    assert own[1].knobs == "n=3 p=0.5 ngram-mod LLAMA_SPEC_GATE=0"
    rows = llamacpp.llamacpp_rows(llamacpp.ServerOptions("llama-server"), tmp_path / "t.gguf", ours + own, [[1]],
                                  tmp_path, "f32", 4, warmup=0)
    assert set(rows) == {m.name for m in ours + own}
    gated, ungated = started["server-f32-eagle3_head_+_lookup.log"], started[
        "server-f32-eagle3_head_+_lookup_llama.cpps_own.log"]
    assert gated[0] == ungated[0] and "ngram-mod,draft-eagle3" in gated[0]
    assert gated[1] == () and ungated[1] == (("LLAMA_SPEC_GATE", "0"),)
    assert started["server-f32-plain.log"][1] == started["server-f32-ngram.log"][1] == ()


def test_a_converted_target_gguf_is_reused_only_for_the_folder_it_came_from_unchanged(tmp_path):
    """A run over another target found the last run's target-q8_0.gguf and served it (2026-12-02: Qwen2.5-Coder-1.5B's
    prompts sent to SmolLM2's conversion, every request refused). The name now carries the folder: another folder or
    a changed file converts anew, and the work folder keeps one conversion per precision."""
    import os

    from selfspec.engines.llamacpp import target_gguf_path

    work, a, b = tmp_path / "work", tmp_path / "a", tmp_path / "b"
    for folder in (work, a, b):
        folder.mkdir()
    for folder in (a, b):
        (folder / "config.json").write_text("{}")
    first = target_gguf_path(work, a, "q8_0")
    assert first == target_gguf_path(work, a, "q8_0") and first.name.startswith("target-")
    first.write_text("x")
    (work / "target-q8_0.gguf").write_text("x")  # a conversion named as before
    (work / "target-abc-bf16.gguf").write_text("x")  # another precision
    other = target_gguf_path(work, b, "q8_0")
    assert other != first and not first.exists() and not (work / "target-q8_0.gguf").exists()
    assert (work / "target-abc-bf16.gguf").exists()
    stat = (a / "config.json").stat()
    os.utime(a / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert target_gguf_path(work, a, "q8_0") != first  # the same folder, changed since


def test_llamacpp_pass_costs_read_the_servers_prompt_timings(tmp_path, monkeypatch):
    """pass[M] = the server's prompt_ms for M new tokens after the cached context; c1 = decode ms per token."""
    from selfspec.engines import llamacpp

    sent = []

    class FakeServer:
        def __init__(self, binary, args, port, log, timeout_s):
            assert "-md" not in args

        def complete(self, ids, n, cache_prompt=False):
            sent.append((len(ids), n, cache_prompt))
            new = max(len(ids) - 10, 1)
            return {"timings": {"prompt_ms": 2.0 * new + 3, "prompt_n": new, "predicted_ms": 40.0 * n,
                                "predicted_n": n}}

        def stop(self):
            pass

    monkeypatch.setattr(llamacpp, "Server", FakeServer)
    out = llamacpp.pass_costs(llamacpp.ServerOptions("s"), tmp_path / "t.gguf", PROMPTS, tmp_path, "f32", [1, 3],
                              context_tokens=10, repeats=2, decode_tokens=4)
    assert out["pass_ms"] == {1: 5.0, 3: 9.0} and out["c1_ms"] == 40.0 and out["prompt_n"] == {1: [1], 3: [3]}
    assert (13, 1, True) in sent and sent[-1] == (11, 4, False)


# ---------------------------------------------------------------------------------------------- vLLM


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in `vllm` package: LLM records its kwargs and answers greedy requests with fixed tokens; with a draft,
    each request adds 2 drafts and 3 accepted tokens to its spec-decode counters."""
    made = []

    class LLM:
        def __init__(self, **kwargs):
            self.kwargs, self.requests = kwargs, 0
            made.append(self)

        def generate(self, prompts, params, use_tqdm=False):
            self.requests += 1
            out = types.SimpleNamespace(token_ids=[7] * params.max_tokens)
            return [types.SimpleNamespace(outputs=[out], prompt_token_ids=p) for p in prompts]

        def get_metrics(self):  # plain vLLM has no spec-decode counters
            if "speculative_config" not in self.kwargs:
                return []
            return [types.SimpleNamespace(name="vllm:spec_decode_num_drafts", value=2 * self.requests),
                    types.SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=3 * self.requests)]

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    return made


def _in_process_worker(monkeypatch, fake_vllm):
    """engines/vllm_engine.py's VllmWorker, with the worker's own _build_llm and OPS run in this process on the fake
    vLLM; a request takes 1 ms per prompt token and 10 ms per generated one."""
    from selfspec.target import vllm_worker
    from selfspec.engines import vllm_engine

    class InProcess:
        def __init__(self, python, target, max_model_len, **kw):
            self.llm = vllm_worker._build_llm({"target": target, "max_model_len": max_model_len, **kw})
            self.start_s = 1.0

        def request(self, op, **fields):
            ms = sum(len(p) + 10 * fields["max_tokens"] for p in fields.get("prompts", []))
            return {**vllm_worker.OPS[op](self.llm, fields), "seconds": ms / 1e3}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(vllm_engine, "VllmWorker", InProcess)
    return vllm_engine


def test_vllm_serves_a_dflash_head_with_method_dflash(tmp_path, fake_vllm, monkeypatch):
    vllm_engine = _in_process_worker(monkeypatch, fake_vllm)
    m = Method("dflash head", "dflash", head="d", num_draft=3)
    row = vllm_engine.vllm_rows("python", tmp_path, tmp_path, "t", PROMPTS, "float32", m, 5, 64)
    assert fake_vllm[0].kwargs["speculative_config"] == {"method": "dflash", "model": "d", "num_speculative_tokens": 3}
    assert row["tokens"] == [[7] * 5] * 2 and row["seconds"] == [0.055, 0.056]
    assert row["tau"] == 1 + 6 / 4 and row["counters"]["drafts"] == 4  # the two measured requests, warm-up left out
    # each request's own counters (what engines/suites.py sums per category)
    assert [(p["accepted"], p["drafts"]) for p in row["per_prompt"]] == [(3, 2), (3, 2)]


def test_vllm_plain_also_measures_pass_costs_with_the_context_cached(tmp_path, fake_vllm, monkeypatch):
    vllm_engine = _in_process_worker(monkeypatch, fake_vllm)
    cfg = types.SimpleNamespace(vllm_python="python", max_new_tokens=5, num_speculative_tokens=1, max_model_len=64)
    r = vllm_engine.run_vllm(cfg, tmp_path, tmp_path, "vllm plain", "t", None, PROMPTS, "none",
                             costs={"Ms": [4, 1], "context_tokens": 16, "repeats": 2, "decode_tokens": 3})
    assert fake_vllm[0].kwargs["enable_prefix_caching"] and "speculative_config" not in fake_vllm[0].kwargs
    assert len(r["tokens"]) == 2 and r["tau"] == 1.0
    # a decode step: 10 ms; request(M) = 16 + M + 10 ms; pass[M] = c1 + request(M) - request(1)
    assert r["pass_costs"] == {"c1_ms": 10.0, "pass_ms": {1: 10.0, 4: 13.0}, "request_ms": {1: 27.0, 4: 30.0},
                               "context_tokens": 16}


def test_vllm_ngram_is_prompt_lookup_without_a_draft_model():
    from selfspec.engines.vllm_engine import speculative_config

    assert speculative_config("ngram", None, 3) == {"method": "ngram", "num_speculative_tokens": 3,
                                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert speculative_config("none", None, 1) is None


def test_vllm_serves_a_head_by_its_registry_entry():
    """A head's speculative_config: the method of its type's name, or what its registry entry says (P-EAGLE: EAGLE-3
    drafting its whole depth in one pass, vllm/config/speculative.py parallel_drafting)."""
    from selfspec.engines.vllm_engine import speculative_config

    assert speculative_config("dflash", "d", 7) == {"method": "dflash", "model": "d", "num_speculative_tokens": 7}
    assert speculative_config("peagle", "d", 5) == {"method": "eagle3", "model": "d", "num_speculative_tokens": 5,
                                                   "parallel_drafting": True}


def test_vllm_suffix_row_drafts_with_selfspecs_suffix_knobs(tmp_path, fake_vllm, monkeypatch):
    """vLLM's suffix method (Arctic Inference's SuffixDecoding) with selfspec's suffix knobs, no global tree of earlier
    responses; tau from vLLM's counters as for every drafting row."""
    vllm_engine = _in_process_worker(monkeypatch, fake_vllm)
    knobs = vllm_engine.suffix_knobs(depth=20, min_prob=0.2, alpha=3.0)
    row = vllm_engine.vllm_rows("python", tmp_path, tmp_path, "t", PROMPTS, "float32", Method("suffix", "suffix", 6),
                                5, 64, suffix=knobs)
    assert fake_vllm[0].kwargs["speculative_config"] == {
        "method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 20,
        "suffix_decoding_min_token_prob": 0.2, "suffix_decoding_max_spec_factor": 3.0,
        "suffix_decoding_max_cached_requests": 0}
    assert row["tau"] == 1 + 6 / 4 and row["counters"]["drafts"] == 4


def _bench_vllm(monkeypatch, tmp_path, fail: set, heads=(), **overrides):
    """engines/bench.py's bench_vllm over `heads` (none: no head), its rows from a stand-in vllm_rows that records
    each method's kind and suffix knobs and refuses the kinds in `fail` as the worker does (a UserError)."""
    from selfspec.engines import bench, vllm_engine

    seen = []

    def rows(python, cache, work, folder, prompts, dtype, m, *args):
        seen.append((m.name, m.kind, m.num_draft, args[-1]))
        if m.kind in fail:
            raise UserError("vLLM (start) failed: ImportError: Arctic Inference is required for suffix decoding.")
        return {"tokens": [[1]], "seconds": [1.0], "tau": 1.0}

    monkeypatch.setattr(vllm_engine, "vllm_rows", rows)
    cfg = bench.ServeBenchConfig(**{"vllm_dtypes": ["float32"], **overrides})
    extra = {}
    results = bench.bench_vllm(cfg, None, tmp_path, list(heads), PROMPTS, tmp_path, {}, {}, extra)
    return results, seen, extra


def test_bench_vllm_adds_a_suffix_row_with_the_lookups_knobs(tmp_path, monkeypatch):
    from selfspec.decode.drafters import LookupConfig

    lookup = LookupConfig(num_draft=7, depth=16, min_prob=0.3, alpha=2.0)
    results, seen, extra = _bench_vllm(monkeypatch, tmp_path, set(), lookup=lookup)
    assert list(results["vLLM float32"]) == ["plain", "ngram", "suffix"] and "failed" not in extra
    assert seen[-1] == ("suffix", "suffix", 7, {
        "suffix_decoding_max_tree_depth": 16, "suffix_decoding_min_token_prob": 0.3,
        "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_max_cached_requests": 0})
    results, seen, _ = _bench_vllm(monkeypatch, tmp_path, set(), hybrid=False)
    assert list(results["vLLM float32"]) == ["plain", "ngram"]


def test_bench_vllm_without_arctic_inference_keeps_the_other_rows_and_says_why(tmp_path, monkeypatch):
    results, _, extra = _bench_vllm(monkeypatch, tmp_path, {"suffix"})
    assert list(results["vLLM float32"]) == ["plain", "ngram"]
    assert "Arctic Inference is required" in extra["failed"]["vLLM float32 suffix"]


def test_a_head_vllm_cannot_run_gets_its_registry_entrys_reason_on_each_dtype(tmp_path, monkeypatch):
    """DSpark: vLLM 0.32's CPU build refuses it (registry.py `refusals`); its rows say so and the others run."""
    results, seen, extra = _bench_vllm(monkeypatch, tmp_path, set(), heads=[{"name": "dspark head", "kind": "dspark"}],
                                       vllm_dtypes=["float32", "bfloat16"])
    assert all(list(r) == ["plain", "ngram", "suffix"] for r in results.values()) and len(results) == 2
    assert all("dspark" not in kind for _, kind, _, _ in seen)
    for dtype in ("float32", "bfloat16"):
        assert "Model Runner V1 refuses the method" in extra["failed"][f"vLLM {dtype} dspark head"]


def test_vllm_has_no_hybrid_row_and_the_report_names_the_lines_that_say_so():
    from selfspec.engines.bench import vllm_refusals

    why = vllm_refusals([{"name": "eagle3 head"}, {"name": "dflash head"}])
    assert list(why) == ["eagle3 head + lookup", "dflash head + lookup"]
    assert "one speculative method per engine" in why["eagle3 head + lookup"]
    assert "vllm/v1/worker/gpu_model_runner.py:591-663" in why["dflash head + lookup"]


# ---------------------------------------------------------------------------------------------- cost model


def test_needed_tau_is_speedup_times_cycle_over_c1():
    assert costs.needed_tau(10.0, 5.0, 17.5, 1.0) == pytest.approx(2.25)
    assert costs.needed_tau(10.0, 5.0, 17.5, 2.0) == pytest.approx(4.5)
    assert costs.at({1: 10.0, 3: 14.0, 6: 20.0}, 2) == pytest.approx(12.0)
    assert costs.at({1: 10.0, 3: 14.0}, 9) == 14.0


def test_cost_rows_use_a_measured_draft_else_derive_it_from_the_run():
    engines = {"e": {"plain": {"steps": 100, "step_s": 1.0, "new_tokens": 100, "speedup": 1.0},
                     "dflash head": {"steps": 50, "step_s": 1.0, "new_tokens": 150, "verified_tokens": 200,
                                     "speedup": 1.5, "tau": 3.0, "num_draft": 3, "p_min": 0.0, "prompts": 2}}}
    pass_ms = {1: 10.0, 4: 15.0}
    derived = costs.cost_rows(engines, {"e": {"c1_ms": 10.0, "pass_ms": pass_ms}})[0]
    # a 20 ms cycle at M = 4 (15 ms): 5 ms drafting; tau over steps 3 -> 3 * 10 / 20 = 1.5x, as measured
    assert derived["draft_source"] == "derived" and derived["draft_ms"] == pytest.approx(5.0)
    assert derived["tau_for_1x"] == pytest.approx(2.0) and derived["tau_for_2x"] == pytest.approx(4.0)
    assert derived["model_speedup"] == pytest.approx(1.5)
    engines["e"]["dflash head"]["draft_s"] = 0.048  # timed by the engine: 1 ms per verification pass (48 of them)
    measured = costs.cost_rows(engines, {"e": {"c1_ms": 10.0, "pass_ms": pass_ms}})[0]
    assert measured["draft_source"] == "measured" and measured["tau_for_1.5x"] == pytest.approx(1.5 * 16 / 10)
    assert "| e | dflash head | n=3 p=0 | 4.00 | 1.50 | 0.10 | 1.60 |" in costs.cost_table([measured])
    table = costs.pass_table({"e": {"c1_ms": 10.0, "pass_ms": pass_ms,
                                    "draft_ms": {"dflash head": {"ms": 2.0, "tokens": 3}}}})
    assert table.splitlines()[-1] == "| e | 10.0 | 1.00 | 1.50 | dflash head (3 tokens) 0.20 |"


# ---------------------------------------------------------------------------------------------- the script


def test_serve_bench_prints_eagle3_and_dflash_rows_grid_and_costs_in_one_run(tmp_path, heads):
    """selfspec engine, two heads chosen by their recorded types, the DFlash knobs and the EAGLE-3 chain's length
    screened, pass costs measured:
    one report holding every row, each identical to plain."""
    from selfspec.scripts.serve_bench import main

    out = tmp_path / "r.json"
    result = main([f"head={heads['eagle3']}", f"heads=[{heads['dflash']}]", "target=tiny-llama", "data=tiny",
                   "heldout_prompts=2", "code_prompts=[]", "max_new_tokens=10", "num_draft=2", "engines=[selfspec]",
                   "num_draft_grid.dflash=[1,3,9]", "dflash_p_min=[0.0,0.5]", "num_draft_grid.eagle3=[4,1,4]",
                   "screen_prompts=1", "pass_costs=true",
                   "cost_context_tokens=16", "cost_repeats=1", f"work_dir={tmp_path / 'w'}", f"output_file={out}"])
    rows = result["engines"]["selfspec fp32"]
    assert list(rows) == ["plain", "eagle3 head", "dflash head", "ngram", "suffix", "eagle3 head + lookup",
                          "dflash head + lookup"] and result["fp32_mismatches"] == []
    # each head beside the suffix lookup: a chain head drafts lookup.head_num_draft (a hybrid's head drafts where the
    # lookup found nothing, so longer than alone), a block head keeps its screened block; each at its confidence floor
    from selfspec.decode.drafters import LookupConfig

    assert rows["eagle3 head + lookup"]["num_draft"] == LookupConfig().head_num_draft
    assert rows["dflash head + lookup"]["num_draft"] == rows["dflash head"]["num_draft"]
    assert rows["eagle3 head + lookup"]["p_min"] == LookupConfig().head_min_confidence
    # a chain head's leaves beside its first tokens are the row's (a block head has none)
    assert rows["eagle3 head + lookup"]["head_siblings"] == [LookupConfig().head_siblings,
                                                             LookupConfig().head_sibling_depth]
    assert "head_siblings" not in rows["dflash head + lookup"]
    assert result["lookup_cost"]["context_tokens"] > 0 and result["lookup_cost"]["ratio"] > 0
    assert all(r["identical_prompts"] == 2 for r in rows.values())
    grid_rows = result["grids"]["selfspec fp32"]["dflash head"]
    assert [(g["num_draft"], g["p_min"]) for g in grid_rows] == [(1, 0.0), (1, 0.5), (3, 0.0), (3, 0.5)]  # 9 > B-1
    kept = next(g for g in grid_rows if g.get("best"))
    assert (rows["dflash head"]["num_draft"], rows["dflash head"]["p_min"]) == (kept["num_draft"], kept["p_min"])
    chains = result["grids"]["selfspec fp32"]["eagle3 head"]
    assert [(g["num_draft"], g["p_min"]) for g in chains] == [(1, 0.0), (4, 0.0)]  # each length once, in order
    assert rows["eagle3 head"]["num_draft"] == next(g for g in chains if g.get("best"))["num_draft"]
    assert list(result["pass_costs"]["selfspec fp32"]["pass_ms"]) == [1, 2, 3, 4, 5]  # M up to the longest chain + 1
    assert {r["method"] for r in result["cost_rows"]} == {"eagle3 head", "dflash head", "ngram", "suffix",
                                                          "eagle3 head + lookup", "dflash head + lookup"}
    assert json.loads(out.read_text())["heads"] == {"eagle3 head": heads["eagle3"], "dflash head": heads["dflash"]}


def test_serve_bench_compares_a_dspark_head_with_a_dflash_head(tmp_path, target, heads):
    """DSpark joins the table through its registry entry alone: its block of S drafts per pass (DFlash's S-1) is the
    longest draft screened, its rows (alone, beside the lookup) identical to plain; llama.cpp would serve it
    (draft-dspark), vLLM is said not run."""
    from selfspec.methods.dspark.head import build_dspark
    from selfspec.scripts.serve_bench import main
    from selfspec.engines.bench import served_heads

    torch.manual_seed(0)
    h = build_dspark(target.model, block_size=4, num_layers=1, markov_rank=8)
    save_head(h, tmp_path / "dspark", head_record(h, target.identity, training={}, metrics={}))
    result = main([f"head={heads['dflash']}", f"heads=[{tmp_path / 'dspark'}]", "target=tiny-llama", "data=tiny",
                   "heldout_prompts=2", "code_prompts=[]", "max_new_tokens=10", "engines=[selfspec]",
                   "num_draft_grid.dflash=[3,9]", "num_draft_grid.dspark=[3,4,9]", "screen_prompts=1",
                   f"work_dir={tmp_path / 'w'}", f"output_file={tmp_path / 'r.json'}"])
    rows = result["engines"]["selfspec fp32"]
    assert {"dflash head", "dspark head", "dspark head + lookup"} <= set(rows) and result["fp32_mismatches"] == []
    assert {g["num_draft"] for g in result["grids"]["selfspec fp32"]["dspark head"]} == {3, 4}  # 9 > S = 4
    assert {g["num_draft"] for g in result["grids"]["selfspec fp32"]["dflash head"]} == {3}  # 9 > S-1 = 3
    assert all(r["identical_prompts"] == 2 for r in rows.values())
    assert "dspark" in served_heads("llamacpp") and "dspark" not in served_heads("vllm")


def test_a_head_llamacpp_cannot_load_loses_its_rows_only(tmp_path, target):
    """A DFlash head over a reduced draft vocabulary has no GGUF (the export refuses it): it is said in `refused` and
    the other heads keep theirs; the engine's rows are not all lost (they were, on 2026-11-29)."""
    from selfspec.engines.bench import head_ggufs

    torch.manual_seed(0)
    reduced = build_dflash(target.model, block_size=4, num_layers=1, draft_vocab=torch.arange(32))
    h = {"name": "dflash head", "kind": "dflash", "record": head_record(reduced, target.identity),
         "state": reduced.state_dict()}
    refused = {}
    assert head_ggufs(None, target, None, [h], tmp_path / "t.gguf", "f32", tmp_path, {}, refused) == {}
    assert "reduced vocabulary" in refused["dflash head"]


def test_serve_bench_refuses_a_head_no_engine_serves(tmp_path, target, capsys):
    """A LayerSkip exit: no serving engine loads one (EAGLE-1 heads are served: vLLM's `eagle` method)."""
    from selfspec.methods.layerskip.head import build_layerskip
    from selfspec.scripts.serve_bench import main

    h = build_layerskip(target.model, exit_layer=1, adapter="light", rank=4)
    save_head(h, tmp_path / "ls", head_record(h, target.identity, training={}, metrics={}))
    with pytest.raises(SystemExit) as e:
        main([f"head={tmp_path / 'ls'}", "target=tiny-llama", "data=tiny", "engines=[selfspec]",
              f"work_dir={tmp_path / 'w'}", f"output_file={tmp_path / 'r.json'}"])
    assert e.value.code == 2 and "of type 'layerskip'" in capsys.readouterr().err


@pytest.mark.parametrize("option, written", [([], ["q8_0"]), (["llamacpp_head_type=null"], ["f32", "q8_0"]),
                                             (["llamacpp_head_type=bf16"], ["bf16"])])
def test_llamacpp_heads_are_written_at_the_head_type_or_the_targets(tmp_path, monkeypatch, option, written):
    """llamacpp_head_type: the heads' GGUFs are written at q8_0 by default whatever the target's type (a draft's
    precision changes what it proposes, never the output), at each row's target type when null; once a type, however
    many target types are served with it."""
    types = []

    def head_ggufs(cfg, target, folder, heads, target_gguf, t, *rest):
        types.append(t)
        return {"eagle3 head": tmp_path / f"e3-{t}.gguf"}

    _, _, started = _bench_llamacpp(tmp_path, monkeypatch, lambda args: 1.0,
                                    ["llamacpp_own_rows=false", "llamacpp_types=[f32,q8_0]", *option], head_ggufs)
    assert types == written
    servers = dict(started)
    for t, head_type in (("f32", written[0]), ("q8_0", written[-1])):
        head = servers[f"server-{t}-eagle3_head.log"]
        assert head[head.index("-md") + 1] == str(tmp_path / f"e3-{head_type}.gguf")
