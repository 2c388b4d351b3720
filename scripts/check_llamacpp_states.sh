#!/usr/bin/env bash
# The suite's llama.cpp converter tests (marked `llamacpp`: tests/llamacpp_converter.py's users) in each state a clone
# can be in, whatever make target ran before (issue 63: after `make llamacpp` unpacked the tree, these 21 failed on a
# missing sentencepiece):
#   no tree                          every one skips, with NO_TREE's line;
#   the tree, no converter imports   every one skips, with the line that names the make target to run;
#   the tree and its imports         every one runs and passes.
# Needs only the unpacked tree and its pydeps folder (`make check-llamacpp-states` downloads the PyPI sdist and unpacks
# it, no compile), so CI can run it. Exit 1 with one line per state that went otherwise.
#
#   scripts/check_llamacpp_states.sh PYTHON SRC PYDEPS    # the project venv's python, llama.cpp's tree, its pydeps
set -euo pipefail

if [[ $# -ne 3 || ! -f $2/convert_hf_to_gguf.py || ! -d $3 ]]; then
    echo "usage: $0 PYTHON SRC PYDEPS (SRC: an unpacked llama.cpp tree, PYDEPS: its converter's imports;" \
         "make check-llamacpp-states gives both)" >&2
    exit 2
fi
python=$1 src=$(realpath "$2") pydeps=$(realpath "$3")
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/empty"

# $1: state name, $2: what every test must end as (passed / skipped), $3: words every skip reason holds; then the
# environment that makes the state. One line: the state and its counts.
state() {
    local name=$1 want=$2 words=$3
    shift 3
    env "$@" "$python" -m pytest -q -p no:xdist -p no:cacheprovider -m llamacpp tests \
        --junitxml="$scratch/$name.xml" >"$scratch/$name.log" 2>&1 || true
    "$python" - "$scratch/$name.xml" "$name" "$want" "$words" "$scratch/$name.log" <<'EOF'
import sys
import xml.etree.ElementTree as ET

xml, name, want, words, log = sys.argv[1:]
try:
    cases = list(ET.parse(xml).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    sys.exit(f"{name}: pytest wrote no report ({log})")
ends = {"failed": [c for c in cases if c.find("failure") is not None or c.find("error") is not None],
        "skipped": [c for c in cases if c.find("skipped") is not None]}
ends["passed"] = [c for c in cases if c not in ends["failed"] and c not in ends["skipped"]]
counts = ", ".join(f"{len(v)} {k}" for k, v in ends.items())
wrong = [c for c in ends["skipped"] if words not in c.find("skipped").get("message", "")]
if not cases or len(ends[want]) != len(cases) or wrong:
    sys.exit(f"{name}: {counts} of {len(cases)}, every one should have {want}"
             + (f" saying '{words}'" if want == "skipped" else "") + f" ({log})")
print(f"{name}: {counts} of {len(cases)}")
EOF
}

failed=0
state no-tree skipped "no llama.cpp tree" SELFSPEC_LLAMACPP_SRC="$scratch/empty" || failed=1
if "$python" -c "import sentencepiece" 2>/dev/null; then  # the converter's imports are the venv's own here
    echo "tree-without-pydeps: not a state of this venv (it imports sentencepiece itself)"
else
    state tree-without-pydeps skipped "make .llamacpp/pydeps/.installed" SELFSPEC_LLAMACPP_SRC="$src" \
        SELFSPEC_LLAMACPP_PYDEPS="$scratch/empty" || failed=1
fi
state tree-with-pydeps passed "" SELFSPEC_LLAMACPP_SRC="$src" SELFSPEC_LLAMACPP_PYDEPS="$pydeps" || failed=1
exit $failed
