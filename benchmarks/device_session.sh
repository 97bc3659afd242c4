#!/usr/bin/env bash
# One device call (600 s at most): the steps named, in order, with a short table printed last. Results go
# under $OUT (the device tool's folder that comes back, at most 8 files): LAST_RUN.md, and every other log
# and JSON in one logs.tgz.
#
#   bash benchmarks/device_session.sh [STEP ...]      # default: times suite
#
# times: stage_times.py, decode_configs.py, stage_configs.py for the WY stages and wy_breakdown.py (~3 min);
# caps: stage_configs.py with register caps (every stage at its shipped warps and stages under maxnreg
#       200/168/128, then the WY forward and backward, recompute W, U and dQ/dK/dW at 4 and 8 warps, 2 and 3
#       stages, under 168/128) and wy_breakdown.py's candidate WY forward launches (32-wide tiles) (~5 min);
# suite: tests/gpu (or SUITE_PATHS: a half per GPU, see tests/gpu/run_suite.py) with 6 workers (14 ran the GPU
#        out of memory) and no `deltatron check` (~7 min; past 470 s with another GPU busy, session 9), with
#        one line per test in gpu_suite.log, so that a cut-off run still names its failures; 540 s when
#        it is the only step, else 420;
# train: `deltatron check` (cut at 300 s: with an empty Triton cache it needs longer), then
#        `deltatron train` with each mixer at the GPU preset (~1 min), plus TRAIN_ARGS (extra settings,
#        e.g. "--num-kv 24") when set;
# bench: benchmarks/run.py with BENCH_ARGS (e.g. "--impls deltatron.chunk fla.chunk") and BENCH_BUDGET_S
#        (default 400); the competitors must be importable (BENCHMARKS.md). Before it, fla's autotuning results and
#        TileLang's compiled kernels are restored from benchmarks/device_cache (restore_caches), and afterwards
#        every autotuning result in the cache goes to $OUT/triton-autotune.tar.gz, to grow the committed one.
# Two GPUs (CUDA_VISIBLE_DEVICES, or a two-GPU machine): run one invocation per GPU, each with its own OUT.
set -u
OUT=${OUT:-/tmp/deltatron-device}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(times suite)
summary=()

restore_caches() {
    # Without these, fla autotunes for 80-110 s on each new shape and TileLang compiles FlashQLA for 1-2 minutes,
    # and that load on the shared CPUs slows the other GPU's host-bound rows (benchmarks/NOTES.md, session 14).
    # Valid for the versions they were made with (torch 2.11, triton 3.6, fla-core 0.6.0, TileLang 0.1.15, H200);
    # elsewhere the tools ignore them and tune or compile as usual.
    export TRITON_CACHE_AUTOTUNING=1
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
    export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
    mkdir -p "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR"
    tar xzf benchmarks/device_cache/triton-autotune.tar.gz --strip-components=1 -C "$TRITON_CACHE_DIR"
    tar xJf benchmarks/device_cache/tilelang.tar.xz --strip-components=1 -C "$TILELANG_CACHE_DIR"
}

save_autotuning() {  # every *.autotune.json of the cache, laid out as benchmarks/device_cache/triton-autotune.tar.gz
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/triton-autotune.tar.gz" \
        --transform 's,^\.,triton,' -T -)
}

run_step() {  # name, timeout, command...
    local name=$1 limit=$2
    shift 2
    PYTHONUNBUFFERED=1 timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1  # unbuffered: a cut-off step keeps its lines
    summary+=("$name: exit $?")
}

