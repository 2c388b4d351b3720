"""Every writer owns only what it wrote (core/ownership.py, issue 32): no entry point replaces a file or folder it
cannot prove it wrote, an output that is also an input is refused, overwrite=true never deletes the user's other
files, writers of one output are one at a time; and the values that used to surface as internal errors are the
user's one-line errors naming the key. Entry points run in-process on tiny targets: each test takes seconds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from selfspec.heads.checkpoint import head_record, save_head
from selfspec.methods.eagle.head import build_eagle
from entry_points import digest, refused, run

TRAIN = ["target=tiny-llama", "data=tiny", "data.max_conversations=4", "train.max_steps=1", "train.eval_every=0",
         "train.eval_prompts=0", "train.save_every=0"]


def users_folder(path: Path, **files: str) -> dict[str, str]:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("__", "/")).parent.mkdir(parents=True, exist_ok=True)
        (path / name.replace("__", "/")).write_text(text)
    return digest(path)


def users_notes_survive(main, args, tmp_path: Path, capsys) -> None:
    """output_file= the user's notes.json is refused in one line naming overwrite=true, and the notes stay."""
    notes = tmp_path / "notes.json"
    notes.write_text("the user's notes\n")
    assert run(main, *args, f"output_file={notes}") == 2
    refused(capsys, "notes.json", "overwrite=true")
    assert notes.read_text() == "the user's notes\n"


# ---------------------------------------------------------------------------------------------- 1. export


def test_export_never_replaces_a_folder_it_did_not_write(tmp_path, head_dir, capsys):
    from selfspec.scripts.export import main

    m = tmp_path / "m"
    before = users_folder(m, **{"config.json": '{"model_type": "llama"}', "pytorch_model.bin": "w", "NOTES.txt": "n"})
    for extra in ([], ["overwrite=true"]):
        assert run(main, f"head={head_dir}", "format=sglang", f"out={m}", *extra) == 2
        refused(capsys, "holds other files", "NOTES.txt")
        assert digest(m) == before


def test_export_into_its_input_head_is_refused(head_dir, capsys):
    from selfspec.scripts.export import main

    before = digest(head_dir)
    assert run(main, f"head={head_dir}", "format=sglang", f"out={head_dir}") == 2
    refused(capsys, "is the input head")
    assert digest(head_dir) == before


def test_export_replaces_its_own_export_but_never_the_users_files_beside_it(tmp_path, head_dir, capsys):
    from selfspec.scripts.export import main

    out = tmp_path / "exp"
    assert run(main, f"head={head_dir}", "format=sglang", f"out={out}") == 0
    assert run(main, f"head={head_dir}", "format=sglang", f"out={out}") == 0  # its own: replaced
    (out / "NOTES.md").write_text("mine")
    before = digest(out)
    assert run(main, f"head={head_dir}", "format=sglang", f"out={out}", "overwrite=true") == 2
    refused(capsys, "NOTES.md")
    assert digest(out) == before


# ---------------------------------------------------------------------------------------------- 2. gguf


def test_gguf_export_never_overwrites_the_target_gguf_or_a_users_file(tmp_path, target, capsys):
    from selfspec.methods.eagle3.head import build_eagle3
    from selfspec.scripts.export import main

    torch.manual_seed(0)
    head = build_eagle3(target.model, aux_layers=[0, 1, 1])
    save_head(head, tmp_path / "h3", head_record(head, target.identity))
    tok = tmp_path / "target.gguf"
    _tokenizer_gguf(tok, target.identity["vocab_size"])
    tok_bytes = tok.read_bytes()
    assert run(main, f"head={tmp_path / 'h3'}", "format=gguf", f"out={tok}", f"target_gguf={tok}",
               "overwrite=true") == 2
    refused(capsys, "is the input target_gguf")
    assert tok.read_bytes() == tok_bytes
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes")
    assert run(main, f"head={tmp_path / 'h3'}", "format=gguf", f"out={notes}", f"target_gguf={tok}") == 2
    refused(capsys, "overwrite=true")
    assert notes.read_text() == "the user's notes"
    out = tmp_path / "d.gguf"
    for _ in range(2):  # its own file is replaced without being asked
        assert run(main, f"head={tmp_path / 'h3'}", "format=gguf", f"out={out}", f"target_gguf={tok}") == 0


