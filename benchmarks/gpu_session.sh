#!/usr/bin/env bash
# One stage of a lent-GPU session's checks, each within one device command (10 minutes), its
# output under $OUT (the device tool brings that folder back). Run from the repository root on
# the device machine, with the offline wheels carried in .whl/ (../shared/tools/offline-wheels.sh):
#
#   bash benchmarks/gpu_session.sh tests        # GPU tests and the mode contract       (~3 min)
#   bash benchmarks/gpu_session.sh validation   # gpu_validation: every mode, eager and
#                                               # compiled, trial/loop, forward cost     (~8 min)
#   bash benchmarks/gpu_session.sh timing       # trial_timing: trial vs loop, 200-step
#                                               # trials, eager / compiled / 50-step windows
#   bash benchmarks/gpu_session.sh reference    # gpu_reference_speed incl. --after-each-mode
#   bash benchmarks/gpu_session.sh lease        # all of a 15-minute lease in one command
#                                               # (~9.5 min): GPU tests, gpu_validation eager
#                                               # (100 steps) and compiled (2 modes), `check`
#                                               # with real FP8, bf16_kahan's optimizer
#                                               # step (kahan_step), a 1-minute `tune`
#   bash benchmarks/gpu_session.sh recheck      # after `lease` (~3 min): GPU tests, compiled
#                                               # bf16_sr (no recompile-limit warning), the
#                                               # recipe tune on amp_bf16 vs tf32
#   bash benchmarks/gpu_session.sh followup     # after `lease` (~4.5 min): bf16_kahan against
#                                               # amp_bf16 eager and compiled, the mode
#                                               # contract, a 3-minute 18-candidate tune (the
#                                               # second H200 session's runs, 2026-11-26)
#   bash benchmarks/gpu_session.sh fp8          # (~6 min) fp8_movement: FP8's weight movement
#                                               # per lr leg, real against emulated, beside
#                                               # fp32 rerun, tf32 and amp_bf16, in the tune's
#                                               # 86-step trials and in 300-step ones (the
#                                               # third H200 session's runs, 2026-11-27)
#   bash benchmarks/gpu_session.sh sr           # (~3 min) the stochastic-rounding optimizers'
#                                               # chunked step: its tests on the GPU, its
#                                               # step time (sr_8bit_step, 16 large and 96
#                                               # small tensors), bf16_sr against bf16_pure
#                                               # and amp_bf16 on the 59M GPT, eager
#   bash benchmarks/gpu_session.sh truth        # (~11.5 min: run it twice, the second goes on
#                                               # from the cache; first thing in the next lease)
#                                               # ground_truth_gpu: real FP8 on the 59M
#                                               # GPT, 2000-step runs against fp32's seeds, the
#                                               # gate at 86 and 300 steps; the long runs are
#                                               # copied to $OUT/ground_truth (carry them back
#                                               # in as runs/ground_truth on a fresh machine)
#
# Without $OUT (a CPU dry run) the logs go to runs/gpu_session/; $PYTHON picks the interpreter
# (default python3). The wheels are installed only where nvidia-smi exists. A stage that fails or
# runs out of its time leaves its log, and the script exits with its last command's status.
set -uo pipefail
stage=${1:?"usage: $0 tests|validation|timing|reference|lease|recheck|followup|fp8|sr|truth"}
case "$stage" in
  tests|validation|timing|reference|lease|recheck|followup|fp8|sr|truth) ;;
  *) echo "unknown stage '$stage': tests, validation, timing, reference, lease, recheck, followup, fp8, sr or truth" >&2
     exit 2 ;;
esac
out=${OUT:-runs/gpu_session}
mkdir -p "$out"
python=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null; then
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    # the wheels reach the device only when the run names .whl in carry (it is gitignored):
    # without them every stage fails later on a bare import error
    echo "no wheels in .whl/: run ../shared/tools/offline-wheels.sh here and carry .whl" >&2
    exit 3
  fi
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
  "$python" -c "import transformer_engine" 2>/dev/null \
    || echo "transformer_engine is not installed here: every fp8_te check is skipped, untested"
