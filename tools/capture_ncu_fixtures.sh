#!/usr/bin/env bash
# Capture small real Nsight Compute reports of this project's PKDA kernels as test fixtures
# (tests/test_ncu.py reads them from fixtures/ncu/). Run on the H200 from the repository root:
#
#     bash tools/capture_ncu_fixtures.sh            # device tool: carry [".whl"], timeout 600
#
# Profiles ONE measured fwd+bwd iteration (NVTX range harness.measure, as harness/ncu.py does) of
# kernels.pkda:chunk_precond_kda at B=1,T=256,H=2,K=V=64 bf16, both passes, filtered to a few small
# backward kernels (-k, -c) so each report stays well under 2 MB. Writes to $OUT (flat):
#   pkda-small-full.ncu-rep  pkda-small-source.ncu-rep   the fixtures to commit under fixtures/ncu/
#   ncu-capture-extras.tgz: *.raw.csv (ncu --import --csv --page raw: every metric name the report
#   holds), *.parse.txt, *.log, env.txt (the device tool returns at most 8 files)
# Knobs (env): PY, NCU, OP, KREGEX, COUNT, T_WARM, T_PASS, SHAPE (the job's shape as JSON, e.g.
# '{"name": "B4_T2048_H16_D128", "B": 4, "T": 2048, "H": 16, "K": 128, "V": 128}' for a look at one
# stage's kernels at a registered row rather than fixtures), PASSES (default "full source": the
# full pass always runs; "full" leaves the source-counters pass out).
set -x
set -u
OUT=${OUT:-$PWD/ncu-fixtures-out}
mkdir -p "$OUT"
PY=${PY:-$( [ -x /opt/torch/.venv/bin/python ] && echo /opt/torch/.venv/bin/python || command -v python3 )}
NCU=${NCU:-$(command -v ncu || ls -1 /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)}
OP=${OP:-kernels.pkda:chunk_precond_kda}
KREGEX=${KREGEX:-pkda_bwd_(dAv|intra|beta)}
COUNT=${COUNT:-3}
T_WARM=${T_WARM:-300}
T_PASS=${T_PASS:-120}
SHAPE=${SHAPE:-'{"name": "small", "B": 1, "T": 256, "H": 2, "K": 64, "V": 64}'}
PASSES=${PASSES:-full source}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export TRITON_CACHE_DIR=$WORK/triton   # shared by the warm run and both passes: ncu never waits on compiles

# Packages the image lacks (pydantic, gitpython, nvtx) travel as wheels in .whl/.
if ! "$PY" -c "import pydantic, git, nvtx, yaml" 2>/dev/null; then
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --target "$WORK/deps" .whl/*.whl
fi
export PYTHONPATH=$PWD:$WORK/deps${PYTHONPATH:+:$PYTHONPATH}

{ date -u; hostname; nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv
  "$NCU" --version; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20; } > "$OUT/env.txt" 2>&1

cat > "$WORK/job.json" <<EOF
{"worktree": "$PWD", "op": "$OP",
 "inputs_file": "$PWD/experiments/inputs/pkda.py", "inputs_fn": "make_inputs",
 "shape": $SHAPE, "mode": "fwdbwd",
 "dtype": "bfloat16", "seed": 0, "warmup": 3, "result_path": "$OUT/target.json"}
EOF
cp "$WORK/job.json" "$OUT/job.json"

# 1. warm (compile + autotune) without ncu; also proves the op runs at all
timeout "$T_WARM" "$PY" -m harness.ncu_target "$WORK/job.json" > "$OUT/warm.log" 2>&1 || { echo "warm run failed"; tail -30 "$OUT/warm.log"; exit 1; }

# 2. the two passes of harness/ncu.py (clocks never touched; only the measured iteration)
COMMON=(--clock-control none --cache-control all --target-processes all
        --nvtx --nvtx-include "harness.measure/" -k "regex:$KREGEX" -c "$COUNT")
timeout "$T_PASS" "$NCU" "${COMMON[@]}" --set full --section PmSampling --section PmSampling_WarpStates \
  --metrics sm__inst_executed_pipe_tensor_op_hmma.sum,sm__inst_executed_pipe_tensor_op_gmma.sum \
  -f -o "$OUT/pkda-small-full" "$PY" -m harness.ncu_target "$WORK/job.json" > "$OUT/pkda-small-full.log" 2>&1
echo "full pass rc=$?"
if [[ " $PASSES " == *" source "* ]]; then
  timeout "$T_PASS" "$NCU" "${COMMON[@]}" --section SourceCounters \
    -f -o "$OUT/pkda-small-source" "$PY" -m harness.ncu_target "$WORK/job.json" > "$OUT/pkda-small-source.log" 2>&1
  echo "source pass rc=$?"
fi

# 3. what the reports hold: raw metrics as CSV (metric names for the table), and the harness's own reading
for p in $PASSES; do
  f=$OUT/pkda-small-$p.ncu-rep
  [ -f "$f" ] || { echo "MISSING $f"; tail -20 "$OUT/pkda-small-$p.log"; continue; }
  timeout 60 "$NCU" --import "$f" --csv --page raw --print-units base > "$OUT/pkda-small-$p.raw.csv" 2>&1
  timeout 60 "$PY" -m harness ncu --parse "$f" > "$OUT/pkda-small-$p.parse.txt" 2>&1 || true
done
# the device tool returns at most 8 files: keep the two reports, pack everything else into one
# (the archive is written outside $OUT first: tar reading a directory it is writing into exits 1,
# which on the H200 left every extra file in place and the two reports over the 8-file limit)
(cd "$OUT" && tar czf "$WORK/extras.tgz" --exclude='*.ncu-rep' . ; \
  find . -maxdepth 1 -type f ! -name '*.ncu-rep' -delete; mv "$WORK/extras.tgz" ncu-capture-extras.tgz)
ls -la "$OUT"
