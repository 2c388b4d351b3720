"""scripts/serve_bench.py's checks before it starts any engine (the engines themselves: `make check-llamacpp`,
`make check-vllm`, not part of the tests; their wrappers in engines/: tests/engines/test_serve.py), and the make checks'
invocations of it run back to back on fake engines, in every order (issue 52)."""

import itertools
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from selfspec.core.errors import UserError
from selfspec.scripts.serve_bench import check_config
from selfspec.engines.bench import ServeBenchConfig


def _cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(ServeBenchConfig), {"head": "h", "engines": ["selfspec"], **kw})


@pytest.mark.parametrize("kw, message", [
    ({"engines": ["vllm"], "vllm_python": "/nonexistent/python"}, "no vLLM venv at '/nonexistent/python'"),
    ({"vllm_dtypes": ["float16"]}, "vllm_dtypes ['float16']"),
    ({"engines": ["sglang"]}, "each must be one of selfspec, llamacpp, vllm"),
    ({"llamacpp_suffix_min_match": 0}, "llamacpp_suffix_min_match must be in 1..1024"),
    ({"llamacpp_suffix_min_prob": 1.5}, "llamacpp_suffix_min_prob must be in [0, 1] or null"),
    ({"llamacpp_hybrid_ngrams": ["suffix", "ngram-trie"]},
     "llama.cpp n-gram kinds ['ngram-trie']: each must be one of ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, "
     "ngram-cache, suffix"),
    ({"work_dir": "w", "output_file": "w/reports/r.json"}, "output_file 'w/reports/r.json' is inside work_dir 'w'"),
])
def test_refuses_before_any_engine_starts(kw, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_config(_cfg(**kw))


def test_without_a_head_it_measures_the_rows_no_training_needs(tmp_path):
    """No head= (a target nobody has trained a head for yet): plain and the lookups, each identical to plain."""
    from selfspec.scripts.serve_bench import main

    result = main(["target=tiny-llama", "data=tiny", "heldout_prompts=2", "code_prompts=[]", "max_new_tokens=10",
                   "engines=[selfspec]", f"work_dir={tmp_path / 'w'}", f"output_file={tmp_path / 'r.json'}"])
    rows = result["engines"]["selfspec fp32"]
    assert set(rows) == {"plain", "ngram", "suffix"}
    assert result["fp32_mismatches"] == [] and all(r["identical_prompts"] == r["prompts"] == 2 for r in rows.values())


def test_accepts_the_vllm_engine_with_a_venv(tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    check_config(_cfg(engines=["selfspec", "vllm"], vllm_python=str(python)))


def test_the_report_names_the_cpu_it_ran_on():
    """Speeds move between hosts (the same VM image ran on an AMD EPYC and an Intel Xeon): the JSON says which."""
    import os
    from pathlib import Path

    from selfspec.core.threads import machine

    name = machine()
    assert name.endswith(f", {os.cpu_count()} CPUs")
    if Path("/proc/cpuinfo").exists():
        assert not name.startswith("unknown CPU") and name.split(",")[0] in Path("/proc/cpuinfo").read_text()


def test_divergence_reads_the_fp32_logits_at_the_first_difference():
    import torch

    from selfspec.target.model import load_target
    from selfspec.engines.report import divergence

    target = load_target("tiny:llama")
    prompt = [1, 5, 9]
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + [7, 8]])).logits[0, -1]
    top2 = logits.topk(2).indices.tolist()
    d = divergence(target, prompt, [7, 8, top2[0], 3], [7, 8, top2[1]])
    assert d["position"] == 2 and (d["fp32_rank_plain"], d["fp32_rank_token"]) == (0, 1)
    assert d["fp32_gap"] == pytest.approx(float(logits[top2[0]] - logits[top2[1]]), abs=1e-4) and d["fp32_gap"] >= 0
    assert "prefix" in divergence(target, prompt, [7, 8], [7, 8, 9])["note"]


def test_a_target_without_a_local_folder_is_refused_before_any_engine_runs(tmp_path, capsys):
    """vLLM serves (and llama.cpp converts) the target's HF folder: a target with none (tiny:llama) is refused
    before selfspec's rows are measured and before work_dir is made."""
    import torch

    from selfspec.target.model import load_target
    from selfspec.heads.checkpoint import head_record, save_head
    from selfspec.methods.eagle3.head import build_eagle3
    from selfspec.scripts.serve_bench import main

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_eagle3(target.model, aux_layers=[0, 1, 1], vocab_size=32, draft_vocab=torch.arange(40, 72))
    save_head(head, tmp_path / "h", head_record(head, target.identity, training={}, metrics={}))
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(SystemExit) as e:
        main([f"head={tmp_path / 'h'}", "target=tiny-llama", "data=tiny", "engines=[selfspec,vllm]",
              f"vllm_python={python}", f"work_dir={tmp_path / 'work'}", f"output_file={tmp_path / 'o.json'}"])
    assert e.value.code == 2 and "has no local HF folder" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


