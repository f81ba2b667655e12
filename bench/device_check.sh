#!/usr/bin/env bash
# One call on the lent GPU machine (one H200): at most 450 s in seven sections, the paths no GPU
# has run first. Through the device tool, from the repo root (bench/README.md):
#
#   run(command="DYNCTX_GIT_REVISION=<sha> bash bench/device_check.sh", timeout_s=500)
#
# Each section has a floor and a budget (seconds): it runs under `timeout` for its budget, or
# for what is left of the total if that is less; with less left than its floor it is recorded
# as skipped for lack of time (no section ever runs under `timeout 0`). Each writes its results
# as it goes, so a section killed at its budget keeps what it wrote, and the table is printed
# last whatever happened.
#
#   section    floor budget  what                                       writes under $OUT
#   versions     8    15     nvidia-smi, versions, install the checkout  device_check.log
#   smoke       20    90     bench/device_smoke.py: one JSON line per    smoke.jsonl
#                            check of what never ran on a GPU (18
#                            checks, 4 workers)
#   kernels     30   100     pytest tests/kernels compiled (paged        tests.log
#                            attention and launcher views first; -v,
#                            a per-test timeout, one file per worker)
#   e2e         20    70     pytest tests/e2e -m "gpu or interpreter"    tests.log (appended)
#                            on CUDA (graph and async cases included)
#   engine      30    90     bench/gpu_engine_graphs.py at batch         engine_graphs.json
#                            1/64/256, transformers last
#   attention   15    45     bench/attention_bench.py, JSON per row      attention.json
#   tune        30   rest    autotune tune of paged attention only       autotune_cache.tar
#   (then)                   the table                                   summary.txt
#
# That is 7 files (the tool brings back 8 at most); every section's own output goes to
# device_check.log (tests.log for pytest). Tuning continues across runs: the committed
# autotune_cache/<device>/ files seed the scratch folder and keys already there are kept
# (--skip-existing), unless DYNCTX_DEVICE_RETUNE=1. bench/device_collect.sh brings the results
# into the checkout.
#
# --dry (or DYNCTX_DEVICE_DRY=1): the same sections on a CPU with tiny sizes, the Triton
# interpreter for the kernels, no install into the running Python (a link tree instead), as CI
# runs it (tests/test_device_check_dry.py); tune is refused there (no GPU) and recorded skipped.
#
# Environment: PYTHON (default python3), DYNCTX_GIT_REVISION (the device machine gets no .git),
# DYNCTX_DEVICE_BUDGET_S (total, default 450), DYNCTX_DEVICE_SECTIONS (comma-separated subset,
# e.g. for a rerun; versions always runs), DYNCTX_DEVICE_BUDGETS ("kernels=60,engine=90": other
# budgets), DYNCTX_DEVICE_TESTS / DYNCTX_DEVICE_E2E_TESTS (pytest arguments instead of the
# default files), DYNCTX_DEVICE_ENGINE_ARGS (more bench/gpu_engine_graphs.py arguments),
# DYNCTX_DEVICE_TUNE_KERNELS (default "paged_attention_decode paged_attention_varlen"),
# DYNCTX_DEVICE_RETUNE=1, DYNCTX_DEVICE_INSTALL=pip (pip install --no-deps --no-build-isolation
# instead of the link tree; falls back to the tree).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SELF=$REPO/bench/device_check.sh
cd "$REPO" || exit 1

SECTIONS=(versions smoke kernels e2e engine attention tune)
declare -A FLOOR=([versions]=8 [smoke]=20 [kernels]=30 [e2e]=20 [engine]=30 [attention]=15
                  [tune]=30)
declare -A BUDGET=([versions]=15 [smoke]=90 [kernels]=100 [e2e]=70 [engine]=90 [attention]=45
                   [tune]=0)
# Seconds kept for the table at the end.
RESERVE=5

elapsed() { echo $(( $(date +%s) - START )); }
log() { echo "[$(elapsed)s] $*" | tee -a "$LOG"; }
have_module() { "$PY" -P -c "import $1" >/dev/null 2>&1; }
# Exit status of a section body that decided it cannot run here; its reason is in note.<name>.
SKIPPED=99