def _tokenizer_gguf(path, n_vocab):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    w.add_token_types([1] * n_vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------- 3. training


def test_training_never_writes_into_a_folder_holding_no_run(tmp_path, capsys):
    from selfspec.methods.eagle.train import main

    out = tmp_path / "mine"
    before = users_folder(out, **{"config.yaml": "my: settings\n"})
    assert run(main, *TRAIN, f"output_dir={out}") == 2
    refused(capsys, "holds other files", "config.yaml")
    assert digest(out) == before


def test_training_refuses_an_empty_output_dir(tmp_path, capsys, monkeypatch):
    from selfspec.methods.eagle.train import main

    monkeypatch.chdir(tmp_path)
    assert run(main, *TRAIN, "output_dir=") == 2
    refused(capsys, "output_dir is empty")
    assert list(tmp_path.iterdir()) == []


def test_a_refused_training_run_leaves_no_new_output_dir(tmp_path, capsys):
    from selfspec.methods.eagle.train import main

    out = tmp_path / "new_run"
    assert run(main, *TRAIN, "data=jsonl", "data.max_length=256", f"data.path={tmp_path / 'missing.jsonl'}",
               f"output_dir={out}") == 2
    refused(capsys, "does not exist")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- 4. cache-features


def test_cache_features_never_writes_into_a_run_folder(tmp_path, capsys):
    from selfspec.scripts.cache_features import main

    run_dir = tmp_path / "run"
    before = users_folder(run_dir, **{"config.yaml": "a run's config\n", "run.json": '{"identity": {}}'})
    assert run(main, "target=tiny-llama", "data=tiny", "data.max_conversations=2", f"data.features_dir={run_dir}") == 2
    refused(capsys, "holds other files")
    assert digest(run_dir) == before


# ---------------------------------------------------------------------------------------------- 5, 13. import-head


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, head_dir):
    from selfspec.scripts.export import main

    out = tmp_path_factory.mktemp("exports") / "exp"
    assert run(main, f"head={head_dir}", "format=eagle", f"out={out}") == 0
    return out


def test_import_head_overwrite_never_deletes_the_users_files(tmp_path, export_dir, target, capsys):
    from selfspec.scripts.import_head import main

    out = tmp_path / "imported"
    save_head(build_eagle(target.model), out, head_record(build_eagle(target.model), target.identity))
    before = users_folder(out, **{"NOTES.md": "mine", "plots__a.png": "png"})
    assert run(main, f"src={export_dir}", "target=tiny-llama", f"out={out}", "overwrite=true") == 2
    refused(capsys, "NOTES.md")
    assert digest(out) == before


def test_import_head_refuses_layout_and_aux_layers_for_a_selfspec_export(tmp_path, export_dir, capsys):
    from selfspec.scripts.import_head import main

    for extra in ("layout=eagle", "aux_layers=[1]"):
        assert run(main, f"src={export_dir}", "target=tiny-llama", f"out={tmp_path / 'o'}", extra) == 2
        refused(capsys, "drop layout= and aux_layers=")
        assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------- 6. regenerate


def test_regenerate_resumes_only_the_run_that_made_the_file(tmp_path, capsys):
    from selfspec.scripts.regenerate import main

    out = tmp_path / "regen.jsonl"
    base = ["target=tiny-llama", "data=tiny", "data.max_conversations=1", "max_new_tokens=2", "max_turns=1",
            f"out={out}"]
    assert run(main, *base) == 0
    before = digest(tmp_path)
    assert run(main, *base, "temperature=0.7", "data.max_conversations=2") == 2
    refused(capsys, "temperature=0.0", "temperature=0.7")
    assert digest(tmp_path) == before
    assert run(main, *base, "data.max_conversations=2", "batch_size=2") == 0  # the same run continues


