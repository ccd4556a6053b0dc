#!/usr/bin/env bash
# The committed GPU benchmark runs (2 x H200), in groups small enough for 10-minute commands.
#
#   benchmarks/gpu_suite.sh GROUP [OUT_DIR]        OUT_DIR defaults to benchmarks/results
#
# Rows go to the committed file of their setup in OUT_DIR (with --resume, rows already there are not
# run again); logs go to LOG_DIR (default: next to each file). Where only a few files come back from
# the machine that runs this, set LOG_DIR outside OUT_DIR.
#
# Every group runs with --resume and --time-limit (default 9 minutes, TIME_LIMIT_MIN): it starts no
# trial that may not end in time. Exit code 3 means the group is not finished: run the same command
# again and it carries on from the rows already in OUT_DIR. Exit code 0: the group is complete.
#
# Groups (each row in fresh processes; see benchmarks/README.md for times):
#   sc-8k-zero2 sc-8k-zero3 sc-16k-zero2 sc-16k-zero3
#                   stablecode-completion-alpha-3b, 8 layers, T=8192/16384, zero2/zero3, every backend
#   llama3-8b       Llama-3-8B, 4 layers, T=8192, zero2, every backend
#   maxT-inductor maxT-thunder maxT-memopt
#                   longest T that fits: stablecode, 32 layers, zero2 (doubling from 16384, 4096 for thunder,
#                   then narrowing to 1024)
#   reference-loss  the loss after the compiled model on fp32 logits (--loss-mode outside-fp32), every backend,
#                   stablecode 8 layers, T=8192, zero2: how the issue's reference points were measured
#   sc-8k-budgets   thunder+memopt at budgets 0.75, 0.5, 0.25 and 0.0, stablecode 8 layers, T=8192, zero2
#   memopt-budgets  optional: thunder+memopt at budgets 1.0, 0.5 and 0.0, stablecode 8 layers, T=16384, zero2
#   no-schedule     thunder+memopt without the schedule pass, stablecode 8 layers, T=8192, zero2
#   zero3-autocast  thunder and thunder+memopt, fp32 parameters under bf16 autocast, FSDP2 zero3, T=8192
#   thunder-fsdp    thunder and thunder+memopt under thunder.distributed.fsdp, ZERO2 and ZERO3, T=8192
#   single-h200     one GPU, thunder.jit, 4 layers, T=8192: thunder, thunder+memopt, and recompute only
#   sc32-per-token  one GPU, FSDP2 with one rank, stablecode 32 layers, zero2, in-graph loss, T=8192 and 16384
#                   in one invocation: memory per token of eager-ac, inductor, inductor-budget at 0.0 and
#                   thunder+memopt at 1.0 and 0.0, thunder+memopt-offload at 0.0 and 1.0 (issue 16's acceptance;
#                   several chunks of --time-limit)
#   sc32-per-token-offload1
#                   the same two lengths and model: inductor against thunder+memopt-offload at budget 1.0 (offload
#                   of what the plan finds hidden, the plan modeling the prefetch across Blocks; a file of its own,
#                   since --resume would take the rows of the plan before it; issue 16's budget-1.0 memory per token)
#   sc32-offload1-profile
#                   one GPU, FSDP2 with one rank, stablecode 32 layers, T=16384: thunder+memopt against
#                   thunder+memopt-offload, both at budget 1.0, with --profile: the copies' times (kernel class
#                   "host copies") against what the plan expected (the rows' offload_plans)
#   fit-sc32        one GPU, FSDP2 with one rank, stablecode 32 layers, zero2, in-graph loss, T=FIT_T (default
#                   8192) in one invocation: thunder+memopt at budgets 1.0, 0.5 and 0.0, thunder+memopt-offload at
#                   1.0 and 0.0, and thunder+memopt-fit at a memory limit of 40 GiB (issue 35's acceptance)
#   fit-cap         one GPU, each rank's allocator capped (--memory-cap: set_per_process_memory_fraction), so that
#                   a setting that needs more is an OOM row, as on a card of that size (issue 51's acceptance), one
#                   invocation per setup, each holding the fit row and the manual settings: thunder+memopt at
#                   budgets 1.0, 0.5 and 0.0, thunder+memopt-offload at 1.0 and 0.0, and thunder+memopt-fit with
#                   its limit at the cap; stablecode 32 layers, FSDP2 one rank, zero2, cap 40 GiB, at each T of
#                   FIT_CAP_T (default "16384 32768"); then SIMULATED rank 0 of 8, Llama-3-8B 32 layers, zero2,
#                   T=8192, cap 45 GiB, inductor too. Several chunks of --time-limit: rerun until it exits 0
#   fit-cap-expandable  the fit rows of fit-cap again, with the allocator's expandable segments
#                   (--allocator-settings expandable_segments:True), to measure what they change of the
#                   reserved memory; files *_cap40_expandable.jsonl and *_cap45_expandable.jsonl
#   sc32-long       one GPU, FSDP2 with one rank, stablecode 32 layers, T=131072: eager-ac against
#                   thunder+memopt-offload at budget 0.0, one warm-up and two measured steps each
#   llama3-8b-fused one GPU, FSDP2 with one rank, Llama-3-8B, 4 layers, T=8192, AdamW fused (--optimizer fused:
#                   no foreach temporary under every backend's peak): inductor, inductor-budget at 0.5,
#                   thunder+memopt at 1.0 and thunder+memopt-offload at 1.0, with an allocator snapshot per row
#                   in LOG_DIR (or OUT_DIR) to show where each peak is (issue 16's Llama criterion)
#   llama3-8b-offload-keep
#                   the same model and setup: inductor, thunder+memopt at 1.0 and thunder+memopt-offload at budget
#                   1.0 with offload budgets (--offload-keep) 0.5 and 0.25, which take the MLP fc outputs that do not
#                   hide, with an allocator snapshot per row (issue 16's Llama criterion with recompute at 1.0)
#   hf-llama3-8b-none
#                   one GPU, the whole model compiled (--distributed-mode none): transformers' LlamaForCausalLM at
#                   Llama-3-8B's width (--model-source transformers), 4 layers, T=8192: inductor and thunder+memopt
#                   in one invocation, losses within 1% (issue 34's acceptance)
#   hf-fsdp2        one GPU, FSDP2 with one rank, zero2, T=8192, 4 layers: transformers' Llama at Llama-3-8B's width
#                   and Qwen2 at Qwen2.5-7B's, inductor and thunder+memopt, one invocation per model (issue 34)
#   hf-models       one GPU, the whole model compiled, 4 layers, T=8192, one invocation per model: transformers'
#                   models at the widths of Llama-3-8B, Mistral-7B, Qwen2.5-7B, Qwen3-8B, Phi-3-mini, Gemma-2-2B,
#                   Granite-3-8B and OLMo-2-7B (HF_MODELS picks some), inductor and thunder+memopt (issue 50)
#   hf-models-fsdp2 the same for Qwen3-8B and Gemma-2-2B (HF_FSDP2_MODELS) under FSDP2 with one rank, zero2 (issue 50)
#   sim-validate-zero2 sim-validate-zero3
#                   SIMULATED (--simulate-world-size 2, one GPU): stablecode 8 layers, T=8192, the head in a unit of
#                   its own as in the 2 x H200 rows of 2026-11-29/30 (--head-unit own): eager, eager-ac, inductor,
#                   inductor-budget and thunder, to hold against those rows
#   sim-llama3-8b   SIMULATED rank 0 of 8: Llama-3-8B, 32 layers, T=8192, zero2, every backend
#   sim-llama3-8b-budgets
#                   SIMULATED rank 0 of 8: the same setup, inductor against thunder+memopt at budgets 1.0, 0.9
#                   and 0.75 in one invocation
#   sim-llama3-8b-head
#                   SIMULATED rank 0 of 8: the same setup, inductor against thunder+memopt at 1.0 with the loss
#                   head's gradients in the backward (--memopt-head-gradients backward), in one invocation
#   sim-llama3-8b-head-unit
#                   SIMULATED rank 0 of 8: as sim-llama3-8b-head, with the head and the loss an FSDP2 unit of
#                   their own (--head-unit loss), in one invocation
#   sim-llama3-8b-rungs
#                   SIMULATED rank 0 of 8: the same setup, inductor against thunder+memopt at budgets 0.99 and 0.95
#                   with the loss head's gradients in the forward (--memopt-head-gradients forward), in one invocation
#   sim-llama3-8b-fit
#                   SIMULATED rank 0 of 8: the same setup, inductor against thunder+memopt-fit at memory limits
#                   45.5 and 45 GiB (MemoryOptimization(memory_limit=...)), in one invocation
#   sim-sc32        SIMULATED rank 0 of 8: stablecode 32 layers, zero2, T=8192 and 16384 in one invocation,
#                   every backend
#   sim-sc32-maxT-inductor sim-sc32-maxT-memopt sim-sc32-maxT-offload sim-sc32-maxT-eager-ac
#                   SIMULATED rank 0 of 8: the longest T that fits, stablecode 32 layers, zero2
#   sim-llama3-70b  SIMULATED rank 0 of 64: Llama-3-70B, 80 layers, zero3, T=8192: eager-ac, inductor,
#                   thunder+memopt and thunder+memopt-offload at 1.0 and 0.0
#   pareto          one GPU, FSDP2 with one rank, stablecode 8 layers, T=8192, zero2, in one invocation: eager,
#                   eager-ac, inductor (budget 1.0, torch's default), inductor-budget at 0.75, 0.5, 0.25 and 0.0,
#                   thunder, thunder+fusion, thunder+memopt at 1.0, 0.75, 0.5, 0.25 and 0.0, and
#                   thunder+memopt-offload at 1.0 and 0.0: memory against step time (benchmarks/make_pareto.py)
#   long-run        one GPU, FSDP2 with one rank: 500 steps of stablecode 8 layers at T=4096 on real text, the
#                   gradients clipped to norm 1, deterministic algorithms, eleven settings with the perturbed-eager
#                   control (benchmarks/long_run.py: tail losses against eager's noise floor, offload against its
#                   unoffloaded twin bit for bit); rerun until it exits 0
#   litgpt-launcher one GPU: thunder's own benchmark_litgpt.py (from the installed Thunder), stablecode 32 layers,
#                   FSDP2 with one rank, zero2, --compile inductor against --compile dynamo_thunder under
#                   python -m thunder_memopt.launch, at T in LITGPT_T (default "8192 16384"; one T fits a 10-minute
#                   command); "Average iter time" and "Memory used" of each into
#                   OUT_DIR/benchmark_litgpt_stablecode_32l_zero2_<card>.md, logs beside it (issue 52)
#   tables          OUT_DIR/table.md, and a .md and a .png next to every .jsonl, generated from the rows
set -euo pipefail