# ------------------------------------------------------------------------------------------
# Section bodies: each runs as `bash device_check.sh --section NAME SECONDS` under timeout.
# ------------------------------------------------------------------------------------------

section_versions() {
    {
        echo "== versions =="
        if command -v nvidia-smi >/dev/null 2>&1; then
            nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
                --format=csv,noheader
        else
            echo "nvidia-smi: not on this machine"
        fi
    } >>"$LOG" 2>&1
    local tree=$SCRATCH/pythonpath how=links
    if [ "${DYNCTX_DEVICE_INSTALL:-links}" = pip ] && [ "$DRY" != 1 ]; then
        if timeout -k 2 $(( $1 / 2 )) "$PY" -m pip install -q --no-deps --no-build-isolation \
                --no-index . >>"$LOG" 2>&1; then
            how=pip
        else
            echo "pip install failed or ran out of time: the link tree instead" >>"$LOG"
        fi
    fi
    if [ "$how" = links ]; then
        # The package layout of pyproject.toml's package-dir, as links to the checkout.
        "$PY" -P - "$REPO" "$tree" >>"$LOG" 2>&1 <<'PYEOF' || return 1
import sys, tomllib
from pathlib import Path

repo, tree = Path(sys.argv[1]), Path(sys.argv[2])
layout = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for package, folder in sorted(layout.items()):
    target = tree.joinpath(*package.split("."))
    if package.count(".") == 0:  # the root package: its files, not its folder
        target.mkdir(parents=True, exist_ok=True)
        for f in (repo / folder).glob("*.py"):
            (target / f.name).symlink_to(f)
    else:
        target.symlink_to(repo / folder, target_is_directory=True)
print(f"link tree {tree}: {', '.join(sorted(layout))}")
PYEOF
        echo "export PYTHONPATH=$tree\${PYTHONPATH:+:\$PYTHONPATH}" >"$SCRATCH/env.sh"
        export PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH}
    else
        : >"$SCRATCH/env.sh"
    fi
    # Import from elsewhere than the checkout: what is installed (or linked) must be enough.
    (cd /tmp && "$PY" -P - "$how" "$SCRATCH/versions.json" <<'PYEOF') >>"$LOG" 2>&1
import json, os, platform, subprocess, sys
from importlib import metadata

import torch

import dynctx
import dynctx.engine
import dynctx.kernels


def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
            triton=version("triton"), transformers=version("transformers"),
            install=sys.argv[1], dynctx=os.path.dirname(dynctx.__file__))
info["git_revision"] = os.environ.get("DYNCTX_GIT_REVISION") or subprocess.run(
    ["git", "-C", os.environ["REPO"], "rev-parse", "--short", "HEAD"], capture_output=True,
    text=True).stdout.strip() or None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30),
                capability=f"{p.major}.{p.minor}")
else:
    info["gpu"] = None
json.dump(info, open(sys.argv[2], "w"))
print(" ".join(f"{k}={v}" for k, v in info.items()))
PYEOF
}

section_smoke() {
    local args=(--out "$OUT/smoke.jsonl" --max-seconds $(( $1 - 4 )))
    if [ "$DRY" = 1 ]; then
        # The workers refuse megatron and flashinfer, which the GPU machine's image lacks:
        # a check that needs either fails here first.
        DYNCTX_SMOKE_ABSENT=megatron,flashinfer TRITON_INTERPRET=1 \
            "$PY" -P bench/device_smoke.py --device cpu --jobs 1 "${args[@]}"
    else
        # One worker per group (engine, kernels, memory, speculative) on 16 cores, one GPU.
        "$PY" -P bench/device_smoke.py --device cuda --jobs 4 "${args[@]}"
    fi >>"$LOG" 2>&1
}

