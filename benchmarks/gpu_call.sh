#!/usr/bin/env bash
# One call of a GPU machine with a time limit (600 s): the steps named, in order, with a short summary printed
# last. Results go under $OUT (default ./out, relative to the checkout): each step's log and JSON, packed into
# logs.tgz at the end, beside the benchmark's results files.
#
#   bash benchmarks/gpu_call.sh [STEP ...]      # default: times suite
#
# times: tools/stage_times.py, each stage of the chunk forward and backward and the decode step timed apart
#        (~1 min);
# suite: the GPU tests (pytest's `gpu` marker) with 6 workers, one line per test in gpu_suite.log so that a
#        cut-off run still names its failures, and each failure's traceback in failures.txt as it happens
#        (tests/conftest.py, DELTATRON_FAILURE_LOG), and each passed test's id in passed.txt (DELTATRON_PASSED_LOG,
#        left out of logs.tgz); 540 s when it is the only step, else 420. SUITE_CMD replaces the command (default:
#        python -m pytest -m gpu -n 6 -p no:cacheprovider -v), SUITE_ARGS adds to it (e.g. a subset of test files),
#        SKIP_PASSED names earlier calls' passed.txt files (':' apart) whose tests are not run again (a suite longer
#        than one call, resumed);
# train: `deltatron check` (cut at 300 s: with an empty Triton cache it needs longer), then `deltatron train`
#        with each mixer at the GPU preset (~1 min), plus TRAIN_ARGS (extra settings, e.g. "--num-kv 24");
# bench: benchmarks/run.py with BENCH_ARGS (e.g. "--impls deltatron.chunk fla.chunk") and BENCH_BUDGET_S
#        (default 400), writing <gpu>.json/.md/.png under $OUT; the competitors must be importable
#        (BENCHMARKS.md, "How to reproduce"). Copy the results file into benchmarks/results and run --report.
# cp2:   context parallelism on two GPUs, the call's only step (~9 min; not run with fewer GPUs): the NCCL tests
#        (tests/test_context_parallel.py -k nccl, 170 s), the scaling benchmark under torchrun
#        (benchmarks/context_parallel.py: T = 131072 and 524288, forward and forward+backward, one GPU against two,
#        250 s; cp2_bench.json beside the logs), and the training example under torchrun
#        (examples/train_context_parallel.py --check, 100 s).
# Two GPUs (CUDA_VISIBLE_DEVICES, or a two-GPU machine): run one invocation per GPU, each with its own OUT (except
# cp2, which uses both).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(times suite)
summary=()

run_step() {  # name, timeout, command...
    local name=$1 limit=$2
    shift 2
    PYTHONUNBUFFERED=1 timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1  # unbuffered: a cut-off step keeps its lines
    summary+=("$name: exit $?")
}

for step in "${steps[@]}"; do
    case $step in
    times)
        run_step stage_times 150 python tools/stage_times.py \
            --configs b8-t2048-h16-k128 b1-t32768-h16-k128 decode-b64-h16-k128 --out "$OUT/stage_times.json" ;;
    suite)
        suite_limit=$([[ ${#steps[@]} -eq 1 ]] && echo 540 || echo 420)  # alone it may use the whole call
        # shellcheck disable=SC2086  # SUITE_CMD and SUITE_ARGS are lists of words
        DELTATRON_FAILURE_LOG="$OUT/failures.txt" DELTATRON_PASSED_LOG="$OUT/passed.txt" \
            DELTATRON_SKIP_PASSED="${SKIP_PASSED:-}" PYTHONUNBUFFERED=1 timeout "$suite_limit" \
            ${SUITE_CMD:-python -m pytest -m gpu -n 6 -p no:cacheprovider -v} ${SUITE_ARGS:-} \
            > "$OUT/gpu_suite.log" 2>&1
        summary+=("suite: exit $? ($(tail -1 "$OUT/gpu_suite.log"))") ;;
    train)
        run_step check 300 python -m deltatron check  # compiles every form and dtype (fp32: 30-80 s each)
        for mixer in delta linear; do
            # shellcheck disable=SC2086  # TRAIN_ARGS is a list of settings
            run_step "train_$mixer" 150 python -m deltatron train --mixer "$mixer" ${TRAIN_ARGS:-} \
                --out "$OUT/train_$mixer"
        done ;;
    bench)
        # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
        run_step bench $((${BENCH_BUDGET_S:-400} + 60)) python benchmarks/run.py --out "$OUT" --plot \
            --budget-s "${BENCH_BUDGET_S:-400}" ${BENCH_ARGS:-} ;;
    cp2)
        gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
        if [[ $gpus -lt 2 ]]; then
            summary+=("cp2: not run, it needs 2 GPUs (found $gpus)")
            continue
        fi
        DELTATRON_FAILURE_LOG="$OUT/failures.txt" run_step cp2_tests 170 python -m pytest -m gpu -n 6 \
            -p no:cacheprovider -v tests/test_context_parallel.py -k nccl
        run_step cp2_bench 250 python -m torch.distributed.run --standalone --nproc-per-node 2 \
            benchmarks/context_parallel.py --tokens 131072 524288 --out "$OUT/cp2_bench.json"
        run_step cp2_example 100 python -m torch.distributed.run --standalone --nproc-per-node 2 \
            examples/train_context_parallel.py --steps 400 --check ;;
    *) echo "unknown step: $step (times, suite, train, bench, cp2)"; exit 2 ;;
    esac
done

echo
echo "== GPU call (${steps[*]}), GPU ${CUDA_VISIBLE_DEVICES:-all}, logs in $OUT"
printf '%s\n' "${summary[@]}"
[[ -f $OUT/stage_times.txt ]] && { echo "-- stage_times"; grep -E 'ms$|us$' "$OUT/stage_times.txt" | head -40; }
[[ -f $OUT/check.txt ]] && { echo "-- check"; tail -4 "$OUT/check.txt"; }
for mixer in delta linear; do
    [[ -f $OUT/train_$mixer.txt ]] && { echo "-- train $mixer"; tail -3 "$OUT/train_$mixer.txt"; }
done
[[ -f $OUT/bench.txt ]] && { echo "-- bench"; tail -30 "$OUT/bench.txt"; }
[[ -f $OUT/cp2_tests.txt ]] && { echo "-- cp2 tests";
    grep -E '(PASSED|FAILED|ERROR|passed|failed)' "$OUT/cp2_tests.txt" | tail -12; }
[[ -f $OUT/cp2_example.txt ]] && { echo "-- cp2 example"; tail -3 "$OUT/cp2_example.txt"; }
[[ -f $OUT/cp2_bench.txt ]] && { echo "-- cp2 bench"; tail -8 "$OUT/cp2_bench.txt"; }
[[ -f $OUT/gpu_suite.log ]] && { echo "-- suite failures";
    grep -E '(FAILED|ERROR|XPASS)' "$OUT/gpu_suite.log" | head -40; }
[[ -f $OUT/passed.txt ]] && echo "-- suite: $(wc -l < "$OUT/passed.txt") tests passed (passed.txt)"
logs=$(cd "$OUT" && ls -d ./*.txt ./stage_times.json ./*.log ./train_* 2>/dev/null | grep -v '^./passed.txt$')
if [[ -n $logs ]]; then  # (the script's status is 0: the summary names each step's)
    (cd "$OUT" && tar czf logs.tgz --remove-files $logs)
fi