GROUP=${1:?usage: benchmarks/gpu_suite.sh GROUP [OUT_DIR]}
OUT=${2:-benchmarks/results}
PYTHON=${PYTHON:-python}
TIME_LIMIT_MIN=${TIME_LIMIT_MIN:-9}
LOG_DIR=${LOG_DIR:-}
FIT_T=${FIT_T:-8192}  # the block size of group fit-sc32
FIT_CAP_T=${FIT_CAP_T:-16384 32768}  # the block sizes of group fit-cap's stablecode rows

cd "$(dirname "$0")/.."
mkdir -p "$OUT"
# Every backend, from the benchmark's registry (benchmarks/fsdp2/backends.py), in its order; the
# memory-limit backend only in the groups that name their limits.
ALL_BACKENDS=($("$PYTHON" -m benchmarks.fsdp2.backends | grep -vx 'thunder+memopt-fit'))

# The driver runs as plain python (it starts a fresh torchrun of N ranks per row), so that its
# exit code 3 reaches this script; under an outer torchrun it would read as a failed worker.
bench_ranks() {  # ranks, then the benchmark's options
    local ranks=$1
    shift
    "$PYTHON" benchmarks/benchmark_fsdp2.py --nproc-per-node "$ranks" --resume --time-limit "$TIME_LIMIT_MIN" \
        ${LOG_DIR:+--log-dir "$LOG_DIR"} "$@"
}