for step in "${steps[@]}"; do
    case $step in
    times)
        run_step stage_times 150 python benchmarks/diagnostics/stage_times.py \
            --configs b8-t2048-h16-k128 b1-t32768-h16-k128 --out "$OUT/stage_times.json"
        run_step decode_configs 150 python benchmarks/diagnostics/decode_configs.py --out "$OUT/decode_configs.json"
        run_step stage_configs 150 python benchmarks/diagnostics/stage_configs.py --stages wy_fwd WY \
            --out "$OUT/stage_configs.json"
        run_step wy_breakdown 60 python benchmarks/diagnostics/wy_breakdown.py --out "$OUT/wy_breakdown.json" ;;
    caps)
        run_step stage_caps 200 python benchmarks/diagnostics/stage_configs.py --warps shipped --num-stages shipped \
            --maxnreg 200 168 128 --out "$OUT/stage_caps.json"
        run_step stage_caps_sweep 220 python benchmarks/diagnostics/stage_configs.py --stages wy_fwd recompute \
            "WY backward" "dQ, dK" --warps 4 8 --num-stages 2 3 --maxnreg 168 128 --out "$OUT/stage_caps_sweep.json"
        run_step wy_launches 120 python benchmarks/diagnostics/wy_breakdown.py --configs b8-t2048-h16-k128 \
            --parts launches --out "$OUT/wy_launches.json" ;;
    suite)
        suite_limit=$([[ ${#steps[@]} -eq 1 ]] && echo 540 || echo 420)  # alone it may use the whole call
        # shellcheck disable=SC2086  # SUITE_PATHS is a list of test files (default: all of tests/gpu)
        timeout "$suite_limit" python tests/gpu/run_suite.py --out "$OUT" -n 6 --no-check --timeout=250 \
            -p no:cacheprovider -v -v ${SUITE_PATHS:+--paths $SUITE_PATHS}
        summary+=("suite: $(grep -m1 '^- pytest:' "$OUT/LAST_RUN.md" 2>/dev/null || echo 'no summary (timed out?)')") ;;
    train)
        run_step check 300 python -m deltatron check  # compiles every form and dtype (fp32: 30-80 s each)
        for mixer in delta linear; do
            # shellcheck disable=SC2086  # TRAIN_ARGS is a list of settings
            run_step "train_$mixer" 150 python -m deltatron train --mixer "$mixer" ${TRAIN_ARGS:-} \
                --out "$OUT/train_$mixer"
        done ;;
    bench)
        restore_caches
        # shellcheck disable=SC2086
        run_step bench $((${BENCH_BUDGET_S:-400} + 60)) python benchmarks/run.py --out "$OUT" --plot \
            --budget-s "${BENCH_BUDGET_S:-400}" ${BENCH_ARGS:-}
        save_autotuning ;;
    *) echo "unknown step: $step (times, caps, suite, train, bench)"; exit 2 ;;
    esac
done

echo
echo "== device session (${steps[*]}), $(date -u '+%Y-%m-%d %H:%M UTC'), GPU ${CUDA_VISIBLE_DEVICES:-all}, logs in $OUT"
printf '%s\n' "${summary[@]}"
for f in stage_times decode_configs stage_configs wy_breakdown stage_caps stage_caps_sweep wy_launches; do
    [[ -f $OUT/$f.txt ]] && { echo "-- $f"; grep -E 'ms$|us$|us  |shipped' "$OUT/$f.txt" | head -24; }
done
[[ -f $OUT/check.txt ]] && { echo "-- check"; tail -4 "$OUT/check.txt"; }
for mixer in delta linear; do
    [[ -f $OUT/train_$mixer.txt ]] && { echo "-- train $mixer"; tail -3 "$OUT/train_$mixer.txt"; }
done
[[ -f $OUT/bench.txt ]] && { echo "-- bench"; tail -30 "$OUT/bench.txt"; }
[[ -f $OUT/gpu_suite.log ]] && { echo "-- suite failures"; grep -E '\] (FAILED|ERROR|XPASS) ' "$OUT/gpu_suite.log"; }
logs=$(cd "$OUT" && ls -d ./*.txt ./*.json ./*.log ./*.xml ./train_* 2>/dev/null)
[[ -n $logs ]] && (cd "$OUT" && tar czf logs.tgz --remove-files $logs)
