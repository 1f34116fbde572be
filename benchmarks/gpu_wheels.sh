#!/bin/bash
# The Python packages mmprm needs that a LENT GPU machine (the device tool's H100 or H200) lacks, as
# files: that machine has no package registry, so they are downloaded here and carried in DIR.
#
#   bash benchmarks/gpu_wheels.sh download [DIR]          # here, with PyPI (DIR: .whl); skips what is there
#   bash benchmarks/gpu_wheels.sh install [DIR] [PYTHON]  # there: into PYTHON's environment (python3), no index
#   bash benchmarks/gpu_wheels.sh list                    # the pins below, NAME==VERSION KIND a line
#   bash benchmarks/gpu_wheels.sh size [DIR]              # bytes that travel: the working tree plus DIR
#
# The image (python3 3.12, torch 2.11.0+cu130, transformers 5.17.0, ...: benchmarks/gpu_image.txt)
# already holds everything else; each pin's requirements were read from its METADATA and fit the
# image's versions. benchmarks/gpu_offline_check.py rehearses `install` here, offline.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
LIMIT=67108864  # 64 MiB: what one device call carries, the working tree and DIR together

# Installed always. Versions: the dev .venv's where it has them, within pyproject.toml's bounds.
WHEELS=(
    # mmprm's loaders; needs pyarrow>=24, fsspec<=2026.9.0, huggingface-hub>=1.31,<3 (image: 1.33.0),
    # dill<0.4.2, multiprocess<0.70.20, pandas, xxhash, tqdm>=4.66.3, all in the image but the two below
    "datasets==5.2.0"
    "dill==0.4.1"                   # datasets' pickler
    "multiprocess==0.70.19"         # datasets' map(num_proc=); its wheel is py312-only, as the image is
    "math-verify==0.9.0"            # the answer checker (mmprm/answers.py); pins latex2sympy2_extended==1.11.0
    "latex2sympy2_extended==1.11.0" # MATH-V's judge parses with it; needs antlr4 <=4.13.2 and sympy
    "antlr4-python3-runtime==4.13.2"
    "liger-kernel==0.8.5"           # the liger extra (<0.9): fused LM loss on CUDA; needs torch>=2.1.2, triton>=2.3.1
    # deepspeed's config classes; pydantic pins pydantic-core exactly and needs typing-extensions>=4.16
    "pydantic==2.14.4"
    "pydantic-core==2.50.5"
    "annotated-types==0.8.0"        # pydantic's, >=0.6
    "typing-inspection==0.4.5"      # pydantic's, >=0.4.4
    "hjson==3.1.0"                  # deepspeed's config reader
)
# Insurance: installed only where the environment's own is missing or older than this (never a
# downgrade). The image holds both, at versions nobody has read.
INSURANCE=(
    # datasets 5.2.0's floor, and the smallest wheel that meets it (49 MB; 26.0.1 is 55 MB and
    # would not fit in 64 MiB beside the tree)
    "pyarrow==24.0.0"
    "typing-extensions==4.16.0"  # pydantic 2.14's floor (an image of before 2026-07 has an older one)
)
# No wheel on PyPI: built there from the sdist, DS_BUILD_OPS=0 (ops compile at first use, if ever).
# The deepspeed extra (<0.20); needs einops, hjson, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo,
# pydantic>=2, torch>=2, tqdm, and with a CUDA torch nvidia-ml-py: the image has all but hjson, pydantic.
SDISTS=(
    "deepspeed==0.19.8"
)
PLATFORMS=(
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64
)

usage() {
    sed -n '2,8s/^# \{0,1\}//p' "$0" >&2
}