fi
export PYTHONUNBUFFERED=1
log="$out/$stage.txt"
case "$stage" in
  tests)
    timeout 560 "$python" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
      tests/test_mode_contract.py \
      "tests/test_optim.py::test_bf16_kahan_keeps_adams_second_moment_in_fp32_so_it_can_decrease" \
      "tests/test_optim.py::test_bf16_kahans_list_step_matches_torch_optimis_loop_to_the_bit" \
      tests/test_stochastic_optim.py tests/test_flat_chunks.py \
      2>&1 | tee "$log" ;;
  validation)
    timeout 560 "$python" -m benchmarks.gpu_validation --profile-out "$out/gpu-profile.json" \
      2>&1 | tee "$log" ;;
  timing)
    modes=fp32,tf32,amp_bf16,amp_fp16
    {
      timeout 180 "$python" -m benchmarks.trial_timing --modes "$modes" --rounds 3 --steps 200
      timeout 200 "$python" -m benchmarks.trial_timing --modes "$modes" --rounds 3 --steps 200 \
        --compile
      timeout 160 "$python" -m benchmarks.trial_timing --modes "$modes" --rounds 3 --steps 200 \
        --window-steps 50
    } 2>&1 | tee "$log" ;;
  lease)
    # each step bounded so the whole fits one 10-minute command; each step's log is kept
    tiny=(examples.tiny_gpt:make_model --data examples.tiny_gpt:make_batches --device cuda:0)
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      "$python" -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
      timeout 90 "$python" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
        "tests/test_optim.py::test_bf16_kahan_keeps_adams_second_moment_in_fp32_so_it_can_decrease" \
        "tests/test_optim.py::test_bf16_kahans_list_step_matches_torch_optimis_loop_to_the_bit"
      timeout 170 "$python" -m benchmarks.gpu_validation --steps 100 --eager-only --no-tune
      timeout 110 "$python" -m benchmarks.gpu_validation --steps 100 --compiled-only --no-tune \
        --modes amp_bf16,fp8_torchao
      timeout 90 "$python" -m autoprec check "${tiny[@]}" --steps 100 \
        --modes amp_bf16,amp_fp16,bf16_pure,bf16_sr,bf16_kahan,fp8_torchao
      timeout 40 "$python" -m benchmarks.kahan_step
      timeout 80 "$python" -m autoprec tune "${tiny[@]}" --budget 1 --out "$out/gpu-profile.json"
    } 2>&1 | tee "$log" ;;
  recheck)
    {
      timeout 60 "$python" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
      timeout 70 "$python" -m benchmarks.gpu_validation --steps 50 --compiled-only --no-tune \
        --modes bf16_sr
      timeout 110 "$python" -m benchmarks.gpu_validation --steps 100 --eager-only --budget 1.2 \
        --modes amp_bf16,tf32
    } 2>&1 | tee "$log" ;;
  followup)
    {
      timeout 120 "$python" -m benchmarks.gpu_validation --steps 100 --eager-only --no-tune \
        --modes fp32,amp_bf16,bf16_kahan,bf16_sr_kahan
      timeout 60 "$python" -m pytest -q -p no:cacheprovider -rs tests/test_mode_contract.py -x
      timeout 110 "$python" -m benchmarks.gpu_validation --steps 50 --compiled-only --no-tune \
        --modes tf32,amp_bf16,bf16_kahan
      timeout 230 "$python" -m benchmarks.gpu_validation --steps 30 --eager-only --budget 3 \
        --profile-out "$out/tune-profile.json"
    } 2>&1 | tee "$log" ;;
  fp8)
    {
      timeout 150 "$python" -m benchmarks.fp8_movement --steps 86
      timeout 400 "$python" -m benchmarks.fp8_movement --steps 300
    } 2>&1 | tee "$log" ;;
  sr)
    {
      timeout 90 "$python" -m pytest -q -p no:cacheprovider -rs tests/test_stochastic_optim.py \
        tests/test_flat_chunks.py
      timeout 60 "$python" -m benchmarks.sr_8bit_step
      timeout 60 "$python" -m benchmarks.sr_8bit_step --width 256 --layers 48
      timeout 120 "$python" -m benchmarks.gpu_validation --steps 100 --eager-only --no-tune \
        --modes fp32,amp_bf16,bf16_pure,bf16_sr,bf16_sr+8bit-optim
    } 2>&1 | tee "$log" ;;
  truth)
    timeout 560 "$python" -m benchmarks.ground_truth_gpu 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    cp -r runs/ground_truth "$out/ground_truth" 2>/dev/null
    exit "$status" ;;
  reference)
    timeout 560 "$python" -m benchmarks.gpu_reference_speed --after-each-mode 2>&1 | tee "$log" ;;
esac