# ---------------------------------------------------------------------------------------------- other outputs


def test_generate_output_file_is_never_an_input_or_a_users_file(tmp_path, head_dir, capsys):
    from selfspec.decode.generate import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    common = ["target=tiny-llama", "drafter=none", "max_new_tokens=1"]
    assert run(main, *common, f"prompts_file={prompts}", f"output_file={prompts}", "overwrite=true") == 2
    refused(capsys, "is the input prompts_file")
    weights = head_dir / "model.safetensors"
    before = digest(head_dir)
    assert run(main, *common, "drafter=eagle", f"head={head_dir}", "prompt=hi", f"output_file={weights}",
               "overwrite=true") == 2
    refused(capsys, "inside the input head")
    assert digest(head_dir) == before
    (tmp_path / "o.config.yaml").write_text("the user's yaml\n")
    assert run(main, *common, "prompt=hi", f"output_file={tmp_path / 'o.jsonl'}") == 2
    refused(capsys, "o.config.yaml", "overwrite=true")
    assert (tmp_path / "o.config.yaml").read_text() == "the user's yaml\n" and not (tmp_path / "o.jsonl").exists()
    assert run(main, *common, "prompt=hi", f"output_file={tmp_path / 'o.jsonl'}", "overwrite=true") == 0
    assert run(main, *common, "prompt=hi", f"output_file={tmp_path / 'o.jsonl'}") == 0  # now both are its own


def test_bench_never_replaces_a_users_png(tmp_path, capsys):
    from selfspec.scripts.bench import main

    png = tmp_path / "acceptance_by_position.png"
    png.write_bytes(b"\x89PNG the user's figure")
    args = ["target=tiny-llama", "max_new_tokens=2", "max_prompts=1", "warmup=0", "sweep_k=[]", "methods=[target]",
            f"output_file={tmp_path / 'bench.json'}"]
    assert run(main, *args) == 2
    refused(capsys, "acceptance_by_position.png", "overwrite=true")
    assert png.read_bytes() == b"\x89PNG the user's figure" and not (tmp_path / "bench.json").exists()
    assert run(main, *args, "overwrite=true") == 0
    assert run(main, *args) == 0  # its own plot now


def test_publish_out_is_never_the_head(tmp_path, head_dir, capsys):
    from selfspec.scripts.publish import main

    before = digest(head_dir)
    assert run(main, f"head={head_dir}", "repo_id=someone/x", "dry_run=true", f"out={head_dir}") == 2
    refused(capsys, "is the input head")
    assert digest(head_dir) == before


# ---------------------------------------------------------------------------------------------- 7. one writer


@pytest.mark.parametrize("which", ["export", "import-head", "publish"])
def test_a_second_writer_of_one_out_is_refused(tmp_path, head_dir, export_dir, which, capsys):
    from selfspec.core.atomic import lock_beside
    from selfspec.scripts import export, import_head, publish

    out = tmp_path / "out"
    main, args = {"export": (export.main, [f"head={head_dir}", "format=sglang"]),
                  "import-head": (import_head.main, [f"src={export_dir}", "target=tiny-llama"]),
                  "publish": (publish.main, [f"head={head_dir}", "repo_id=someone/x", "dry_run=true"])}[which]
    with lock_beside(out, "out"):  # another process writing it right now
        assert run(main, *args, f"out={out}") == 2
    refused(capsys, "in use by another selfspec run")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- 8, 9. values


@pytest.mark.parametrize("arg, words", [("temperature=nan", ("temperature", ">= 0")),
                                        ("seed=99999999999999999999", ("seed", "4294967295")),
                                        ("top_p=nan", ("top_p",))])