norm() {  # a distribution name as wheel files spell it: lower case, runs of -_. as one _
    local n=${1,,}
    n=${n//[-.]/_}
    while [[ $n == *__* ]]; do n=${n//__/_}; done
    printf '%s' "$n"
}

# file_name_version FILE: "name version" of a wheel or sdist file name (name normalised)
file_name_version() {
    local base=${1##*/} name ver
    if [[ $base == *.whl ]]; then
        name=${base%%-*}
        ver=${base#*-}
        ver=${ver%%-*}
    elif [[ $base == *.tar.gz ]]; then
        base=${base%.tar.gz}
        name=${base%-*}
        ver=${base##*-}
    else
        return 1
    fi
    printf '%s %s' "$(norm "$name")" "$ver"
}

# pinned_file DIR NAME==VERSION: the one file of that pin in DIR (status 1 if none)
pinned_file() {
    local want_name want_ver f nv
    want_name=$(norm "${2%%==*}")
    want_ver=${2#*==}
    for f in "$1"/*; do
        nv=$(file_name_version "$f") || continue
        if [[ $nv == "$want_name $want_ver" ]]; then
            printf '%s' "$f"
            return 0
        fi
    done
    return 1
}

# stale_files DIR NAME==VERSION: files in DIR of that package at another version
stale_files() {
    local want_name want_ver f nv
    want_name=$(norm "${2%%==*}")
    want_ver=${2#*==}
    for f in "$1"/*; do
        nv=$(file_name_version "$f") || continue
        if [[ ${nv% *} == "$want_name" && ${nv#* } != "$want_ver" ]]; then
            printf '%s\n' "$f"
        fi
    done
}

list() {
    local pin
    for pin in "${WHEELS[@]}"; do printf '%s wheel\n' "$pin"; done
    for pin in "${INSURANCE[@]}"; do printf '%s insurance\n' "$pin"; done
    for pin in "${SDISTS[@]}"; do printf '%s sdist\n' "$pin"; done
}

# size [DIR]: one JSON line, the bytes that travel (tracked and untracked-not-ignored files, as the
# device tool counts them, plus every file in DIR); exit 1 when over the 64 MiB limit
size() {
    local dir=${1:-.whl} tree wheels=0 total
    if ! tree=$(git -C "$REPO" ls-files -z --cached --others --exclude-standard |
        (cd "$REPO" && xargs -0 -r stat -c %s -- 2> /dev/null) | awk '{s += $1} END {print s + 0}'); then
        echo "size: git ls-files failed in $REPO (not a git work tree?)" >&2
        return 2
    fi
    if [[ -d $dir ]]; then
        wheels=$(find "$dir" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    fi
    total=$((tree + wheels))
    printf '{"tree_bytes": %d, "wheels_bytes": %d, "total_bytes": %d, "limit_bytes": %d, "total_mib": %.1f, "ok": %s}\n' \
        "$tree" "$wheels" "$total" "$LIMIT" "$(awk -v t="$total" 'BEGIN {print t / 1048576}')" \
        "$([[ $total -lt $LIMIT ]] && echo true || echo false)"
    [[ $total -lt $LIMIT ]]
}

download() {
    local dir=${1:-.whl} pin f failed=() fetched=0
    local pip=(python3 -m pip download -q --no-deps --disable-pip-version-check -d "$dir")
    mkdir -p "$dir" || return 1
    for pin in "${WHEELS[@]}" "${INSURANCE[@]}" "${SDISTS[@]}"; do
        while IFS= read -r f; do
            [[ -n $f ]] || continue
            echo "removing $f: another version than $pin (two versions stop the whole install)"
            rm -f -- "$f"
        done < <(stale_files "$dir" "$pin")
        if pinned_file "$dir" "$pin" > /dev/null; then
            continue
        fi
        echo "downloading $pin"
        if [[ " ${SDISTS[*]} " == *" $pin "* ]]; then
            "${pip[@]}" --no-binary=:all: "$pin"
        else
            "${pip[@]}" --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" "$pin"
        fi || failed+=("$pin")
        fetched=$((fetched + 1))
    done
    echo "$fetched downloaded, $((${#WHEELS[@]} + ${#INSURANCE[@]} + ${#SDISTS[@]} - fetched)) already there;" \
        "$(find "$dir" -type f -printf '%s\n' | awk '{s += $1} END {printf "%.1f MB (%.1f MiB)", s / 1e6, s / 1048576}') in $dir"
    size "$dir" || echo "over the limit: the tree and $dir would not travel together (drop the insurance wheels?)"
    if ((${#failed[@]})); then
        echo "FAILED to download: ${failed[*]}" >&2
        return 1
    fi
}

# needs_insurance PYTHON NAME==VERSION: status 0 when PYTHON's NAME is missing or older than VERSION
needs_insurance() {
    "$1" - "${2%%==*}" "${2#*==}" << 'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    from packaging.version import Version
except ImportError:  # pip always carries one
    from pip._vendor.packaging.version import Version
name, want = sys.argv[1:]
try:
    have = version(name)
except PackageNotFoundError:
    print(f"insurance: {name} is not installed: installing {want}")
    sys.exit(0)
older = Version(have) < Version(want)
print(f"insurance: {name} {have} is there: " + (f"older than {want}, installing {want}" if older else "kept"))
sys.exit(0 if older else 1)
PY
}

install() {
    local dir=${1:-.whl} py=${2:-python3} pin f files=() missing=() failed=() t0
    export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    local pip=("$py" -m pip install -q --no-index --no-deps --no-cache-dir --no-compile)
    if ! "$py" -m pip --version > /dev/null; then
        echo "install: '$py -m pip' does not run: give the python whose environment to install into" >&2
        return 1
    fi
    for pin in "${WHEELS[@]}"; do
        if f=$(pinned_file "$dir" "$pin"); then files+=("$f"); else missing+=("$pin"); fi
    done
    for pin in "${INSURANCE[@]}"; do
        needs_insurance "$py" "$pin" || continue
        if f=$(pinned_file "$dir" "$pin"); then files+=("$f"); else missing+=("$pin"); fi
    done
    for pin in "${SDISTS[@]}"; do
        pinned_file "$dir" "$pin" > /dev/null || missing+=("$pin")
    done
    if ((${#missing[@]})); then
        echo "install: not in $dir: ${missing[*]} (run 'bash benchmarks/gpu_wheels.sh download $dir' where PyPI is reachable)" >&2
        return 1
    fi

    t0=$SECONDS
    if ! "${pip[@]}" "${files[@]}"; then
        echo "the wheels did not install together; one at a time, to name the one that fails:" >&2
        for f in "${files[@]}"; do
            "${pip[@]}" "$f" || failed+=("${f##*/}")
        done
    fi
    echo "wheels: ${#files[@]} in $((SECONDS - t0)) s"
    for pin in "${SDISTS[@]}"; do
        t0=$SECONDS
        f=$(pinned_file "$dir" "$pin")
        DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation "$f" || failed+=("${f##*/} (built from the sdist)")
        echo "$pin: built from its sdist and installed in $((SECONDS - t0)) s"
    done
    t0=$SECONDS
    "${pip[@]}" --no-build-isolation -e "$REPO" || failed+=("mmprm (pip install -e $REPO)")
    echo "mmprm: installed editable from $REPO in $((SECONDS - t0)) s"

    echo "pip check:"
    "$py" -m pip check || true
    if ((${#failed[@]})); then
        echo "FAILED to install: ${failed[*]}" >&2
        return 1
    fi
}

case ${1:-} in
    download) download "${@:2}" ;;
    install) install "${@:2}" ;;
    list) list ;;
    size) size "${@:2}" ;;
    *)
        echo "gpu_wheels.sh: unknown subcommand '${1:-}'" >&2
        usage
        exit 2
        ;;
esac
