#!/usr/bin/env bash
# One device call (600 s at most): where the time of the chunk pipeline and of the decode step goes, then
# the GPU suite, with a short table printed last. Results go under $OUT (the device tool's folder that
# comes back, at most 8 files): LAST_RUN.md, and every other log and JSON in one logs.tgz.
#
#   bash benchmarks/device_session.sh [all|suite|times]      # default all
#
# times: stage_times.py, decode_configs.py and stage_configs.py for the WY stages (~2 min), first;
# suite: tests/gpu with 6 workers (14 ran the GPU out of memory) and no `deltatron check` (5-6 min), with
# one line per test in gpu_suite.log, so that a cut-off run still names its failures.
# The benchmark against fla-core / FlashQLA needs its wheels and more than one call: BENCHMARKS.md.
set -u
OUT=${OUT:-/tmp/deltatron-device}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
what=${1:-all}
summary=()

if [[ $what == all || $what == times ]]; then
    for step in "stage_times:benchmarks/diagnostics/stage_times.py --configs b8-t2048-h16-k128 b1-t32768-h16-k128" \
                "decode_configs:benchmarks/diagnostics/decode_configs.py" \
                "stage_configs:benchmarks/diagnostics/stage_configs.py --stages wy_fwd WY"; do
        name=${step%%:*}
        timeout 150 python ${step#*:} --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
        summary+=("$name: exit $?")
    done
fi
if [[ $what == all || $what == suite ]]; then
    suite_limit=$([[ $what == suite ]] && echo 540 || echo 420)  # alone it may use the whole call
    timeout $suite_limit python tests/gpu/run_suite.py --out "$OUT" -n 6 --no-check --timeout=250 -p no:cacheprovider -v -v
    summary+=("suite: $(grep -m1 '^- pytest:' "$OUT/LAST_RUN.md" 2>/dev/null || echo 'no summary (timed out?)')")
fi

echo
echo "== device session ($what), $(date -u '+%Y-%m-%d %H:%M UTC'), logs in $OUT"
printf '%s\n' "${summary[@]}"
for f in stage_times decode_configs stage_configs; do
    [[ -f $OUT/$f.txt ]] && { echo "-- $f"; grep -E 'ms$|us$|us  |shipped' "$OUT/$f.txt" | head -24; }
done
[[ -f $OUT/gpu_suite.log ]] && { echo "-- suite failures"; grep -E '\] (FAILED|ERROR|XPASS) ' "$OUT/gpu_suite.log"; }
logs=$(cd "$OUT" && ls ./*.txt ./*.json ./*.log ./*.xml 2>/dev/null)
[[ -n $logs ]] && (cd "$OUT" && tar czf logs.tgz --remove-files $logs)