def test_generate_refuses_non_finite_and_overflowing_values(arg, words, capsys):
    from selfspec.decode.generate import main

    assert run(main, "target=tiny-llama", "drafter=none", "prompt=hi", "max_new_tokens=1", arg) == 2
    refused(capsys, *words)


@pytest.mark.parametrize("arg, words", [("train.lr=nan", ("train.lr", "> 0")),
                                        ("train.max_minutes=-1", ("train.max_minutes", "> 0")),
                                        ("train.seed=-1", ("train.seed",))])
def test_training_refuses_non_finite_and_negative_values(tmp_path, arg, words, capsys):
    from selfspec.methods.eagle.train import main

    assert run(main, *TRAIN, f"output_dir={tmp_path / 'run'}", arg) == 2
    refused(capsys, *words)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key, value, words", [("num_layers", "one", ("num_layers", "integer >= 1")),
                                               ("num_layers", 0, ("num_layers", "integer >= 1")),
                                               ("num_layers", 100000, ("num_layers=100000", "1 layer")),
                                               ("format_version", "1", ("format_version", "integer"))])
def test_a_head_config_with_bad_values_is_refused_before_building(tmp_path, head_dir, key, value, words, capsys):
    from selfspec.decode.generate import main

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((head_dir / "model.safetensors").read_bytes())
    record = json.loads((head_dir / "config.json").read_text())
    (record if key == "format_version" else record["head"])[key] = value
    (bad / "config.json").write_text(json.dumps(record))
    t0 = time.perf_counter()
    assert run(main, "target=tiny-llama", f"head={bad}", "prompt=hi", "max_new_tokens=1") == 2
    assert time.perf_counter() - t0 < 10  # the 100000-layer head is never built (50 s and 8 GB before)
    refused(capsys, *words)


def test_publish_refuses_a_bench_whose_method_is_not_a_mapping(tmp_path, head_dir, capsys):
    from selfspec.scripts.publish import main

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"methods": {"eagle": "fast"}}))
    assert run(main, f"head={head_dir}", "repo_id=someone/x", "dry_run=true", f"out={tmp_path / 's'}",
               f"bench={bench}") == 2
    refused(capsys, "methods.eagle")
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------------------------- 10-12, 14


def test_a_prompt_is_data_never_interpolated(tmp_path):
    from selfspec.decode.generate import main

    out = tmp_path / "o.jsonl"
    for prompt in ("${oc.env:HOME}", "echo ${HOME}"):
        assert run(main, "target=tiny-llama", "drafter=none", f"prompt={prompt}", "max_new_tokens=1",
                   f"output_file={out}") == 0
        assert json.loads(out.read_text())["prompt"] == prompt


def test_jsonl_lines_end_at_newline_only(tmp_path):
    from selfspec.decode.generate import read_prompts_file

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a\u2028b"}\n{"prompt": "c\u0085d"}\n', encoding="utf-8")
    assert [p["prompt"] for p in read_prompts_file(str(path))] == ["a\u2028b", "c\u0085d"]


def test_finished_files_get_the_users_umask(tmp_path, target):
    old = os.umask(0o022)
    try:
        head = build_eagle(target.model)
        save_head(head, tmp_path / "h", head_record(head, target.identity))
    finally:
        os.umask(old)
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "h").iterdir()} == {"0o644"}


def test_a_run_folder_given_as_head_suggests_its_head(tmp_path, head_dir):
    import shutil

    from selfspec.core.errors import UserError
    from selfspec.heads.checkpoint import read_head

    shutil.copytree(head_dir, tmp_path / "run" / "head")
    with pytest.raises(UserError, match=f"head={tmp_path / 'run' / 'head'}"):
        read_head(str(tmp_path / "run"))


# ---------------------------------------------------------------------------------------------- report writers


