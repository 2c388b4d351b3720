#!/usr/bin/env bash
# A llama.cpp build that runs where it was built (`make llamacpp`, which check-llamacpp and check-engine-families
# run first). -DGGML_NATIVE=ON compiles for every instruction set the host reports, and on an Intel Xeon with AMX
# (Sapphire Rapids) that brings in ggml's AMX kernels, which segfault on every pass over more than one token
# (issue 47): llama-bench -p 1 runs, -p 4 dies, llama-server dies at the first prompt. So the CPU's flags decide
# before anything compiles (issue 63): a CPU that reports AMX (amx_tile, amx_int8 or amx_bf16) gets the portable
# build at once, GGML_NATIVE=OFF with the host's own instruction sets spelled out and AMX off; any other CPU gets the
# native build. Every build is smoke-tested with a multi-token pass before it is kept, and a native build that fails it
# (a CPU whose flags did not tell) is rebuilt portable and tested the same way: one build on every host we know.
#
#   scripts/build_llamacpp.sh SRC TREE PYTHON [CMAKE_ARG...]   # SRC: llama.cpp's source; PYTHON: the project venv's
#   scripts/build_llamacpp.sh --portable-flags ["CPU FLAGS"]   # the fallback's cmake flags (default: this CPU's)
#   scripts/build_llamacpp.sh --decide ["CPU FLAGS"]           # the first build it would make, and why (one line)
#
# Builds TREE/build-native (-DGGML_NATIVE=ON) or TREE/build-portable (the fallback), llama-server and llama-bench in
# each; TREE/build is a link to the one kept, recorded in TREE/build.kept; one line says which and why.
# LLAMACPP_PORTABLE=1 skips the native build and keeps the fallback (forced: a host known to need it, or to try the
# fallback anywhere); LLAMACPP_PORTABLE=0 tries the native build first even on an AMX CPU; unset, the flags decide.
# CPUINFO: the file the flags are read from (default /proc/cpuinfo). JOBS: parallel compile jobs (default: every core).
# LLAMACPP_PATCH: patches (-p1, separated by spaces) applied to SRC in turn before anything compiles (the Makefile's
# nine scripts/llamacpp-*.patch, each with its why in its head), each once: a source a patch is already applied to
# is left as it is; one a patch does not apply to stops here in one line (exit 2), before any patch is applied; the
# smoke pass keeps no build of a source without them all.
#
#   scripts/build_llamacpp.sh --apply-patch SRC PATCH          # that step alone
set -euo pipefail

# GGML_* cmake options -> the /proc/cpuinfo flags each needs. ggml/src/ggml-cpu/CMakeLists.txt compiles GGML_AVX512
# with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw; its extensions come only with all five. Without NATIVE
# the basic sets default to ON, so each is spelled out too.
AVX512_SET=avx512f,avx512cd,avx512vl,avx512dq,avx512bw
PORTABLE_OPTIONS=(
    "SSE42:sse4_2" "AVX:avx" "AVX2:avx2" "BMI2:bmi2" "FMA:fma" "F16C:f16c" "AVX_VNNI:avx_vnni" "AVX512:$AVX512_SET"
    "AVX512_VBMI:$AVX512_SET,avx512vbmi" "AVX512_VNNI:$AVX512_SET,avx512_vnni" "AVX512_BF16:$AVX512_SET,avx512_bf16"
)

portable_flags() {  # $1: a CPU's flags (the `flags` line of /proc/cpuinfo) -> the fallback's cmake -D options
    local have=" $1 " option needs need on
    echo -n "-DGGML_NATIVE=OFF"
    for option in "${PORTABLE_OPTIONS[@]}"; do
        needs=${option#*:} on=ON
        for need in ${needs//,/ }; do
            [[ $have == *" $need "* ]] || on=OFF
        done
        echo -n " -DGGML_${option%%:*}=$on"
    done
    echo " -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"  # the kernels that crash: never
}

cpuinfo=${CPUINFO:-/proc/cpuinfo}
cpu_flags() { grep -m1 '^flags' "$cpuinfo" | cut -d: -f2; }

# $1: a CPU's flags; $2: LLAMACPP_PORTABLE -> "native" or "portable", a space, and why (the first build to make)
decide() {
    local have=" $1 " amx="" flag
    for flag in amx_tile amx_int8 amx_bf16; do
        [[ $have == *" $flag "* ]] && amx+=${amx:+,}$flag
    done
    case ${2:-} in
        0) echo "native LLAMACPP_PORTABLE=0" ;;
        ?*) echo "portable LLAMACPP_PORTABLE=$2" ;;
        *) if [[ -n $amx ]]; then
               echo "portable the CPU reports $amx, and ggml's AMX kernels crash on multi-token passes (issue 47)"
           else
               echo "native the CPU reports no AMX"
           fi ;;
    esac
}

