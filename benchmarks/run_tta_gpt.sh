#!/usr/bin/env bash
# GPT time to accuracy on the emulated two-tier cluster (issue 23): the grid inside a
# wall-time budget, then every table, plot, the cost-model validation and the
# recommendation, spliced into docs/benchmarks/time-to-accuracy.md (the site's page).
#
#   benchmarks/run_tta_gpt.sh            # the headline run: an IDLE machine, <= 25 min
#   benchmarks/run_tta_gpt.sh --smoke    # the whole pipeline in a few minutes (any load);
#                                        # writes benchmarks/results/tta_gpt_smoke/ only
#
# Needs root (network namespaces, tc); without it the jobs run unshaped and say so.
# Settings (docs/benchmarks/time-to-accuracy.md says why these): override any
# of them from the environment, e.g. BUDGET_MIN=20 SEEDS=0,1 benchmarks/run_tta_gpt.sh;
# RESUME=1 runs the grid in pieces: each call keeps the jobs already done (OUT's
# tta_gpt_grid.json), runs what its own BUDGET_MIN holds, and renders everything so far
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
SIZE=${SIZE:-small}                # gpt.py's SMALL: 1.05 M parameters, context 64
EPOCHS=${EPOCHS:-5}                # 60 steps
STEPS_PER_EPOCH=${STEPS_PER_EPOCH:-12}
BATCH=${BATCH:-4}                  # windows per rank and step
LR=${LR:-3e-3}
EVAL_EVERY=${EVAL_EVERY:-12}
EVAL_WINDOWS=${EVAL_WINDOWS:-128}    # x context 64: 8 k bytes
SHAPES=${SHAPES:-2x2,4x1}
RATES=${RATES:-1000,100}
EXTRA_RATES=${EXTRA_RATES-10000}   # seed 0, only if the budget still allows
SEEDS=${SEEDS:-0,1,2}
BUDGET_MIN=${BUDGET_MIN:-15}       # one locked piece; RESUME=1 for the next
MARGIN=${MARGIN:-1.05}             # a job starts if used + longest job x this fits
# the relaxations, the synchronous reference (it sets the target) and torch DDP; left
# out for time on 2 cores (the page: gradient_allreduce_hier, torch_ddp_powersgd, the control)
ALGORITHMS=${ALGORITHMS:-gradient_allreduce,bytegrad,local_sgd,async_model_average,diloco,streaming_diloco,powersgd,torch_ddp_gloo}
DELAY_MS=${DELAY_MS:-0.5}           # one way (netem, or the TUN delay line without it)
PIN=${PIN:-auto}                   # one core per rank where the machine has one (2x1)
TIMEOUT=${TIMEOUT:-900}            # one job (every contender of one shape, rate and seed), s
OUT=${OUT:-benchmarks/results}
README=${README-docs/benchmarks/time-to-accuracy.md}
MARKER=${MARKER:-tta-gpt}          # the page's section: tta-gpt-2x1, tta-gpt-wide
LOCK=${LOCK-/tmp/commlib-bench.lock}  # one benchmark at a time; LOCK= when the caller holds it

if [[ "${1:-}" == "--smoke" ]]; then
    SIZE=tiny EPOCHS=2 STEPS_PER_EPOCH=6 EVAL_EVERY=4 SEEDS=0,1 RATES=1000 EXTRA_RATES= \
        BATCH=8 EVAL_WINDOWS=256
    BUDGET_MIN=${SMOKE_BUDGET_MIN:-12}
    OUT=benchmarks/results/tta_gpt_smoke README=$OUT/README_smoke.md
    mkdir -p "$OUT"
    printf '# smoke\n<!-- tta-gpt:begin -->\n<!-- tta-gpt:end -->\n' > "$README"
fi

export COMMLIB_TIMEOUT=${COMMLIB_TIMEOUT:-300}
exec ${LOCK:+flock "$LOCK"} "$PYTHON" benchmarks/bench_time_to_accuracy_grid.py \
    --budget-min "$BUDGET_MIN" --margin "$MARGIN" --shapes "$SHAPES" --rates "$RATES" \
    --extra-rates "$EXTRA_RATES" --seeds "$SEEDS" --out "$OUT" ${README:+--readme "$README" --marker "$MARKER"} \
    ${RESUME:+--resume} \
    -- --gpt-size "$SIZE" --epochs "$EPOCHS" --gpt-steps-per-epoch "$STEPS_PER_EPOCH" \
    --batch "$BATCH" --gpt-lr "$LR" --eval-every "$EVAL_EVERY" --gpt-eval-windows "$EVAL_WINDOWS" --algorithms "$ALGORITHMS" \
    --delay-ms "$DELAY_MS" --pin "$PIN" --timeout "$TIMEOUT"