# ------------------------------------------------------------------------ the make checks, one after another

ROOT = Path(__file__).resolve().parents[2]


def make_variables(text: str) -> dict[str, str]:
    """The Makefile's `NAME := value` / `?=` / `=` variables, expanded where they use only other such variables;
    those calling a function ($(if ...), $(shell ...)) stay out."""
    raw = dict(re.findall(r"^([A-Z_]+)[ \t]*[:?]?=[ \t]*(.*)$", text, re.MULTILINE))
    done: dict[str, str] = {}
    for _ in range(len(raw)):
        for name, value in raw.items():
            value = re.sub(r"\$\(([A-Z_]+)\)", lambda m: done.get(m.group(1), m.group(0)), value)
            if "$(" not in value:
                done[name] = value
    return done


def serve_bench_args(target: str) -> list[str]:
    """The arguments `make <target>` passes scripts/serve_bench.py, as the Makefile spells them; what stays
    unexpanded (DFLASH_ARGS, SERVE_BENCH_ARGS: empty unless given) is left out."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.MULTILINE).group(1)
    line = next(ln for ln in recipe.splitlines() if "scripts/serve_bench.py" in ln)
    variables = make_variables(text)  # make expands its variables, then the shell splits (and unquotes) the line
    line = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m.group(1), m.group(0)), line)
    tokens = shlex.split(line.split("scripts/serve_bench.py", 1)[1])
    return [t for t in tokens if t and "$(" not in t]


def readme_checks() -> list[tuple[str, tuple[str, ...]]]:
    """The README's `make check-...` commands whose recipe runs serve_bench, in the README's order, each with its
    SERVE_BENCH_ARGS."""
    found = re.findall(r'^make (check-[\w-]+)(?: SERVE_BENCH_ARGS="([^"]*)")?', (ROOT / "README.md").read_text(),
                       re.MULTILINE)
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    runs = [(t, shlex.split(extra)) for t, extra in found
            if re.search(rf"^{re.escape(t)}:.*\n(?:\t.*\n)*\t.*scripts/serve_bench\.py", makefile, re.MULTILINE)]
    return list(dict.fromkeys((t, tuple(a)) for t, a in runs))


# check-vllm and check-llamacpp as the README runs them, check-llamacpp as the Makefile alone does, serve_bench itself
INVOCATIONS = {f"make {t}" + (" " + " ".join(extra) if extra else ""): serve_bench_args(t) + list(extra)
               for t, extra in readme_checks()}
INVOCATIONS["make check-llamacpp"] = serve_bench_args("check-llamacpp")
INVOCATIONS["serve_bench"] = []


def test_the_readme_checks_that_run_serve_bench_are_found():
    assert {"make check-vllm", "make check-llamacpp engines=[selfspec,llamacpp,vllm]"} <= set(INVOCATIONS)
    assert any(a.startswith("output_file=") for a in INVOCATIONS["make check-vllm"])


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory):
    import torch

    from selfspec.target.model import load_target
    from selfspec.heads.checkpoint import head_record, save_head
    from selfspec.methods.eagle3.head import build_eagle3

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_eagle3(target.model, aux_layers=[0, 1, 1], vocab_size=32, draft_vocab=torch.arange(40, 72))
    folder = tmp_path_factory.mktemp("head") / "e3"
    save_head(head, folder, head_record(head, target.identity, training={}, metrics={}))
    return folder


def _rows(prompts) -> dict:
    row = {"tokens": [[5, 6, 7]] * len(prompts), "seconds": [1.0] * len(prompts), "tau": None}
    return {"plain": row, "eagle3 head": {**row, "tau": 2.0}}


@pytest.fixture
def fake_engines(monkeypatch, tmp_path):
    """The engines, replaced by fakes that leave in work_dir what the real ones do (GGUFs, logs, exports, vLLM's
    cache) and return one row each; the paths the Makefile passes (engine binaries) exist."""
    from selfspec.scripts import serve_bench

    def llamacpp(cfg, target, folder, heads, prompts, work, grids, costs, extra):
        for name in ("target-f32.gguf", "head-eagle3_head-f32.gguf", "head-eagle3_head-f32.converter.gguf",
                     "server-f32-plain.log"):
            (work / name).write_text("x")
        return {"llama.cpp F32": _rows(prompts)}

    def vllm(cfg, target, folder, heads, prompts, work, grids, costs, extra):
        for folder_name in ("vllm-cache", "head-speculators-eagle3_head"):
            (work / folder_name).mkdir(exist_ok=True)
            (work / folder_name / "config.json").write_text("{}")
        (work / "vllm-float32-plain-n5.log").write_text("x")
        return {"vLLM float32": _rows(prompts)}

    monkeypatch.setattr(serve_bench, "bench_selfspec", lambda cfg, target, heads, prompts, *a: _rows(prompts))
    monkeypatch.setattr(serve_bench, "bench_llamacpp", llamacpp)
    monkeypatch.setattr(serve_bench, "bench_vllm", vllm)
    monkeypatch.setattr(serve_bench, "target_folder", lambda cfg: tmp_path)
    clone = tmp_path / "clone"
    variables = make_variables((ROOT / "Makefile").read_text().replace("\\\n", " "))
    for binary in (f"{variables['VLLM_VENV']}/bin/python", variables["LLAMACPP_SERVER"],
                   f"{variables['LLAMACPP_SRC']}/convert_hf_to_gguf.py"):
        (clone / binary).parent.mkdir(parents=True, exist_ok=True)
        (clone / binary).write_text("")
    monkeypatch.chdir(clone)
    return clone


@pytest.mark.parametrize("first, second", list(itertools.product(INVOCATIONS, repeat=2)))
def test_each_check_runs_after_every_other_and_after_itself(first, second, eagle3_head, fake_engines, capsys):
    """Issue 52: check-vllm left its report in serve_bench's work folder, and the next check refused that folder.
    Reports and the work folder live apart: the second run starts (and writes its report), whatever ran before."""
    from selfspec.scripts.serve_bench import main

    ours = [f"head={eagle3_head}", "target=tiny-llama", "data=tiny", "heldout_prompts=2", "code_prompts=[]"]
    reports = []
    for name in (first, second):
        # our tiny head and prompts (a suite's real questions are longer than the tiny target's context)
        args = [a for a in INVOCATIONS[name] if a.split("=")[0] not in ("head", "heads", "suite", "suite_questions")]
        args += ours
        result = main(args)
        assert result["prompts"] == 2, name
        out = next((a.split("=", 1)[1] for a in args if a.startswith("output_file=")),
                   "outputs/reports/serve_bench.json")
        reports.append(fake_engines / out)
        assert f"wrote {out}" in capsys.readouterr().out
    assert all(r.is_file() and r.with_suffix(".config.yaml").is_file() for r in reports)


def test_no_check_leaves_its_report_in_a_work_folder():
    """The engine checks' reports and the work folders they fill (serve_bench's, check_engine_families')."""
    from selfspec.scripts.check_engine_families import CheckEngineFamiliesConfig
    from selfspec.engines.bench import ServeBenchConfig

    families = CheckEngineFamiliesConfig()
    works = [Path(ServeBenchConfig().work_dir), Path(families.work_dir)]
    reports = [Path(ServeBenchConfig().output_file), Path(families.output_file)]
    reports += [Path(a.split("=", 1)[1]) for args in INVOCATIONS.values() for a in args if a.startswith("output_file=")]
    assert not [(r, w) for r in reports for w in works if w in r.parents]