bench() { bench_ranks 2 "$@"; }

stablecode_8_layers() {  # block size, shard mode, setup name in the file (stablecode_8l_NAME_T...), more options
    local block_size=$1 shard_mode=$2 setup=$3
    shift 3
    bench --model-name stablecode-completion-alpha-3b --n-layer 8 --block-size "$block_size" \
        --shard-mode "$shard_mode" --out "$OUT/stablecode_8l_${setup}_T$block_size.jsonl" "$@"
}

longest_block_size() {  # backend, first block size: two that fit give the search its line to aim with
    bench --model-name stablecode-completion-alpha-3b --n-layer 32 --shard-mode zero2 --compile "$1" \
        --find-max-block-size --block-size "$2" --search-granularity 1024 --warmup 1 --iters 1 \
        --out "$OUT/stablecode_32l_zero2_max_block_size.jsonl"
}

simulated() {  # N, then the benchmark's options: one process plays rank 0 of N on GPU 0
    local ranks=$1
    shift
    CUDA_VISIBLE_DEVICES=0 "$PYTHON" benchmarks/benchmark_fsdp2.py --simulate-world-size "$ranks" --resume --plot none \
        --time-limit "$TIME_LIMIT_MIN" ${LOG_DIR:+--log-dir "$LOG_DIR"} "$@"
}