# $1: SRC, $2: PATCH -> "applied" (reversing it would apply cleanly), "applies" or "fails"; changes nothing
patch_state() {
    local opts=(-p1 -F0 -f -s --dry-run --no-backup-if-mismatch -r - -d "$1" -i "$(realpath "$2")")
    if patch -R "${opts[@]}" >/dev/null 2>&1; then
        echo applied
    elif patch "${opts[@]}" >/dev/null 2>&1; then
        echo applies
    else
        echo fails
    fi
}

apply_patch() {  # $1: SRC, $2: PATCH; one line either way
    local state
    [[ -f $2 ]] || { echo "error: the patch '$2' does not exist (LLAMACPP_PATCH)" >&2; exit 2; }
    command -v patch >/dev/null || { echo "error: applying $2 needs the patch command (apt-get install patch)" >&2
                                     exit 2; }
    state=$(patch_state "$1" "$2")
    case $state in
        applied) echo "[llama.cpp] $2: already applied to $1" ;;
        applies) patch -p1 -F0 -f -s --no-backup-if-mismatch -r - -d "$1" -i "$(realpath "$2")" >/dev/null
                 echo "[llama.cpp] $2: applied to $1" ;;
        *) echo "error: $2 does not apply to $1 (another llama.cpp version than the one it was written for, or an" \
                "edited source); nothing changed: LLAMACPP_PATCH= builds it unpatched" >&2
           exit 2 ;;
    esac
}

