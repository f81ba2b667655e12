#!/usr/bin/env bash
# One call on the lent GPU machine (H200): install the checkout, run the kernel tests compiled
# on the GPU and the end-to-end tests on CUDA, a compute-sanitizer pass, `autotune tune`, the
# paged attention bench (bench/attention_bench.py) and `autotune bench`, and print a short table
# last. Each phase runs under `timeout` inside a total budget (default 470 s); whatever a phase
# leaves is written under $OUT even when it fails. From the repo root, through the device tool
# (see bench/README.md):
#
#   DYNCTX_GIT_REVISION=<sha> bash bench/device_check.sh      # timeout_s=540
#
# $OUT gets at most 8 files, no folders (the tool returns 8 files, 2 folder levels):
#   device_check.log    versions, nvidia-smi, install, phase results
#   kernel_tests.log    pytest tests/kernels -m "interpreter or gpu", compiled; then the e2e
#                       tests on CUDA (pytest tests/e2e -m "gpu or interpreter")
#   attention.json      bench/attention_bench.py: decode us, GB/s and HBM fraction at batch
#                       1/8/64/256 x context 1K/4K/16K, prefill TFLOP/s, both against SDPA
#   sanitizer.log       compute-sanitizer memcheck over every config of every kernel
#   tune.log            python -m dynctx autotune tune
#   autotune_cache.tar  autotune_cache/<device>/<kernel>.json as tuned (bench/device_collect.sh)
#   results.json        python -m dynctx autotune bench
#   summary.txt         the table printed last
#
# Tuning continues across runs: the committed autotune_cache/<device>/ files seed the scratch
# folder and keys already there are kept (--skip-existing), unless DYNCTX_DEVICE_RETUNE=1.
#
# Environment: DYNCTX_DEVICE_TESTS (test files to run instead of tests/kernels),
# DYNCTX_DEVICE_SANITIZER=0 (skip the sanitizer phase), DYNCTX_DEVICE_BUDGET_S (total seconds, default 470), DYNCTX_GIT_REVISION (the
# checkout's revision: the device machine gets no .git), PYTHON (default python3),
# DYNCTX_DEVICE_SMOKE=1 (every phase on kv_append alone, 200 s by default: a cheap first try),
# DYNCTX_DEVICE_ENGINE_GRAPHS=1 (instead of the kernel phases, only the engine benchmark
# bench/gpu_engine_graphs.py: eager / CUDA graphs / graphs + async scheduling / transformers
# at batch 1, 16, 64, 256 on a random 1B Llama; 480 s by default, timeout_s=560; $OUT gets engine_graphs.{json,txt,log}).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 1
OUT=${OUT:-/tmp/dynctx_device_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SMOKE=${DYNCTX_DEVICE_SMOKE:-0}
TESTS=(tests/kernels)
KERNELS=()
if [ "$SMOKE" = 1 ]; then
    TESTS=(tests/kernels/test_kv_append.py tests/kernels/test_committed_configs.py)
    KERNELS=(--kernel kv_append)
fi
# DYNCTX_DEVICE_TESTS="a.py b.py": run only these test files (e.g. those not yet seen compiled).
[ -n "${DYNCTX_DEVICE_TESTS:-}" ] && read -r -a TESTS <<<"$DYNCTX_DEVICE_TESTS"
ENGINE_GRAPHS=${DYNCTX_DEVICE_ENGINE_GRAPHS:-0}
TOTAL=${DYNCTX_DEVICE_BUDGET_S:-$([ "$SMOKE" = 1 ] && echo 200 || { [ "$ENGINE_GRAPHS" = 1 ] && echo 480 || echo 470; })}
# Seconds kept for the paged attention bench (phase c2) while tuning; none in a smoke run.
ATTENTION_S=$([ "$SMOKE" = 1 ] && echo 0 || echo 110)
START=$(date +%s)
SCRATCH=$(mktemp -d /tmp/dynctx_device.XXXXXX)
LOG=$OUT/device_check.log
SUMMARY=$OUT/summary.txt
: >"$LOG"
: >"$SUMMARY"

export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET
export DYNCTX_TEST_DEVICE=cuda
# bench (and the tests' lookups) read the configs this run tunes, not the packaged ones.
export DYNCTX_AUTOTUNE_DIR=$SCRATCH/autotune_cache
mkdir -p "$DYNCTX_AUTOTUNE_DIR"
SKIP_EXISTING=(--skip-existing)
if [ "${DYNCTX_DEVICE_RETUNE:-0}" = 1 ]; then
    SKIP_EXISTING=()
else
    for d in "$REPO"/autotune_cache/*/; do
        [ -d "$d" ] && ls "$d"*.json >/dev/null 2>&1 && cp -r "$d" "$DYNCTX_AUTOTUNE_DIR/"
    done
fi

elapsed() { echo $(( $(date +%s) - START )); }
log() { echo "[$(elapsed)s] $*" | tee -a "$LOG"; }
# phase_budget WANT RESERVE: WANT seconds, or what is left after keeping RESERVE for later.
phase_budget() {
    local want=$1 left=$(( TOTAL - $(elapsed) - $2 ))
    (( left < want )) && want=$left
    (( want < 0 )) && want=0
    echo "$want"
}
PHASES=()
record() { PHASES+=("$(printf '%-12s %-28s %4ss' "$1" "$2" "$3")"); log "phase $1: $2 ($3 s)"; }

finish() {
    # Runs on every exit: pack the tuned configs and print the table, whatever happened before.
    if [ -n "$(ls -A "$DYNCTX_AUTOTUNE_DIR" 2>/dev/null)" ]; then
        tar -C "$SCRATCH" -cf "$OUT/autotune_cache.tar" autotune_cache 2>>"$LOG"
    fi
    {
        echo "== dynctx device check: $(elapsed) s of $TOTAL s budget =="
        printf '%s\n' ${PHASES[@]+"${PHASES[@]}"}
        if [ -s "$OUT/engine_graphs.txt" ]; then
            cat "$OUT/engine_graphs.txt"
        fi
        if [ -s "$OUT/results.json" ]; then
            "$PY" - "$OUT/results.json" <<'PYEOF'
import json, sys
data = json.load(open(sys.argv[1]))
print(f"device {data['device']}  torch {data['versions']['torch']}  triton "
      f"{data['versions']['triton']}  rev {data['versions']['git_revision']}")
print(f"{'kernel':<20} {'key':<34} {'src':<8} {'us':>8} {'GB/s':>7} {'%copy':>6} {'xtorch':>7} {'xmcore':>7}")
for r in data["results"]:
    key = r["key"]
    tok = next((f"{k[4:] if k.startswith('num_') else k}={v}" for k, v in key.items()
                if k in ("num_tokens", "num_requests", "num_rows")), "")
    rest = ",".join(f"{v}" for k, v in sorted(key.items())
                    if k not in ("num_tokens", "num_requests", "num_rows", "dtype"))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    mcore = r.get("peers", {}).get("megatron_core", {}).get("speedup")
    ratio = r.get("ratio_to_copy")
    print(f"{r['kernel'][:20]:<20} {(tok + ' ' + rest)[:34]:<34} {r['config_source'][:8]:<8} "
          f"{fmt(r.get('kernel_us'), '.2f'):>8} {fmt(r.get('kernel_gbps'), '.0f'):>7} "
          f"{fmt(None if ratio is None else 100 * ratio, '.0f'):>6} "
          f"{fmt(r.get('speedup_vs_reference'), '.2f'):>7} {fmt(mcore, '.2f'):>7}"
          f"{'' if r.get('check') == 'passed' else '  CHECK FAILED'}")
for item in data.get("skipped", []):
    print(f"skipped: {item}")
PYEOF
        elif [ "$ENGINE_GRAPHS" != 1 ]; then
            echo "no bench results"
        fi
        if [ -s "$OUT/attention.json" ]; then
            "$PY" - "$OUT/attention.json" <<'PYEOF'
import json, sys
data = json.load(open(sys.argv[1]))
fmt = lambda v, spec: "-" if v is None else format(v, spec)
print(f"paged attention decode (published Hopper: ~{data['published_decode_us_batch1_1k']} us "
      f"at batch 1 / 1K; HBM {data['hbm_gbps']:.0f} GB/s)")
print(f"{'batch':>6} {'ctx':>6} {'ours us':>9} {'GB/s':>6} {'%HBM':>5} {'sdpa us':>9} "
      f"{'sdpa GB/s':>9} {'maxdiff':>8}")
for r in data["decode"]:
    if "error" in r:
        print(f"{r['batch']:>6} {r['context']:>6} {r['error']}")
        continue
    print(f"{r['batch']:>6} {r['context']:>6} {fmt(r['ours_us'], '.2f'):>9} "
          f"{fmt(r['ours_gbps'], '.0f'):>6} {fmt(100 * r['ours_hbm_fraction'], '.0f'):>5} "
          f"{fmt(r.get('sdpa_us'), '.2f'):>9} {fmt(r.get('sdpa_gbps'), '.0f'):>9} "
          f"{fmt(r.get('max_abs_diff_vs_sdpa'), '.1e'):>8}")
print("paged attention prefill (causal)")
for r in data["prefill"]:
    print(f"{r['prompts']:>3} x {r['length']:>6}: ours {fmt(r['ours_tflops'], '.1f')} TFLOP/s, "
          f"sdpa {fmt(r.get('sdpa_tflops'), '.1f')} TFLOP/s, ratio "
          f"{fmt(r.get('ours_over_sdpa_throughput'), '.2f')}, maxdiff "
          f"{fmt(r.get('max_abs_diff_vs_sdpa'), '.1e')}")
PYEOF
        fi
    } >"$SUMMARY" 2>&1
    cat "$SUMMARY"
    rm -rf "$SCRATCH"
}
trap finish EXIT

log "dynctx device check in $REPO, budget $TOTAL s, smoke=$SMOKE, scratch $SCRATCH"
{
    nvidia-smi
    "$PY" - <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton missing:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "SMs", p.multi_processor_count, "L2", getattr(p, "L2_cache_size", "?"),
          "memory", p.total_memory)
PYEOF
} >>"$LOG" 2>&1

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader \
    2>&1 | tee -a "$LOG"
grep -E "^(python|triton|gpu) " "$LOG" | tail -n 3

# Install: pip's editable install, else a symlink tree of the package layout on PYTHONPATH.
t0=$(elapsed)
if timeout -k 5 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$LOG" 2>&1 \
    && (cd /tmp && "$PY" -c "import dynctx.kernels, dynctx.cli_autotune") >>"$LOG" 2>&1; then
    record install "pip install -e ok" $(( $(elapsed) - t0 ))
else
    TREE=$SCRATCH/pythonpath
    mkdir -p "$TREE/dynctx"
    for f in "$REPO"/cli/*.py; do ln -sf "$f" "$TREE/dynctx/$(basename "$f")"; done
    for sub in kernels context models engine autotune_cache; do
        [ -d "$REPO/$sub" ] && ln -sfn "$REPO/$sub" "$TREE/dynctx/$sub"
    done
    export PYTHONPATH=$TREE${PYTHONPATH:+:$PYTHONPATH}
    if (cd /tmp && "$PY" -c "import dynctx.kernels, dynctx.cli_autotune") >>"$LOG" 2>&1; then
        record install "pip failed; symlink tree" $(( $(elapsed) - t0 ))
    else
        record install "FAILED (see log)" $(( $(elapsed) - t0 ))
        exit 1
    fi
fi

# The engine benchmark alone (DYNCTX_DEVICE_ENGINE_GRAPHS=1), in place of phases (a)-(d).
if [ "$ENGINE_GRAPHS" = 1 ]; then
    b=$(phase_budget 600 5)
    t0=$(elapsed)
    # DYNCTX_ENGINE_GRAPHS_ARGS: extra arguments (e.g. "--batches 1,16 --new-tokens 32").
    read -r -a EXTRA <<<"${DYNCTX_ENGINE_GRAPHS_ARGS:-}"
    timeout -k 10 "$b" "$PY" bench/gpu_engine_graphs.py --max-seconds $(( b * 3 / 4 )) \
        --out "$OUT/engine_graphs.json" ${EXTRA[@]+"${EXTRA[@]}"} >"$OUT/engine_graphs.log" 2>&1
    rc=$?
    tail -n 12 "$OUT/engine_graphs.log" | tee -a "$LOG"
    case $rc in
        0) what="passed" ;; 124|137) what="TIMED OUT after $b s" ;; *) what="FAILED rc=$rc" ;;
    esac
    record engine-graphs "$what" $(( $(elapsed) - t0 ))
    exit 0
fi

# Megatron-Core's kv append kernel, carried as one file or as its wheel (bench/README.md).
if [ -f "$REPO/.device_carry/fused_kv_append_kernel.py" ]; then
    export DYNCTX_MEGATRON_KV_APPEND=$REPO/.device_carry/fused_kv_append_kernel.py
fi

# (a) The kernel tests, compiled on the GPU: the same files the interpreter runs on a CPU.
b=$(phase_budget 90 $(( TOTAL * 3 / 4 )))
t0=$(elapsed)
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
timeout -k 10 "$b" "$PY" -m pytest -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} --maxfail=20 -rfEs \
    --durations=10 -m "interpreter or gpu" "${TESTS[@]}" >"$OUT/kernel_tests.log" 2>&1
rc=$?
tail -n 3 "$OUT/kernel_tests.log" | tee -a "$LOG"
case $rc in
    0) what="passed" ;; 124|137) what="TIMED OUT after $b s" ;; 5) what="no tests collected" ;;
    *) what="FAILED rc=$rc" ;;
esac
record kernel-tests "$what" $(( $(elapsed) - t0 ))

# (a2) The end-to-end tests on CUDA (tokens and per-step logits against transformers; bf16 to
# its tolerance), the Triton attention among them; appended to kernel_tests.log.
b=$(phase_budget 45 $(( TOTAL * 2 / 3 )))
t0=$(elapsed)
if [ "$SMOKE" != 1 ] && (( b > 15 )); then
    echo "== pytest tests/e2e -m 'gpu or interpreter' (CUDA) ==" >>"$OUT/kernel_tests.log"
    timeout -k 10 "$b" "$PY" -m pytest -q -p no:cacheprovider --maxfail=10 -rfEs --durations=5 \
        -m "gpu or interpreter" tests/e2e >>"$OUT/kernel_tests.log" 2>&1
    rc=$?
    tail -n 2 "$OUT/kernel_tests.log" | tee -a "$LOG"
    case $rc in
        0) what="passed" ;; 124|137) what="TIMED OUT after $b s" ;; 5) what="no tests collected" ;;
        *) what="FAILED rc=$rc" ;;
    esac
else
    what="skipped (smoke run or no time)"
fi
record e2e-tests "$what" $(( $(elapsed) - t0 ))

# (b) compute-sanitizer memcheck over every config of every kernel at its smallest key.
b=$(phase_budget 40 $(( TOTAL * 7 / 12 )))
t0=$(elapsed)
if [ "${DYNCTX_DEVICE_SANITIZER:-1}" = 1 ] && command -v compute-sanitizer >/dev/null 2>&1 \
        && (( b > 15 )); then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 10 "$b" compute-sanitizer --tool memcheck \
        --error-exitcode 3 "$PY" bench/check_all_configs.py --max-seconds $(( b - 10 )) \
        ${KERNELS[@]+"${KERNELS[@]}"} \
        >"$OUT/sanitizer.log" 2>&1
    rc=$?
    tail -n 2 "$OUT/sanitizer.log" | tee -a "$LOG"
    case $rc in
        0) what="clean" ;; 3) what="MEMCHECK ERRORS" ;; 124|137) what="TIMED OUT after $b s" ;;
        *) what="FAILED rc=$rc" ;;
    esac
else
    what="skipped (no compute-sanitizer or no time)"
    echo "$what" >"$OUT/sanitizer.log"
fi
record sanitizer "$what" $(( $(elapsed) - t0 ))

# (c) Tune: the attention path first, then every other kernel while time remains.
t0=$(elapsed)
b=$(phase_budget 150 $(( TOTAL / 10 + ATTENTION_S )))
what="skipped (no time)"
if (( b > 20 )); then
    timeout -k 10 "$b" "$PY" -m dynctx autotune tune --preset llama --max-seconds $(( b - 25 )) \
        ${KERNELS[@]+"${KERNELS[@]}"} ${SKIP_EXISTING[@]+"${SKIP_EXISTING[@]}"} \
        --out "$DYNCTX_AUTOTUNE_DIR" >"$OUT/tune.log" 2>&1
    rc=$?
    what="llama rc=$rc"
    b=$(phase_budget 600 $(( TOTAL / 10 + ATTENTION_S )))
    if (( b > 30 )) && [ "$SMOKE" != 1 ]; then
        timeout -k 10 "$b" "$PY" -m dynctx autotune tune --preset all --skip-existing \
            --max-seconds $(( b - 25 )) --out "$DYNCTX_AUTOTUNE_DIR" >>"$OUT/tune.log" 2>&1
        what="$what, all rc=$?"
    fi
    grep -E "^dynctx autotune tune: wrote|^  (skipped|failed):" "$OUT/tune.log" | tee -a "$LOG"
fi
record tune "$what" $(( $(elapsed) - t0 ))

# (c2) Paged attention: decode at batch 1/8/64/256 x context 1K/4K/16K and causal prefill, our
# kernels (the configs just tuned) against SDPA on the same data laid out contiguously.
t0=$(elapsed)
b=$(phase_budget "$ATTENTION_S" $(( TOTAL / 12 )))
what="skipped (smoke run or no time)"
if (( b > 20 )); then
    timeout -k 10 "$b" "$PY" bench/attention_bench.py --json "$OUT/attention.json" >>"$LOG" 2>&1
    rc=$?
    case $rc in
        0) what="passed" ;; 124|137) what="TIMED OUT after $b s" ;; *) what="FAILED rc=$rc" ;;
    esac
fi
record attention "$what" $(( $(elapsed) - t0 ))

# (d) Bench: the tuned configs against the torch reference, a copy and Megatron-Core.
t0=$(elapsed)
b=$(phase_budget 600 10)
what="skipped (no time)"
if (( b > 15 )); then
    timeout -k 10 "$b" "$PY" -m dynctx autotune bench --max-seconds $(( b - 15 )) \
        ${KERNELS[@]+"${KERNELS[@]}"} --out "$OUT/results.json" >>"$LOG" 2>&1
    rc=$?
    case $rc in
        0) what="passed" ;; 124|137) what="TIMED OUT after $b s" ;; *) what="rc=$rc" ;;
    esac
fi
record bench "$what" $(( $(elapsed) - t0 ))
# (e) The table: printed by finish() on exit.