simulated_longest_block_size() {  # backend, first block size, more options
    local backend=$1 start=$2
    shift 2
    simulated 8 --model-name stablecode-completion-alpha-3b --n-layer 32 --shard-mode zero2 --compile "$backend" \
        --find-max-block-size --block-size "$start" --search-granularity 4096 --warmup 1 --iters 1 \
        --out "$OUT/stablecode_32l_zero2_sim8_max_block_size.jsonl" "$@"
}

# The card in the file names of the groups that run on whichever single GPU is lent (1xH100 or 1xH200).
gpu_tag() { echo "1x$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | grep -o 'H[0-9]00' | head -n 1)"; }

transformers_4_layers() {  # model name, its file name (hf_NAME_4l_SETUP_1xGPU_T8192), setup, more options
    local model=$1 name=$2 setup=$3
    shift 3
    CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-source transformers --model-name "$model" --n-layer 4 \
        --block-size 8192 --compile inductor thunder+memopt --loss-rtol 0.01 --batches 16 \
        --out "$OUT/hf_${name}_4l_${setup}_${GPU_TAG:-$(gpu_tag)}_T8192.jsonl" "$@"
}

# Released widths of issue 50's transformers rows, and their file names.
HF_MODELS=${HF_MODELS:-Llama-3-8B Mistral-7B-v0.3 Qwen2.5-7B Qwen3-8B Phi-3-mini-4k-instruct Gemma-2-2B Granite-3-8B OLMo-2-7B}
hf_file_name() { echo "$1" | tr 'A-Z' 'a-z' | sed -e 's/-instruct$//' -e 's/-4k$//' -e 's/[.-]/_/g'; }

