#!/usr/bin/env bash
# Issue 20's device calls, for the `device` tool (run from the repository root on the device machine, $OUT set,
# `.whl` carried: fla's wheels). Each stage fits one call's 600 s:
#
#   JHYBRID_COMMIT=<hash> bash benchmarks/issue20_call.sh table
#       the whole table in one run (~270-360 s on an H100, 322 s on an H200)
#   JHYBRID_COMMIT=<hash> bash benchmarks/issue20_call.sh extra
#       head_dims' 180 cases (~100 s), then the tail mask A/B (~4 x 35 s)
#
# The issue asks for its table on an H200: on any other card a stage stops at once (exit 3), so that a call the
# tool places on an H100 costs its start and nothing more; `--any-card` after the stage runs it anyway. Outputs go
# to $OUT/r and come back as one file, $OUT/r.tgz (the tool returns a limited number of files).
set -uo pipefail
stage=${1:?usage: issue20_call.sh table|extra [--any-card]}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card; commit: ${JHYBRID_COMMIT:-unknown}"
if [[ "$card" != *H200* && "${2:-}" != --any-card ]]; then
    echo "not an H200: stopping (pass --any-card to run on it anyway)"
    exit 3
fi
mkdir -p "$OUT/r"
pack() { (cd "$OUT" && tar czf r.tgz r && rm -rf r); }
trap pack EXIT
case "$stage" in
    table)
        python3 -m pip install -q --no-index --no-deps --find-links .whl/ fla-core flash-linear-attention einops
        python3 -m benchmarks.floors --json "$OUT/r/floors.json" --num-scheduler-steps 8 --timeout 200 \
            --device-loop > "$OUT/r/floors.log" 2>&1
        if grep -q '^row ' "$OUT/r/floors.log"; then
            sed -n '/^row /,$p' "$OUT/r/floors.log"
        else
            tail -40 "$OUT/r/floors.log"
        fi
        ;;
    extra)
        timeout 240 python3 -m benchmarks.head_dims --json "$OUT/r/head_dims.json" > "$OUT/r/head_dims.log" 2>&1
        tail -3 "$OUT/r/head_dims.log"
        grep -w FAIL "$OUT/r/head_dims.log" | head -20
        for round in 1 2; do
            for v in 0 1; do
                log="$OUT/r/round${round}_tail_mask$v.log"
                JHYBRID_PAGED_DECODE_TAIL_MASK=$v timeout 80 python3 -m benchmarks.kernels --quick --only paged \
                    > "$log" 2>&1
                echo "round $round, tail mask $v: $(grep -m1 '^paged_decode' "$log" | awk '{print $9}') ms;" \
                    "$(grep -m1 -o 'KV read [^;]*' "$log")"
            done
        done
        ;;
    *)
        echo "unknown stage $stage: table or extra"
        exit 2
        ;;
esac