def test_an_eagle1_head_has_rows_in_selfspec_and_vllm_and_a_reason_in_llamacpp(tmp_path):
    """The shipped EAGLE-1 head in serve_bench: a chain in selfspec, vLLM's `eagle` method over the full vocabulary
    (vLLM's EAGLE-1 model has no draft->target map), and llama.cpp's "no" in the report (it has no EAGLE-1 draft)."""
    import torch

    from selfspec.target.model import load_target
    from selfspec.heads.checkpoint import head_record, save_head
    from selfspec.methods.eagle.head import build_eagle
    from selfspec.engines.bench import head_methods, llamacpp_refusals, read_heads, vllm_export

    target = load_target("tiny:llama")
    torch.manual_seed(0)
    head = build_eagle(target.model, vocab_size=32, draft_vocab=torch.arange(40, 72))
    save_head(head, tmp_path / "e1", head_record(head, target.identity, training={}, metrics={}))
    cfg = _cfg(head=str(tmp_path / "e1"), num_draft=4)
    heads = read_heads(cfg)
    assert [h["name"] for h in heads] == ["eagle head"]
    [[method]] = head_methods(cfg, heads)
    assert (method.kind, method.num_draft, method.head) == ("eagle", 4, str(tmp_path / "e1"))
    export = vllm_export(heads[0], target, 4)
    assert export.config["architectures"] == ["LlamaForCausalLM"]
    assert not any(k.endswith(("d2t", "t2d")) for k in export.tensors)  # the full vocabulary: no map
    assert "no eagle draft" in llamacpp_refusals(heads)["eagle head"]