tables() {
    local rows
    for rows in "$OUT"/*.jsonl; do
        "$PYTHON" benchmarks/make_table.py "$rows" --plot "${rows%.jsonl}.png" > "${rows%.jsonl}.md"
    done
    "$PYTHON" benchmarks/make_table.py "$OUT"/*.jsonl > "$OUT/table.md"
}

litgpt_launcher() {  # thunder's benchmark_litgpt.py unmodified, without and with the plugin, one table row each
    local script table log t compile iters=${LITGPT_ITERS:-30} warmup=${LITGPT_WARMUP:-15}
    script=$("$PYTHON" -c "import importlib.util as u; print(u.find_spec('thunder').submodule_search_locations[0])")/benchmarks/benchmark_litgpt.py
    table="$OUT/benchmark_litgpt_stablecode_32l_zero2_${GPU_TAG:-$(gpu_tag)}.md"
    [ -f "$table" ] || printf '| T | compile | Memory used GB | Average iter time ms | date | commit |\n|---|---|---|---|---|---|\n' > "$table"
    for t in ${LITGPT_T:-8192 16384}; do
        for compile in inductor dynamo_thunder; do
            log="${LOG_DIR:-$OUT}/benchmark_litgpt_T${t}_${compile}.log"
            local launcher=()
            [ "$compile" = dynamo_thunder ] && launcher=(-m thunder_memopt.launch)
            echo "== T=$t --compile $compile ${launcher[*]}"
            CUDA_VISIBLE_DEVICES=0 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 "${launcher[@]}" \
                "$script" --model_name stablecode-completion-alpha-3b --distributed_mode fsdp2 --shard_mode zero2 \
                --block_size "$t" --max_iters "$iters" --warmup_iters "$warmup" --compile "$compile" > "$log" 2>&1 \
                || echo "exit code $?" >> "$log"
            printf '| %s | %s | %s | %s | %s | %s |\n' "$t" "$compile${launcher:+ (thunder_memopt.launch)}" \
                "$(sed -n 's/^Memory used: \([0-9.]*\) GB/\1/p' "$log")" \
                "$(sed -n 's/^Average iter time: \([0-9.]*\) ms/\1/p' "$log")" "$(date -u +%Y-%m-%dT%H:%MZ)" \
                "$(git rev-parse --short HEAD)" >> "$table"
            tail -1 "$table"
        done
    done
}

case "$GROUP" in
    sc-8k-zero2) stablecode_8_layers 8192 zero2 zero2 --compile "${ALL_BACKENDS[@]}" ;;
    sc-8k-zero3) stablecode_8_layers 8192 zero3 zero3 --compile "${ALL_BACKENDS[@]}" ;;
    sc-16k-zero2) stablecode_8_layers 16384 zero2 zero2 --compile "${ALL_BACKENDS[@]}" ;;
    sc-16k-zero3) stablecode_8_layers 16384 zero3 zero3 --compile "${ALL_BACKENDS[@]}" ;;
    llama3-8b)
        bench --model-name Llama-3-8B --n-layer 4 --block-size 8192 --shard-mode zero2 \
            --compile "${ALL_BACKENDS[@]}" --out "$OUT/llama3_8b_4l_zero2_T8192.jsonl" ;;
    maxT-inductor) longest_block_size inductor 16384 ;;
    maxT-thunder) longest_block_size thunder 4096 ;;  # plain Thunder saves ~3x what inductor does: start low
    maxT-memopt) longest_block_size thunder+memopt 16384 ;;
    reference-loss) stablecode_8_layers 8192 zero2 zero2_loss_outside_fp32 --loss-mode outside-fp32 \
        --compile "${ALL_BACKENDS[@]}" ;;
    sc-8k-budgets)
        bench --model-name stablecode-completion-alpha-3b --n-layer 8 --block-size 8192 --shard-mode zero2 \
            --compile thunder+memopt --memopt-budget 0.75 0.5 0.25 0.0 \
            --out "$OUT/stablecode_8l_zero2_T8192_budgets.jsonl" ;;
    memopt-budgets) stablecode_8_layers 16384 zero2 zero2 --compile thunder+memopt --memopt-budget 1.0 0.5 0.0 ;;
    no-schedule) stablecode_8_layers 8192 zero2 zero2 --compile thunder+memopt --memopt-passes recompute collectives ;;
    zero3-autocast) stablecode_8_layers 8192 zero3 zero3_autocast --dtype fp32 --autocast --compile thunder thunder+memopt ;;
    thunder-fsdp)
        for mode in zero2 zero3; do
            stablecode_8_layers 8192 "$mode" "thunder_fsdp_$mode" --distributed-mode thunder-fsdp \
                --compile thunder thunder+memopt
        done ;;
    single-h200)
        for passes in "recompute collectives schedule" recompute; do
            # shellcheck disable=SC2086  # one argument per pass name
            CUDA_VISIBLE_DEVICES=0 "$PYTHON" benchmarks/benchmark_fsdp2.py --distributed-mode none --nproc-per-node 1 \
                --resume --time-limit "$TIME_LIMIT_MIN" ${LOG_DIR:+--log-dir "$LOG_DIR"} \
                --model-name stablecode-completion-alpha-3b --n-layer 4 \
                --block-size 8192 --compile thunder thunder+memopt --memopt-passes $passes \
                --out "$OUT/stablecode_4l_single_h200_T8192.jsonl"
        done ;;
    sc32-per-token)
        # One --compile list and both block sizes, so that every slope and ratio is between rows of one
        # invocation (tables.same_invocation: the same command line, within an hour). The budgets are
        # the registry's flags (python -m benchmarks.fsdp2.backends).
        CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name stablecode-completion-alpha-3b --n-layer 32 \
            --block-size 8192 16384 --shard-mode zero2 --loss-mode in-graph \
            --compile eager-ac inductor inductor-budget thunder+memopt thunder+memopt-offload \
            --inductor-budget 0.0 --memopt-budget 1.0 0.0 --offload-budget 0.0 1.0 \
            --out "$OUT/stablecode_32l_zero2_1xH200_per_token.jsonl" ;;
    sc32-per-token-offload1)
        CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name stablecode-completion-alpha-3b --n-layer 32 \
            --block-size 8192 16384 --shard-mode zero2 --loss-mode in-graph \
            --compile inductor thunder+memopt-offload --offload-budget 1.0 \
            --out "$OUT/stablecode_32l_zero2_1xH200_per_token_offload1_chained_plan.jsonl" ;;
    sc32-offload1-profile)
        CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name stablecode-completion-alpha-3b --n-layer 32 \
            --block-size 16384 --shard-mode zero2 --loss-mode in-graph --profile \
            --compile thunder+memopt thunder+memopt-offload --memopt-budget 1.0 --offload-budget 1.0 \
            --out "$OUT/stablecode_32l_zero2_1xH200_T16384_offload1_profile.jsonl" ;;
    fit-sc32)
        # One invocation, so that the limit's row and the budgets' compare (tables.same_invocation).
        CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name stablecode-completion-alpha-3b --n-layer 32 \
            --block-size "$FIT_T" --shard-mode zero2 --loss-mode in-graph \
            --compile thunder+memopt thunder+memopt-offload thunder+memopt-fit \
            --memopt-budget 1.0 0.5 0.0 --offload-budget 1.0 0.0 --memory-limit 40 \
            --out "$OUT/stablecode_32l_zero2_1xH200_T${FIT_T}_fit40.jsonl" ;;
    fit-cap)
        # The manual settings and the fit at the cap's limit: which run under the cap, and how fast.
        memopt=(thunder+memopt thunder+memopt-offload thunder+memopt-fit)
        budgets=(--memopt-budget 1.0 0.5 0.0 --offload-budget 1.0 0.0)
        for t in $FIT_CAP_T; do
            CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name stablecode-completion-alpha-3b --n-layer 32 \
                --block-size "$t" --shard-mode zero2 --loss-mode in-graph --compile "${memopt[@]}" "${budgets[@]}" \
                --memory-limit 40 --memory-cap 40 \
                --out "$OUT/stablecode_32l_zero2_${GPU_TAG:-$(gpu_tag)}_T${t}_cap40.jsonl"
        done
        simulated 8 --model-name Llama-3-8B --n-layer 32 --block-size 8192 --shard-mode zero2 \
            --compile inductor "${memopt[@]}" "${budgets[@]}" --memory-limit 45 --memory-cap 45 \
            --out "$OUT/llama3_8b_32l_zero2_sim8_${GPU_TAG:-$(gpu_tag)}_T8192_cap45.jsonl" ;;
    fit-cap-expandable)
        expandable=(--compile thunder+memopt-fit --allocator-settings expandable_segments:True)
        for t in $FIT_CAP_T; do
            CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name stablecode-completion-alpha-3b --n-layer 32 \
                --block-size "$t" --shard-mode zero2 --loss-mode in-graph "${expandable[@]}" \
                --memory-limit 40 --memory-cap 40 \
                --out "$OUT/stablecode_32l_zero2_${GPU_TAG:-$(gpu_tag)}_T${t}_cap40_expandable.jsonl"
        done
        simulated 8 --model-name Llama-3-8B --n-layer 32 --block-size 8192 --shard-mode zero2 "${expandable[@]}" \
            --memory-limit 45 --memory-cap 45 \
            --out "$OUT/llama3_8b_32l_zero2_sim8_${GPU_TAG:-$(gpu_tag)}_T8192_cap45_expandable.jsonl" ;;
    sc32-long)
        # One long run in one invocation: full checkpointing against the offload setting at T=131072.
        CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name stablecode-completion-alpha-3b --n-layer 32 \
            --block-size 131072 --shard-mode zero2 --loss-mode in-graph --warmup 1 --iters 2 \
            --compile eager-ac thunder+memopt-offload --offload-budget 0.0 \
            --out "$OUT/stablecode_32l_zero2_1xH200_T131072.jsonl" ;;
    llama3-8b-fused)
        CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name Llama-3-8B --n-layer 4 --block-size 8192 --shard-mode zero2 \
            --optimizer fused --compile inductor inductor-budget thunder+memopt thunder+memopt-offload \
            --memopt-budget 1.0 --offload-budget 1.0 --memory-snapshot "${LOG_DIR:-$OUT}/llama3_8b_fused_snapshots" \
            --out "$OUT/llama3_8b_4l_zero2_1xH200_T8192_fused_adamw.jsonl" ;;
    llama3-8b-offload-keep)
        CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name Llama-3-8B --n-layer 4 --block-size 8192 --shard-mode zero2 \
            --optimizer fused --compile inductor thunder+memopt thunder+memopt-offload \
            --memopt-budget 1.0 --offload-budget 1.0 --offload-keep 0.5 0.25 \
            --memory-snapshot "${LOG_DIR:-$OUT}/llama3_8b_offload_keep_snapshots" \
            --out "$OUT/llama3_8b_4l_zero2_1xH200_T8192_fused_adamw_offload_keep.jsonl" ;;
    hf-llama3-8b-none) transformers_4_layers Llama-3-8B llama3_8b none --distributed-mode none ;;
    hf-models)
        for model in $HF_MODELS; do
            transformers_4_layers "$model" "$(hf_file_name "$model")" none --distributed-mode none
        done ;;
    hf-models-fsdp2)
        for model in ${HF_FSDP2_MODELS:-Qwen3-8B Gemma-2-2B}; do
            transformers_4_layers "$model" "$(hf_file_name "$model")" zero2 --shard-mode zero2
        done ;;
    hf-fsdp2)
        transformers_4_layers Llama-3-8B llama3_8b zero2 --shard-mode zero2
        transformers_4_layers Qwen2.5-7B qwen2_5_7b zero2 --shard-mode zero2 ;;
    sim-validate-zero2|sim-validate-zero3)
        shard_mode=${GROUP#sim-validate-}
        simulated 2 --model-name stablecode-completion-alpha-3b --n-layer 8 --block-size 8192 --shard-mode "$shard_mode" \
            --head-unit own --compile eager eager-ac inductor inductor-budget thunder \
            --out "$OUT/stablecode_8l_${shard_mode}_sim2_T8192.jsonl" ;;
    sim-llama3-8b)
        simulated 8 --model-name Llama-3-8B --n-layer 32 --block-size 8192 --shard-mode zero2 \
            --compile inductor thunder+memopt eager eager-ac inductor-budget thunder thunder+memopt-offload \
            --out "$OUT/llama3_8b_32l_zero2_sim8_T8192.jsonl" ;;
    sim-llama3-8b-budgets)
        simulated 8 --model-name Llama-3-8B --n-layer 32 --block-size 8192 --shard-mode zero2 \
            --compile inductor thunder+memopt --memopt-budget 1.0 0.9 0.75 \
            --out "$OUT/llama3_8b_32l_zero2_sim8_T8192_budgets.jsonl" ;;
    sim-llama3-8b-head)
        simulated 8 --model-name Llama-3-8B --n-layer 32 --block-size 8192 --shard-mode zero2 \
            --compile inductor thunder+memopt --memopt-budget 1.0 --memopt-head-gradients backward \
            --out "$OUT/llama3_8b_32l_zero2_sim8_T8192_head_backward.jsonl" ;;
    sim-llama3-8b-head-unit)
        simulated 8 --model-name Llama-3-8B --n-layer 32 --block-size 8192 --shard-mode zero2 --head-unit loss \
            --compile inductor thunder+memopt --memopt-budget 1.0 --memopt-head-gradients backward \
            --out "$OUT/llama3_8b_32l_zero2_sim8_T8192_head_unit.jsonl" ;;
    sim-llama3-8b-rungs)
        simulated 8 --model-name Llama-3-8B --n-layer 32 --block-size 8192 --shard-mode zero2 \
            --compile inductor thunder+memopt --memopt-budget 0.99 0.95 --memopt-head-gradients forward \
            --out "$OUT/llama3_8b_32l_zero2_sim8_T8192_head_forward.jsonl" ;;
    sim-llama3-8b-fit)
        simulated 8 --model-name Llama-3-8B --n-layer 32 --block-size 8192 --shard-mode zero2 \
            --compile inductor thunder+memopt-fit --memory-limit 45.5 45 \
            --out "$OUT/llama3_8b_32l_zero2_sim8_T8192_fit.jsonl" ;;
    sim-sc32)
        simulated 8 --model-name stablecode-completion-alpha-3b --n-layer 32 --block-size 8192 16384 --shard-mode zero2 \
            --compile "${ALL_BACKENDS[@]}" --out "$OUT/stablecode_32l_zero2_sim8.jsonl" ;;
    sim-sc32-maxT-inductor) simulated_longest_block_size inductor 16384 ;;
    sim-sc32-maxT-memopt) simulated_longest_block_size thunder+memopt 32768 ;;
    sim-sc32-maxT-offload) simulated_longest_block_size thunder+memopt-offload 65536 ;;
    sim-sc32-maxT-eager-ac) simulated_longest_block_size eager-ac 65536 ;;
    sim-llama3-70b)
        simulated 64 --model-name Llama-3-70B --n-layer 80 --block-size 8192 --shard-mode zero3 \
            --compile eager-ac inductor thunder+memopt thunder+memopt-offload --memopt-budget 1.0 0.0 \
            --out "$OUT/llama3_70b_80l_zero3_sim64_T8192.jsonl" ;;
    pareto)
        CUDA_VISIBLE_DEVICES=0 bench_ranks 1 --model-name stablecode-completion-alpha-3b --n-layer 8 --block-size 8192 \
            --shard-mode zero2 --compile eager eager-ac inductor inductor-budget thunder thunder+fusion thunder+memopt \
            thunder+memopt-offload --inductor-budget 0.75 0.5 0.25 0.0 --memopt-budget 1.0 0.75 0.5 0.25 0.0 \
            --offload-budget 1.0 0.0 --out "$OUT/stablecode_8l_zero2_1xH200_T8192_pareto.jsonl" ;;
    tables) tables ;;
    litgpt-launcher) litgpt_launcher ;;
    long-run) CUDA_VISIBLE_DEVICES=0 "$PYTHON" benchmarks/long_run.py --max-grad-norm 1 --deterministic --resume \
        --time-limit "$TIME_LIMIT_MIN" ${LOG_DIR:+--log-dir "$LOG_DIR"} \
        --out "$OUT/stablecode_8l_${GPU_TAG:-$(gpu_tag)}_T4096_long_run_clip1.jsonl" ;;
    *) echo "unknown group '$GROUP'; the groups are listed at the top of $0" >&2; exit 2 ;;
esac