def test_eval_heads_output_file_is_never_an_input_or_a_users_file(tmp_path, head_dir, capsys):
    from selfspec.scripts.eval_heads import main

    args = ["target=tiny-llama", "data=tiny", "data.max_conversations=40", "prompts=1", "new_tokens=2", "depth=2",
            f"+heads.a={head_dir}"]
    before = digest(head_dir)
    assert run(main, *args, f"output_file={head_dir / 'config.json'}", "overwrite=true") == 2
    refused(capsys, "inside the input heads.a")
    assert digest(head_dir) == before
    users_notes_survive(main, args, tmp_path, capsys)
    for _ in range(2):  # the second run replaces the report and config the first one wrote
        assert run(main, *args, f"output_file={tmp_path / 'e.json'}") == 0


def test_sweep_exit_never_replaces_a_users_file_or_png(tmp_path, capsys):
    from selfspec.scripts.sweep_exit import main

    args = ["target=tiny-llama", "data=tiny", "data.max_conversations=40", "eval_prompts=1", "eval_new_tokens=2",
            "repeats=1", "context_tokens=8", "ks=[1]", "chain_k=1", "exit_layers=[1]"]
    notes = tmp_path / "notes.json"
    notes.write_text("the user's notes\n")
    assert run(main, *args, f"output_file={notes}") == 2
    refused(capsys, "notes.json", "overwrite=true")
    (tmp_path / "s.png").write_bytes(b"\x89PNG the user's figure")
    assert run(main, *args, f"output_file={tmp_path / 's.json'}") == 2
    refused(capsys, "s.png", "overwrite=true")
    assert (tmp_path / "s.png").read_bytes() == b"\x89PNG the user's figure" and not (tmp_path / "s.json").exists()
    assert notes.read_text() == "the user's notes\n"
    for _ in range(2):  # the second run replaces the table, config and plot the first one wrote
        assert run(main, *args, f"output_file={tmp_path / 'own.json'}") == 0


def test_serve_bench_output_file_is_never_the_head_or_a_users_file(tmp_path, head_dir, capsys):
    from selfspec.scripts.serve_bench import main

    args = ["target=tiny-llama", f"head={head_dir}", "engines=[selfspec]", f"work_dir={tmp_path / 'work'}"]
    before = digest(head_dir)
    assert run(main, *args, f"output_file={head_dir / 'config.json'}", "overwrite=true") == 2
    refused(capsys, "inside the input head")
    assert digest(head_dir) == before
    users_notes_survive(main, args, tmp_path, capsys)
    assert run(main, *args, f"output_file={tmp_path / 'r.json'}", f"work_dir={head_dir}") == 2
    refused(capsys, "work_dir", "the input head")
    assert digest(head_dir) == before
    work = tmp_path / "mine"  # a work_dir holding the user's file beside serve_bench's own names
    work.mkdir()
    (work / "head-f32.gguf").write_bytes(b"an earlier run's draft")
    (work / "NOTES.md").write_text("the user's notes\n")
    assert run(main, *args, f"output_file={tmp_path / 'r.json'}", f"work_dir={work}") == 2
    refused(capsys, "work_dir", "NOTES.md")
    assert (work / "NOTES.md").read_text() == "the user's notes\n"


def test_profile_step_never_replaces_a_users_file(tmp_path, capsys):
    from selfspec.scripts.profile_step import main

    users_notes_survive(main, ["target=tiny-llama", "data=tiny", "steps=1"], tmp_path, capsys)


def test_peer_eagle_out_is_never_inside_an_input(tmp_path, capsys):
    from selfspec.publish.peer_eagle import MODEL, TRAINER
    from selfspec.scripts.peer_eagle import main

    repo, feats = tmp_path / "EAGLE", tmp_path / "feats"
    users_folder(repo, **{TRAINER.replace("/", "__"): "# main\n", MODEL.replace("/", "__"): "# model\n"})
    before = users_folder(feats, **{"index.json": "{}"})
    assert run(main, "target=tiny-llama", f"eagle_repo={repo}", f"features_dir={feats}", f"out={feats / 'run'}") == 2
    refused(capsys, "is inside the input features_dir")
    assert digest(feats) == before