# pytest_section NAME SECONDS WORKERS MARKERS ARGS...: one pytest run appended to tests.log.
pytest_section() {
    local name=$1 seconds=$2 workers=$3 markers=$4
    shift 4
    local opts=(-v -p no:cacheprovider -rfEs --durations=10 -m "$markers")
    if have_module xdist && (( workers > 1 )); then
        opts+=(-n "$workers" --dist loadfile)
    fi
    # A test that hangs is stopped at half the section (none longer than 60 s; the first test
    # of a worker compiles the kernels it needs).
    if have_module pytest_timeout; then
        local per_test=$(( seconds / 2 ))
        (( per_test > 60 )) && per_test=60
        opts+=(--timeout "$per_test")
    fi
    echo "=== section $name: pytest ${opts[*]} $* ===" >>"$TESTS_LOG"
    # Skips are expected here (no megatron-core on the GPU image; the CUDA cases of a dry run on a
    # CPU), and -rfEs lists them: the CI rule that fails a skip (tests/conftest.py) stays off.
    DYNCTX_STRICT_SKIPS=0 "$PY" -P -m pytest "${opts[@]}" "$@" >>"$TESTS_LOG" 2>&1
}

section_kernels() {
    local tests=()
    if [ -n "${DYNCTX_DEVICE_TESTS:-}" ]; then
        read -r -a tests <<<"$DYNCTX_DEVICE_TESTS"
    else
        # The paged attention and launcher views files first: xdist hands out files in order.
        local first=(tests/kernels/test_paged_attention.py tests/kernels/test_launcher_views.py)
        local f
        for f in "${first[@]}"; do [ -f "$f" ] && tests+=("$f"); done
        for f in tests/kernels/test_*.py; do
            [[ " ${first[*]} " == *" $f "* ]] || tests+=("$f")
        done
        if [ "$DRY" = 1 ]; then
            tests=("${tests[@]:0:2}" -k "decode_tight-mha-fp32 or kv_append-key-strided")
        fi
    fi
    local workers=$(( $(nproc) - 4 ))
    (( workers > 12 )) && workers=12
    if [ "$DRY" = 1 ]; then
        export TRITON_INTERPRET=1
        pytest_section kernels "$1" 1 "interpreter or gpu" "${tests[@]}"
    else
        export DYNCTX_TEST_DEVICE=cuda
        pytest_section kernels "$1" "$workers" "interpreter or gpu" "${tests[@]}"
    fi
}

section_e2e() {
    local tests=(tests/e2e)
    [ -n "${DYNCTX_DEVICE_E2E_TESTS:-}" ] && read -r -a tests <<<"$DYNCTX_DEVICE_E2E_TESTS"
    if [ "$DRY" = 1 ]; then
        # On a CPU the gpu cases skip and the interpreter ones take minutes: the CUDA files.
        [ -n "${DYNCTX_DEVICE_E2E_TESTS:-}" ] || tests=(tests/e2e/test_async_scheduling_cuda.py
                                                         tests/e2e/test_llama_engine.py)
        export TRITON_INTERPRET=1
        pytest_section e2e "$1" 1 "gpu or interpreter" "${tests[@]}"
    else
        export DYNCTX_TEST_DEVICE=cuda
        pytest_section e2e "$1" 4 "gpu or interpreter" "${tests[@]}"
    fi
}

section_engine() {
    local args extra=()
    if [ "$DRY" = 1 ]; then
        args=(--tiny --device cpu --batches 1,3 --new-tokens 3 --prompt-len 5 --max-tokens 64
              --buffer-gb 0.01 --num-cuda-graphs 2 --warmup-tokens 2)
    else
        args=(--batches 1,64,256)
    fi
    # New runs stop in time for the one in flight to finish (about 20 s at batch 256).
    local stop=$(( $1 > 50 ? $1 - 25 : $1 / 2 ))
    [ -n "${DYNCTX_DEVICE_ENGINE_ARGS:-}" ] && read -r -a extra <<<"$DYNCTX_DEVICE_ENGINE_ARGS"
    "$PY" -P bench/gpu_engine_graphs.py "${args[@]}" --max-seconds "$stop" \
        --out "$OUT/engine_graphs.json" ${extra[@]+"${extra[@]}"} >>"$LOG" 2>&1
}

section_attention() {
    if [ "$DRY" = 1 ]; then
        TRITON_INTERPRET=1 "$PY" -P bench/attention_bench.py --json "$OUT/attention.json" \
            --batch 1 --context 40 --prefill 1x40 --heads 4 --kv-heads 2 --head-dim 16 \
            --block-size 16 --dtype float32 --calls 1
    else
        "$PY" -P bench/attention_bench.py --json "$OUT/attention.json"
    fi >>"$LOG" 2>&1
}