if [[ ${1:-} == --apply-patch ]]; then
    [[ $# -eq 3 && -d ${2} ]] || { echo "usage: $0 --apply-patch SRC PATCH (SRC: a llama.cpp source folder)" >&2
                                   exit 2; }
    apply_patch "$2" "$3"
    exit 0
fi
if [[ ${1:-} == --portable-flags || ${1:-} == --decide ]] && [[ $# -lt 2 && ! -r $cpuinfo ]]; then
    echo "error: $cpuinfo cannot be read: give the CPU's flags (\"$0 $1 'fpu sse ...'\") or CPUINFO=a file" >&2
    exit 2
fi
if [[ ${1:-} == --portable-flags ]]; then
    portable_flags "${2-$(cpu_flags)}"
    exit 0
fi
if [[ ${1:-} == --decide ]]; then
    decide "${2-$(cpu_flags)}" "${LLAMACPP_PORTABLE:-}"
    exit 0
fi
if [[ $# -lt 3 ]]; then
    echo "usage: $0 SRC TREE PYTHON [CMAKE_ARG...] | $0 --portable-flags|--decide [\"CPU FLAGS\"]" \
         "| $0 --apply-patch SRC PATCH" >&2
    exit 2
fi
src=$1 tree=$2 python=$3
shift 3
common=("$@")
jobs=${JOBS:-$(nproc)}
read -ra patch_files <<<"${LLAMACPP_PATCH:-}"
for patch_file in "${patch_files[@]}"; do  # every one checked before any is applied: one that fails says why, exit 2
    [[ -f $patch_file && $(patch_state "$src" "$patch_file") != fails ]] || apply_patch "$src" "$patch_file"
done
for patch_file in "${patch_files[@]}"; do
    apply_patch "$src" "$patch_file"
done
# The smoke pass's model: the embedded target's GGUF (SmolLM2-135M Q4_1, installed by `make install`).
gguf=$("$python" -c 'from selfspec.target.model import EMBEDDED, _package_file
print(_package_file(EMBEDDED["smollm2-135m"][1]))')

build() {  # $1: folder name under TREE, then its cmake options; configures again only when those changed
    local dir=$tree/$1
    shift
    local want="${common[*]} $*"
    echo "[llama.cpp] building $dir ($*; log: $dir/build.log)"
    mkdir -p "$dir"
    if [[ ! -f $dir/CMakeCache.txt || $(cat "$dir/.cmake-args" 2>/dev/null) != "$want" ]]; then
        rm -f "$dir/.cmake-args"
        nice -n 10 cmake -S "$src" -B "$dir" "${common[@]}" "$@" >"$dir/build.log" 2>&1 \
            || { tail -20 "$dir/build.log"; return 1; }
        echo "$want" >"$dir/.cmake-args"
    fi
    # minutes of compiling: cmake's percentages, one line per tenth, the whole output in the log
    nice -n 10 cmake --build "$dir" -j "$jobs" --target llama-server llama-bench 2>&1 | tee -a "$dir/build.log" \
        | awk -F'[][%]' '/^\[ *[0-9]+%\]/ && $2 + 0 >= next_p { printf "[llama.cpp] %d%%\n", $2; fflush()
                                                              next_p = int($2 / 10) * 10 + 10 }' \
        || { tail -20 "$dir/build.log"; return 1; }
}

# $1: folder name; a pass over 4 prompt tokens, which the AMX kernels do not survive, from the source LLAMACPP_PATCH
# is applied to (cmake rebuilt what it changed). Prints its t/s.
smoke() {
    local dir=$tree/$1 rc=0 what="" patched="" patch_file
    for patch_file in "${patch_files[@]}"; do
        [[ $(patch_state "$src" "$patch_file") == applied ]] || { echo "$src is not patched with $patch_file"
                                                                   return 1; }
        patched+="${patched:+ and }$(basename "$patch_file")"
    done
    patched=${patched:+, patched with $patched}
    timeout 600 "$dir/bin/llama-bench" -m "$gguf" -p 4 -n 0 -t 2 -r 1 >"$dir/smoke.log" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]] || ! grep -q '| *pp4 *|' "$dir/smoke.log"; then
        [[ $rc -eq 139 ]] && what=", a segfault"
        echo "llama-bench -p 4 failed (exit $rc$what; $dir/smoke.log)"
        return 1
    fi
    echo "pp4 $(grep '| *pp4 *|' "$dir/smoke.log" | awk -F'|' '{gsub(/ /, "", $(NF-1)); print $(NF-1)}') t/s$patched"
}

keep() {  # $1: folder name, $2: why; TREE/build -> it, and the record beside it
    [[ -L $tree/build || ! -e $tree/build ]] || rm -rf "$tree/build"  # an unchecked build of an earlier Makefile
    ln -sfn "$1" "$tree/build"
    local cpu
    cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
    echo "$1 $2 on ${cpu:-this CPU}, $(date '+%Y-%m-%d %H:%M')" >"$tree/build.kept"
    echo "[llama.cpp] kept $tree/$1: $2"
}

read -r first why <<<"$(decide "$(cpu_flags)" "${LLAMACPP_PORTABLE:-}")"
echo "[llama.cpp] first build: $first ($why)"
if [[ $first == native ]]; then
    build build-native -DGGML_NATIVE=ON
    if result=$(smoke build-native); then
        keep build-native "(-DGGML_NATIVE=ON; $why), smoke pass llama-bench -p 4: $result"
        exit 0
    fi
    why="the native build's smoke pass: $result"
    echo "[llama.cpp] $why; rebuilding without GGML_NATIVE"
fi
read -ra flags <<<"$(portable_flags "$(cpu_flags)")"
build build-portable "${flags[@]}"
if result=$(smoke build-portable); then
    keep build-portable "(${flags[*]}), smoke pass llama-bench -p 4: $result; chosen because of $why"
    exit 0
fi
echo "error: no llama.cpp build here survives a 4-token pass ($why; portable: $result)" >&2
exit 1