def test_plot_curve_never_replaces_a_users_png_or_a_report(tmp_path, capsys):
    from selfspec.scripts.plot_curve import main

    report = tmp_path / "r.png"  # an eval_heads report, oddly named
    report.write_text(json.dumps({"heads": {"eagle_1": {"train_seconds": 60, "tau": 1.5, "sem": 0.1}}}))
    before = report.read_text()
    assert run(main, f"+reports=[{report}]", f"out={report}", "overwrite=true") == 2
    refused(capsys, "is the input reports")
    assert report.read_text() == before
    png = tmp_path / "tau.png"
    png.write_bytes(b"\x89PNG the user's figure")
    assert run(main, f"+reports=[{report}]", f"out={png}") == 2
    refused(capsys, "tau.png", "overwrite=true")
    assert png.read_bytes() == b"\x89PNG the user's figure"
    assert run(main, f"+reports=[{report}]", f"out={png}", "overwrite=true") == 0
    assert run(main, f"+reports=[{report}]", f"out={png}") == 0  # its own plot now


def test_bad_inputs_output_file_never_replaces_a_users_file(tmp_path, capsys):
    from harness.bad_inputs import main

    notes = tmp_path / "notes.md"
    notes.write_text("the user's notes\n")
    t0 = time.time()
    assert run(main, "only=[o_gen_is_prompts]", f"output_file={notes}") == 2
    refused(capsys, "notes.md", "overwrite=true")
    assert notes.read_text() == "the user's notes\n" and time.time() - t0 < 30  # before any case ran


@pytest.mark.parametrize("where", ["data.path", "features_dir", "init_from"])
def test_training_output_dir_is_never_an_input(tmp_path, head_dir, where, capsys):
    from selfspec.methods.eagle import train as eagle
    from selfspec.methods.eagle3 import train as eagle3

    data = tmp_path / "data"
    before = users_folder(data, **{"d.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n'})
    if where == "data.path":
        main, args = eagle.main, [*TRAIN, "data=jsonl", "data.max_length=256", f"data.path={data / 'd.jsonl'}",
                                  f"output_dir={data}"]
        words = "holds the input data.path"
    elif where == "features_dir":
        main, args = eagle.main, [*TRAIN, f"data.features_dir={data}", f"output_dir={data / 'run'}"]
        words = "is inside the input data.features_dir"
    else:
        main, args = eagle3.main, [*TRAIN, "draft=eagle3", f"draft.init_from={head_dir}", f"output_dir={head_dir}"]
        words, data, before = "is the input draft.init_from", head_dir, digest(head_dir)
    assert run(main, *args) == 2
    refused(capsys, words)
    assert digest(data) == before and not (data / "run").exists()


def test_a_refusal_under_the_writer_lock_leaves_no_new_parent_folder(tmp_path):
    from selfspec.core.errors import UserError
    from selfspec.core.ownership import Kind, owned_dir, owned_path

    for owned in (owned_path, owned_dir):
        with pytest.raises(UserError):
            with owned(tmp_path / "new" / "sub" / "o.json", "output_file", Kind("report", folder=owned is owned_dir)):
                raise UserError("the command refused its work here")
        assert list(tmp_path.iterdir()) == []


def test_a_refused_training_run_leaves_no_new_parent_folders(tmp_path, capsys):
    from selfspec.methods.eagle.train import main

    assert run(main, *TRAIN, "data=jsonl", "data.max_length=256", f"data.path={tmp_path / 'missing.jsonl'}",
               f"output_dir={tmp_path / 'runs' / 'today' / 'run'}") == 2
    refused(capsys, "does not exist")
    assert list(tmp_path.iterdir()) == []