section_tune() {
    local kernels=() args=(--out "$TUNE_DIR" --max-seconds $(( $1 - 10 )))
    local k
    for k in ${DYNCTX_DEVICE_TUNE_KERNELS:-paged_attention_decode paged_attention_varlen}; do
        kernels+=(--kernel "$k")
    done
    [ "${DYNCTX_DEVICE_RETUNE:-0}" = 1 ] || args+=(--skip-existing)
    "$PY" -P -m dynctx autotune tune "${kernels[@]}" "${args[@]}" >"$SCRATCH/tune.log" 2>&1
    local rc=$?
    cat "$SCRATCH/tune.log" >>"$LOG"
    if (( rc == 2 )) && grep -q "refused:" "$SCRATCH/tune.log"; then
        grep -o "refused: [^.(]*" "$SCRATCH/tune.log" | head -n 1 >"$SCRATCH/note.tune"
        return $SKIPPED
    fi
    return $rc
}

# ------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------

if [ "${1:-}" = "--section" ]; then
    # shellcheck disable=SC1091
    [ -f "$SCRATCH/env.sh" ] && . "$SCRATCH/env.sh"
    "section_$2" "$3"
    exit $?
fi

DRY=${DYNCTX_DEVICE_DRY:-0}
[ "${1:-}" = "--dry" ] && DRY=1

# The knobs are checked before anything is written.
BUDGETS=${DYNCTX_DEVICE_BUDGETS:-}
for item in ${BUDGETS//,/ }; do
    name=${item%%=*}
    if [ -z "${BUDGET[$name]+x}" ] || ! [[ ${item#*=} =~ ^[0-9]+$ ]]; then
        echo "DYNCTX_DEVICE_BUDGETS: '$item' is not SECTION=SECONDS with a section of" \
             "${SECTIONS[*]}" >&2
        exit 2
    fi
    BUDGET[$name]=${item#*=}
done
if ! [[ ${DYNCTX_DEVICE_BUDGET_S:-450} =~ ^[0-9]+$ ]]; then
    echo "DYNCTX_DEVICE_BUDGET_S='$DYNCTX_DEVICE_BUDGET_S' must be a whole number of seconds" >&2
    exit 2
fi
SELECTED=" ${SECTIONS[*]} "
if [ -n "${DYNCTX_DEVICE_SECTIONS:-}" ]; then
    SELECTED=" versions ${DYNCTX_DEVICE_SECTIONS//,/ } "
    for name in $SELECTED; do
        if [[ " ${SECTIONS[*]} " != *" $name "* ]]; then
            echo "DYNCTX_DEVICE_SECTIONS: no section '$name'; the sections: ${SECTIONS[*]}" >&2
            exit 2
        fi
    done
fi

OUT=${OUT:-/tmp/dynctx_device_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOTAL=${DYNCTX_DEVICE_BUDGET_S:-450}
START=$(date +%s)
SCRATCH=$(mktemp -d /tmp/dynctx_device.XXXXXX)
LOG=$OUT/device_check.log
TESTS_LOG=$OUT/tests.log
: >"$LOG"
: >"$TESTS_LOG"
: >"$SCRATCH/sections.tsv"
export REPO OUT PY DRY SCRATCH LOG TESTS_LOG PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# The Triton kernels compiled on the GPU (a dry run sets the interpreter per section).
unset TRITON_INTERPRET
# The configs tuned here: a scratch folder seeded with the committed ones (tuning continues).
export TUNE_DIR=$SCRATCH/autotune_cache
mkdir -p "$TUNE_DIR"
for d in "$REPO"/autotune_cache/*/; do
    ls "$d"*.json >/dev/null 2>&1 && cp -r "$d" "$TUNE_DIR/"
done

record() {  # NAME STATUS USED BUDGET
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${FLOOR[$1]}" >>"$SCRATCH/sections.tsv"
    log "section $1: $2 (${3}s of ${4}s)"
}

INSTALLED=0
run_section() {
    local name=$1 floor=${FLOOR[$1]} budget=${BUDGET[$1]}
    if [[ $SELECTED != *" $name "* ]]; then
        record "$name" "not selected" 0 0
        return
    fi
    local left=$(( TOTAL - $(elapsed) - RESERVE ))
    # Tuning takes the rest of the time, unless DYNCTX_DEVICE_BUDGETS gave it a budget.
    [ "$name" = tune ] && (( budget == 0 )) && budget=$left
    (( budget > left )) && budget=$left
    (( budget < 0 )) && budget=0
    if (( budget < floor )); then
        record "$name" "skipped: under its ${floor}s floor (${budget}s for it, ${left}s left)" \
            0 "$budget"
        return
    fi
    if [ "$name" != versions ] && [ "$INSTALLED" != 1 ]; then
        record "$name" "skipped: the install failed" 0 "$budget"
        return
    fi
    local t0 rc status
    t0=$(elapsed)
    log "section $name: up to ${budget}s"
    # TERM two seconds before the budget, KILL at it; timeout signals the whole process group.
    timeout -k 2 $(( budget - 2 )) bash "$SELF" --section "$name" "$budget"
    rc=$?
    case $rc in
        0) status=passed ;;
        124|137) status="killed at its budget (${budget}s)" ;;
        "$SKIPPED") status="skipped: $(cat "$SCRATCH/note.$name" 2>/dev/null)" ;;
        *) status="failed (exit $rc)" ;;
    esac
    # A file replaced whole by a process killed mid-write leaves its temporary beside it.
    rm -f "$OUT"/*.tmp
    record "$name" "$status" $(( $(elapsed) - t0 )) "$budget"
    if [ "$name" = versions ]; then
        [ "$rc" = 0 ] && INSTALLED=1
        # shellcheck disable=SC1091
        [ -f "$SCRATCH/env.sh" ] && . "$SCRATCH/env.sh"
    fi
    if [ "$name" = tune ] && ls "$TUNE_DIR"/*/*.json >/dev/null 2>&1; then
        tar -C "$SCRATCH" -cf "$OUT/autotune_cache.tar" autotune_cache 2>>"$LOG"
    fi
}

FINISHED=0
finish() {
    (( FINISHED )) && return
    FINISHED=1
    "$PY" -P - "$OUT" "$SCRATCH" "$TOTAL" "$(elapsed)" >"$OUT/summary.txt" 2>&1 <<'PYEOF'
import json, re, sys
from pathlib import Path

out, scratch, total, used = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


versions = load(scratch / "versions.json") or {}
print(f"== dynctx device check: {used} s of {total} s ==")
print("  ".join(f"{k} {versions.get(k)}" for k in
                ("gpu", "torch", "triton", "transformers", "git_revision", "install")))
print(f"{'section':<10} {'status':<58} {'used':>5} {'budget':>6} {'floor':>5}")
for line in (scratch / "sections.tsv").read_text().splitlines():
    name, status, spent, budget, floor = line.split("\t")
    print(f"{name:<10} {status[:58]:<58} {spent:>4}s {budget:>5}s {floor:>4}s")

lines = [json.loads(l) for l in (out / "smoke.jsonl").read_text().splitlines()
         if l.strip()] if (out / "smoke.jsonl").is_file() else []
if lines:
    print("-- smoke (smoke.jsonl)")
    for r in lines:
        print(f"{r['check']:<24} {r['status']:<9} {r.get('seconds', 0):6.1f}s  "
              f"{r.get('summary', '')}"[:300])
        for tb in r.get("traceback", [])[-3:]:
            print(f"{'':<26}| {tb}"[:300])

tests = (out / "tests.log").read_text(errors="replace") if (out / "tests.log").is_file() else ""
for part in re.split(r"^=== section ", tests, flags=re.M)[1:]:
    name = part.split(":", 1)[0]
    finals = [l for l in part.splitlines() if re.match(r"^=+ .*(passed|failed|error|skipped|no "
                                                        r"tests ran).* =+$", l)]
    failed = [l for l in part.splitlines() if re.match(r"^(FAILED|ERROR) ", l)]
    if finals:
        result = finals[-1].strip("= ")
    else:  # killed: count the -v lines
        counts = {w: len(re.findall(rf" {w}\b", part)) for w in ("PASSED", "FAILED", "ERROR",
                                                                  "SKIPPED")}
        result = "no final line; so far " + ", ".join(f"{n} {w.lower()}"
                                                        for w, n in counts.items())
        failed = [l.strip() for l in part.splitlines() if re.search(r" (FAILED|ERROR)\b", l)]
    print(f"-- {name} tests (tests.log): {result}")
    for l in failed[:12]:
        print(f"   {l}"[:200])
    if len(failed) > 12:
        print(f"   ... {len(failed) - 12} more")

engine = load(out / "engine_graphs.json")
if engine:
    print(f"-- engine (engine_graphs.json): {engine.get('device')} {engine.get('dtype')}, "
          f"{(engine.get('params') or 0) / 1e9:.2f}B params, prompt {engine.get('prompt_len')}, "
          f"{engine.get('new_tokens')} new tokens")
    print(f"{'mode':<13} {'batch':>5} {'tok/s':>9} {'step ms':>8} {'p90 ms':>7} {'steps':>5} "
          f"{'graph%':>6} {'same':>5}")
    for r in engine["runs"]:
        if "error" in r:
            print(f"{r['mode']:<13} {r['batch']:>5}  ERROR {r['error']}"[:200])
            continue
        share = 100 * r["graph_shape_steps"] / r["steps"] if r.get("steps") else None
        print(f"{r['mode']:<13} {r['batch']:>5} {fmt(r.get('tokens_per_s'), '.0f'):>9} "
              f"{fmt(r.get('step_ms_median'), '.2f'):>8} {fmt(r.get('step_ms_p90'), '.2f'):>7} "
              f"{r.get('decode_steps', 0):>5} {fmt(share, '.0f'):>6} "
              f"{fmt(r.get('same_tokens_as_eager'), '.2f'):>5}")
    for note in engine.get("notes", [])[2:]:
        print(f"note: {note}")

attention = load(out / "attention.json")
if attention:
    rows = attention.get("decode", []) + attention.get("prefill", [])
    print(f"-- attention (attention.json): {len(rows)} rows"
          f"{'' if attention.get('complete') else ' (incomplete)'}, {attention.get('dtype')}")
    for r in attention.get("decode", []):
        if "error" in r:
            print(f"decode {r['batch']:>4} x {r['context']:>6}: {r['error']}")
            continue
        print(f"decode {r['batch']:>4} x {r['context']:>6}: {fmt(r.get('ours_us'), '9.2f')} us "
              f"{fmt(r.get('ours_gbps'), '6.0f')} GB/s ({fmt(100 * r['ours_hbm_fraction'], '.0f')}"
              f"% HBM) sdpa {fmt(r.get('sdpa_us'), '.2f')} us, maxdiff "
              f"{fmt(r.get('max_abs_diff_vs_sdpa'), '.1e')}")
    for r in attention.get("prefill", []):
        print(f"prefill {r['prompts']} x {r['length']:>6}: {fmt(r.get('ours_tflops'), '.1f')} "
              f"TFLOP/s, sdpa {fmt(r.get('sdpa_tflops'), '.1f')}, maxdiff "
              f"{fmt(r.get('max_abs_diff_vs_sdpa'), '.1e')}")

tune_log = scratch / "tune.log"
tune = tune_log.read_text(errors="replace") if tune_log.is_file() else ""
tuned = [l for l in tune.splitlines()
         if re.match(r"^(dynctx autotune tune|  \S+ \S+=.*: |  (skipped|failed):)", l)]
if tuned:
    print("-- tune (autotune_cache.tar)")
    for l in tuned[-14:]:
        print(l[:200])
files = sorted(p.name for p in out.iterdir())
print(f"$OUT: {len(files) + (0 if 'summary.txt' in files else 1)} files: "
      f"{', '.join(sorted(set(files) | {'summary.txt'}))}")
PYEOF
    cat "$OUT/summary.txt"
    rm -rf "$SCRATCH"
}
trap finish EXIT
trap 'exit 143' TERM INT

log "dynctx device check in $REPO: budget ${TOTAL}s, dry=$DRY, sections:$SELECTED"
for name in "${SECTIONS[@]}"; do
    run_section "$name"
done
grep -q "	\(failed\|killed\)" "$SCRATCH/sections.tsv" && exit 1
exit 0
