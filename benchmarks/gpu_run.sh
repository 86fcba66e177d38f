#!/usr/bin/env bash
# Benchmarks on the GPU machine, by stage: benchmarks/gpu_run.sh STAGE [STAGE...]
# Logs and small result files go to $OUT (default ./gpu_out); data from $DATA.
#   tests   the gpu-marked tests
#   train1  bonsai iso 40, 448 views at 1024^2, one GPU, to PSNR 30 and SSIM 0.97
#   step    per-step time of a ~4M-Gaussian model at 2048^2 on 1 and 2 GPUs
#   train2  the same on 2 GPUs
#   adaptor Gray-Scott L=128 with the adaptor off / sync / background, 2 ranks on 2 GPUs
#   demo    `insitu demo` on one GPU (sized for it: L=128, six timesteps at 512^2)
#   ablate  train1 without opacity reset, and with SH bands every 300 iterations (to PSNR 30, 1 GPU)
#   gs128   Gray-Scott L=128 steps/s: no output, SST reader that only reads, full analysis attached
#   step8   as `step`, 8 views per step, bfloat16 colour transfer
#   big1/big2  ~4M Gaussians (surface-filled), 448 views at 2048^2, to PSNR 30, on 1 / 2 GPUs
#   kernels the Triton kernels: their gpu tests, SSIM and ray caster timings, one step vs bare gsplat
#   recipe  the plain gsplat recipe (bench_recipe.py) on train1's ground truth and initial Gaussians
#   protocol  the speed protocol, 1 and 2 GPUs: ground truth 448 x 2048^2, 18M seeds, step vs bare
#           rasterization, bonsai 1024^2 to PSNR 30 / SSIM 0.97 on 1 and 2 GPUs with 1 and with 2 views
#           per step (`protocol recipe const1
#           summary` is the whole protocol)
#   proto1/proto2  the protocol's `insitu run` at 1024^2 alone, on 1 / 2 GPUs
#   const1  the 1-GPU protocol run with constant initial colours (seeds.color_init=constant)
#   batch2/batch2x1  the protocol run with 2 views per step on 2 / 1 GPUs (3000 steps, evaluations every 250:
#           the same images as the 1-view run)
#   repl2   the 2-GPU protocol run with parallel.layout=replicated (each GPU the whole model, one view of its
#           own per step: the images of batch2)
#   loop    where an iteration's time goes at 1024^2, 1 GPU (benchmarks/bench_loop.py)
#   warm    warm against cold start, Gray-Scott L=128, 1 GPU (benchmarks/bench_warm_start.py)
#   summary benchmarks/speed_protocol.py: the figures of the stages above into benchmarks/results/speed_protocol.json
#   big100  the same `insitu run` (40 views at 2048^2, 30 iterations, SH 3) at 25M and 100M Gaussians on 2 and then
#           1 GPU: peak memory, s/iteration, PSNR, parallel model.ply, out-of-memory, projection (bench_big.py);
#           volume $BIG_DATA (default the bonsai), iso $BIG_ISO, runs $BIG_RUNS (P:BUDGET ...), more $BIG_ARGS
#   sweep   variants of the 1-GPU protocol run, two at a time on GPUs 0 and 1: SWEEP="NAME=ARGS|NAME=ARGS|..."
#   gt      the protocol's ground truth alone (448 x 2048^2 on 1 and 2 GPUs, with each rank's casting time)
#   stepprof one step of ~4M Gaussians at 2048^2 on 1 GPU against bare gsplat, then 10 steps under torch.profiler,
#           the SSIM loss alone and its kernels' tile sizes (bench_ssim.py --tune), Adam's block sizes (bench_adam.py),
#           SH colours + Adam against gsplat's SH + Adam, and the SH kernels' block sizes (bench_shading.py)
#   fidelity `insitu run` of the fidelity cases with the defaults (bonsai 1024^2 cold then warm, engine lit and sh,
#           bonsai 4M at 2048^2) and `insitu demo`: metrics.json files for benchmarks/fidelity_table.py;
#           FID_CASES="bonsai_cold bonsai bonsai_500k engine engine_sh bonsai4m demo" (the default) chooses among
#           them; bonsai_500k: the bonsai with 500k seeds instead of the package's 2M; demo_pkg: the GPU demo with
#           the package's squared error and 0.5-pixel floor instead of its own L1 and 1-pixel floor
#   anatomy where the bonsai's surface error lies, initial and trained (bench_anatomy.py; ANATOMY_ARGS: more flags)
#   compile the fidelity stage's bonsai run (the defaults) in a first process on the machine (an empty kernel cache),
#           then again (warm), then both with parallel.compile_ahead off: what compiles when, on which thread, how
#           long (bench_compile.py); then the ray caster's throughput against $OLD_CASTER (another triton_caster.py)
#   netemu  `step` on 2 GPUs over NVLink, then with NCCL kept off NVLink and shared memory (two nodes emulated)
#   fidab   the bonsai fidelity case (`insitu run`, the defaults) from several package trees, one process after the
#           other (the first cold): FID_AB="LABEL:DIR ..." (DIR holds an `insitu` package; "." this checkout);
#           $OUT/fidab_LABEL_N.json (N: the process's place in the order)
#   coldab  the same bonsai case from several package trees, each process made cold on a machine that ran others
#           (bench_compile.py --evict: the libraries' files dropped from the page cache, an empty kernel cache),
#           with its timeline of phases, waits and background threads: COLD_AB="LABEL:DIR ..." ("." this checkout),
#           COLD_ARGS: more flags for every process;
#           $OUT/coldab_LABEL_N.json (the timeline) and coldab_LABEL_N_metrics.json
#   plyfit  model.ply's SH fit and refinement by variant on one trained bonsai (bench_plyfit.py; PLYFIT: its
#           --variant flags)
set -u
OUT=${OUT:-gpu_out}; DATA=${DATA:-../shared/data}; mkdir -p "$OUT"; export OUT DATA
BONSAI=$DATA/bonsai_256x256x256_uint8.raw
ONE_VIEW="--batch 1"   # the stages measured before four views per step (runs 69-71) keep one view per step
MPIRUN="mpirun --allow-run-as-root --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"
TRAIN1="--iso 40 --views 448 --resolution 1024 --iterations 30000 $ONE_VIEW --psnr-target 30 --ssim-target 0.97 --budget 500000
        --set train.eval_every=1000 --set train.sh_degree=3 --quiet"
figures() {   # the composite's and the viewer's figures of a metrics.json
  python -c "import json, sys; m = json.load(open(sys.argv[1])); print({k: m.get(k) for k in
    ('psnr', 'ssim', 'ply_psnr', 'ply_ssim', 'psnr_foreground', 'psnr_white', 'iterations', 'train_seconds',
     'evaluation_seconds', 'initial_evaluation_seconds', 'total_seconds')})" "$1"
}
PROTO="--iso 40 --views 448 --resolution 1024 --iterations 6000 $ONE_VIEW --psnr-target 30 --ssim-target 0.97
       --budget 500000 --set train.eval_every=500 --set train.sh_degree=3 --quiet"
BATCH2="--batch 2 --iterations 3000 --set train.eval_every=250"   # 2 views per step: the same images
proto() {      # proto NAME P [ARGS...]: PROTO on P GPUs, metrics.json as $OUT/proto_NAME_metrics.json
  local name=$1 n=$2; shift 2
  rm -rf /tmp/$name; timeout 240 $MPIRUN -n $n python -m insitu run "$BONSAI" $PROTO "$@" --out /tmp/$name \
    > "$OUT/proto_$name.log" 2>&1; tail -n 2 "$OUT/proto_$name.log"
  cp /tmp/$name/step_000000/metrics.json "$OUT/proto_${name}_metrics.json"; figures "$OUT/proto_${name}_metrics.json"
}
for stage in "$@"; do
  echo "== $stage $(date -u +%FT%TZ)"
  case $stage in
    tests)  python -m pytest -q -m gpu tests/ -p no:cacheprovider > "$OUT/tests.log" 2>&1; tail -n 8 "$OUT/tests.log" ;;
    train1) CUDA_VISIBLE_DEVICES=0 timeout 540 python -m insitu run "$BONSAI" $TRAIN1 --out /tmp/train1 \
              > "$OUT/train1.log" 2>&1; tail -n 3 "$OUT/train1.log"
            cp /tmp/train1/step_000000/metrics.json "$OUT/train1_metrics.json"; figures "$OUT/train1_metrics.json"
            cp /tmp/train1/step_000000/views/view_008.png "$OUT/train1_view_008.png" ;;
    train2) timeout 540 $MPIRUN -n 2 python -m insitu run "$BONSAI" $TRAIN1 --out /tmp/train2 \
              > "$OUT/train2.log" 2>&1; tail -n 3 "$OUT/train2.log"
            cp /tmp/train2/step_000000/metrics.json "$OUT/train2_metrics.json"; figures "$OUT/train2_metrics.json" ;;
    step)   for args in "--batch 1" "--batch 4 --transfer bfloat16"; do for n in 1 2; do
              timeout 200 $MPIRUN -n $n python benchmarks/bench_step.py --data "$BONSAI" --iso 40 \
                --budget 4000000 --resolution 2048 --views 8 --steps 30 $args 2>&1 | tee -a "$OUT/step.log" | tail -n 1
            done; done ;;
    big1|big2) n=${stage#big}
            timeout ${BIG_TIMEOUT:-560} $MPIRUN -n $n python -m insitu run "$BONSAI" --iso 40 --views 448 --resolution 2048 \
              --budget 4000000 --set seeds.density=0 --set seeds.fill=true --iterations 30000 $ONE_VIEW --psnr-target 30 \
              --set train.eval_every=1000 --set train.sh_degree=3 --quiet --out /tmp/$stage > "$OUT/$stage.log" 2>&1
            tail -n 3 "$OUT/$stage.log"; cp /tmp/$stage/step_000000/metrics.json "$OUT/${stage}_metrics.json" ;;
    adaptor) timeout 240 $MPIRUN -n 2 python benchmarks/bench_adaptor.py --L 128 --steps 400 --plotgap 100 \
              --iterations 300 --device cuda > "$OUT/adaptor.log" 2>&1; tail -n 8 "$OUT/adaptor.log" ;;
    ablate) for v in "noreset:--set train.opacity_reset_every=0" "sh300:--set train.sh_increase_every=300"; do
              name=${v%%:*}; CUDA_VISIBLE_DEVICES=0 timeout 110 python -m insitu run "$BONSAI" --iso 40 --views 448 \
                --resolution 1024 --iterations 30000 $ONE_VIEW --psnr-target 30 --budget 500000 --set train.eval_every=1000 \
                --set train.sh_degree=3 --quiet ${v#*:} --out /tmp/$name > "$OUT/ablate_$name.log" 2>&1
              tail -n 2 "$OUT/ablate_$name.log"; cp /tmp/$name/step_000000/metrics.json "$OUT/ablate_${name}_metrics.json"
            done ;;
    gs128)  timeout 200 python benchmarks/bench_gray_scott.py --L 128 --steps 200 --plotgap 20 \
              --engines none SST > "$OUT/gs128.log" 2>&1; tail -n 4 "$OUT/gs128.log"
            timeout 200 python benchmarks/bench_gray_scott.py --L 128 --steps 200 --plotgap 20 \
              --engines SST+analysis --policy Discard > "$OUT/gs128_analysis.log" 2>&1
            tail -n 2 "$OUT/gs128_analysis.log" ;;
    stepprof) timeout 300 $MPIRUN -n 1 python benchmarks/bench_step.py --data "$BONSAI" --iso 40 --budget 4000000 \
              --resolution 2048 --views 8 --steps 30 --profile 10 > "$OUT/stepprof.json" 2> "$OUT/stepprof.log"
            python -c "import json, sys; d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print({k: d[k] for k in ('gaussians', 'step_ms_median', 'bare_raster_ms')}, d['profile']['wall_ms'], d['profile']['device_kernel_ms'])
[print(' ', t['ms'], t['calls'], t['name']) for t in d['profile']['top']]" "$OUT/stepprof.json"
            python benchmarks/bench_ssim.py --size 2048 --tune 2>&1 | tee "$OUT/stepprof_ssim.json" | tail -n 1
            python benchmarks/bench_adam.py --gaussians 4000000 2>&1 | tee "$OUT/stepprof_adam.json" | tail -n 1
            python benchmarks/bench_shading.py --gaussians 4000000 2>&1 | tee "$OUT/stepprof_shading.json" | tail -n 1 ;;
    step8)  for n in 1 2; do
              timeout 200 $MPIRUN -n $n python benchmarks/bench_step.py --data "$BONSAI" --iso 40 \
                --budget 4000000 --resolution 2048 --views 16 --steps 20 --batch 8 --transfer bfloat16 \
                2>&1 | tee -a "$OUT/step8.log" | tail -n 1
            done ;;
    big100) timeout ${BIG_TIMEOUT:-590} python benchmarks/bench_big.py --data "${BIG_DATA:-$BONSAI}" --iso "${BIG_ISO:-40}" \
              --runs ${BIG_RUNS:-2:25000000 2:100000000 1:25000000 1:100000000} --no-ply-on-one ${BIG_ARGS:-} --mpirun "$MPIRUN" \
              --out "$OUT/big100" > "$OUT/big100.log" 2>&1
            tail -n 60 "$OUT/big100.log" ;;
    netemu) for env in "NCCL_P2P_DISABLE=0 NCCL_SHM_DISABLE=0" "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"; do
              echo "environment: $env" | tee -a "$OUT/netemu.log"
              env $env NCCL_DEBUG=INFO timeout 200 $MPIRUN -x NCCL_P2P_DISABLE -x NCCL_SHM_DISABLE -x NCCL_DEBUG -n 2 \
                python benchmarks/bench_step.py --data "$BONSAI" --iso 40 --budget 4000000 --resolution 2048 \
                --views 8 --steps 30 > "$OUT/netemu_run.log" 2>&1
              grep -m 2 " via " "$OUT/netemu_run.log" | tee -a "$OUT/netemu.log"       # the transport NCCL chose
              grep '^{' "$OUT/netemu_run.log" | tail -n 1 | tee -a "$OUT/netemu.log"
            done ;;
    demo)   CUDA_VISIBLE_DEVICES=0 timeout 400 python -m insitu demo --out /tmp/demo --quiet > "$OUT/demo.log" 2>&1
            ls -l /tmp/demo/step_*/model.* >> "$OUT/demo.log"; cp /tmp/demo/metrics.csv "$OUT/demo_metrics.csv"
            tail -n 24 "$OUT/demo.log" ;;
    kernels) python -m pytest -q -m gpu tests/test_ssim.py tests/test_groundtruth.py tests/test_training.py \
              -p no:cacheprovider > "$OUT/kernels_tests.log" 2>&1; tail -n 3 "$OUT/kernels_tests.log"
            python benchmarks/bench_ssim.py --size 2048 2>&1 | tee "$OUT/kernels_ssim.json" | tail -n 1
            CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_groundtruth.py --data "$BONSAI" --views 448 \
              --resolution 2048 2>&1 | tee "$OUT/kernels_gt.log" | tail -n 1
            CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_groundtruth.py --data "$BONSAI" --views 4 \
              --resolution 2048 --backend torch 2>&1 | tee -a "$OUT/kernels_gt.log" | tail -n 1
            timeout 200 $MPIRUN -n 1 python benchmarks/bench_step.py --data "$BONSAI" --iso 40 --budget 4000000 \
              --resolution 2048 --views 8 --steps 30 2>&1 | tee "$OUT/kernels_step.log" | tail -n 1 ;;
    recipe) CUDA_VISIBLE_DEVICES=0 timeout 300 python benchmarks/bench_recipe.py --data "$BONSAI" --iso 40 \
              --resolution 1024 --views 448 --budget 500000 --iterations 6000 --eval-every 500 > "$OUT/proto_recipe.json" 2> "$OUT/recipe.log"
            tail -c 400 "$OUT/proto_recipe.json" ;;
    sweep)  # $SWEEP: "NAME=ARGS|NAME=ARGS|...", each the 1-GPU protocol run with ARGS; two at a time, on GPUs 0 and 1
            IFS='|' read -ra runs <<< "${SWEEP:?set SWEEP}"; i=0
            for v in "${runs[@]}"; do
              ( name=${v%%=*}; rm -rf /tmp/$name
                CUDA_VISIBLE_DEVICES=$((i % 2)) timeout 240 python -m insitu run "$BONSAI" $PROTO ${v#*=} --out /tmp/$name \
                  > "$OUT/sweep_$name.log" 2>&1
                cp /tmp/$name/step_000000/metrics.json "$OUT/sweep_${name}_metrics.json"
                echo "$name: $(figures "$OUT/sweep_${name}_metrics.json")" ) &
              i=$((i + 1)); (( i % 2 == 0 )) && wait
            done; wait ;;
    gt)     for n in 1 2; do
              timeout 120 $MPIRUN -n $n python benchmarks/bench_groundtruth.py --pipeline --data "$BONSAI" \
                --views 448 --resolution 2048 > "$OUT/proto_gt$n.json" 2> "$OUT/proto_gt$n.log"; cat "$OUT/proto_gt$n.json"
            done ;;
    protocol)
            for n in 1 2; do
              timeout 120 $MPIRUN -n $n python benchmarks/bench_groundtruth.py --pipeline --data "$BONSAI" \
                --views 448 --resolution 2048 > "$OUT/proto_gt$n.json" 2> "$OUT/proto_gt$n.log"; cat "$OUT/proto_gt$n.json"
            done
            CUDA_VISIBLE_DEVICES=0 timeout 120 python benchmarks/bench_seeds.py --data "$BONSAI" --iso 40 \
              --budget 18000000 > "$OUT/proto_seeds.json" 2> "$OUT/proto_seeds.log"; cat "$OUT/proto_seeds.json"
            timeout 200 $MPIRUN -n 1 python benchmarks/bench_step.py --data "$BONSAI" --iso 40 --budget 4000000 \
              --resolution 2048 --views 8 --steps 30 > "$OUT/proto_step1.json" 2> "$OUT/proto_step1.log"
            cat "$OUT/proto_step1.json"
            proto train1 1; proto train2 2; proto batch2x1 1 $BATCH2; proto batch2 2 $BATCH2 ;;
    proto1) proto train1 1 ;;
    proto2) proto train2 2 ;;
    const1) proto const1 1 --set seeds.color_init=constant ;;
    batch2) proto batch2 2 $BATCH2 ;;
    batch2x1) proto batch2x1 1 $BATCH2 ;;
    repl2)  proto repl2 2 --set parallel.layout=replicated --iterations 3000 --set train.eval_every=250 ;;
    loop)   CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/bench_loop.py --data "$BONSAI" > "$OUT/loop.json" \
              2> "$OUT/loop.log"; cat "$OUT/loop.json" ;;
    warm)   CUDA_VISIBLE_DEVICES=0 timeout 300 python benchmarks/bench_warm_start.py --L 128 --step 480 --gap 20 80 \
              --eval-every 100 --device cuda > "$OUT/warm.json" 2> "$OUT/warm.log"; cat "$OUT/warm.json" ;;
    summary) python benchmarks/speed_protocol.py --dir "$OUT" --out benchmarks/results/speed_protocol.json \
              > "$OUT/speed_protocol.json"; cat "$OUT/speed_protocol.json" ;;
    fidelity) # the fidelity cases, each an `insitu run` as a user runs it (defaults: the lit colour model, close-up
            # training views, held-out sets 2x / 3x closer and off the orbit); the first process is cold
            fid() {   # fid NAME SECONDS ARGS...: one `insitu run`, its metrics.json as $OUT/fid_NAME.json
              local name=$1 t=$2; shift 2; rm -rf /tmp/fid_$name
              CUDA_VISIBLE_DEVICES=0 timeout $t python -m insitu run "$@" --quiet --out /tmp/fid_$name \
                > "$OUT/fid_$name.log" 2>&1; tail -n 1 "$OUT/fid_$name.log"
              cp /tmp/fid_$name/step_000000/metrics.json "$OUT/fid_$name.json" 2>/dev/null
            }
            FID="--views 448 --resolution 1024"     # the package's seeds (2M), iterations and batch
            for case in ${FID_CASES:-bonsai_cold bonsai bonsai_500k engine engine_sh bonsai4m demo}; do case $case in
              bonsai_cold|bonsai) fid $case $([ $case = bonsai ] && echo 120 || echo 150) "$BONSAI" --iso 40 $FID ;;
              bonsai_500k) fid bonsai_500k 120 "$BONSAI" --iso 40 $FID --budget 500000 ;;
              engine) fid engine 120 "$DATA/engine_256x256x128_uint8.raw" --iso 90 $FID ;;
              engine_sh) fid engine_sh 120 "$DATA/engine_256x256x128_uint8.raw" --iso 90 $FID --budget 500000 --iterations 4000 $ONE_VIEW \
                --set train.color_model=sh --set views.closeups=0 --set seeds.density=0 ;;   # as before the lit model
              bonsai4m) fid bonsai4m 200 "$BONSAI" --iso 40 --views 448 --resolution 2048 \
                --budget 4000000 --set seeds.density=0 --set seeds.fill=true ;;
              demo) CUDA_VISIBLE_DEVICES=0 timeout 150 python -m insitu demo --out /tmp/fid_demo --quiet \
                  > "$OUT/fid_demo.log" 2>&1
                tail -n 8 "$OUT/fid_demo.log"; cp /tmp/fid_demo/metrics.csv "$OUT/fid_demo_metrics.csv" 2>/dev/null ;;
              demo_pkg) CUDA_VISIBLE_DEVICES=0 timeout 200 python -m insitu demo --out /tmp/fid_demo_pkg --quiet \
                  --set train.pixel_loss=l2 --set train.min_scale_px=0.5 > "$OUT/fid_demo_pkg.log" 2>&1   # the package's loss, floor
                tail -n 8 "$OUT/fid_demo_pkg.log"; cp /tmp/fid_demo_pkg/metrics.csv "$OUT/fid_demo_pkg_metrics.csv" 2>/dev/null ;;
            esac; done ;;
    fidab)  n=0
            bonsai=$(realpath "$BONSAI")
            for v in ${FID_AB:-base:.}; do
              label=${v%%:*}; tree=${v#*:}; n=$((n + 1)); rm -rf /tmp/fidab
              (cd "$tree" && CUDA_VISIBLE_DEVICES=0 timeout 150 python -m insitu run "$bonsai" --iso 40 \
                 --views 448 --resolution 1024 --quiet --out /tmp/fidab > "$OUT/fidab_${label}_$n.log" 2>&1)
              cp /tmp/fidab/step_000000/metrics.json "$OUT/fidab_${label}_$n.json" 2>/dev/null
              python -c "import json, sys; m = json.load(open(sys.argv[1])); print(sys.argv[2], {k: m.get(k) for k in
                ('total_seconds', 'seeds_seconds', 'ground_truth_seconds', 'train_seconds', 'ply_fit_seconds',
                 'initial_evaluation_seconds', 'evaluation_seconds', 'psnr_foreground', 'psnr')})" \
                "$OUT/fidab_${label}_$n.json" "$label $n" || tail -n 5 "$OUT/fidab_${label}_$n.log"
            done ;;
    coldab) n=0
            bonsai=$(realpath "$BONSAI")
            for v in ${COLD_AB:-base:.}; do
              label=${v%%:*}; tree=$(realpath "${v#*:}"); n=$((n + 1)); rm -rf /tmp/coldab /tmp/coldab_kc
              CUDA_VISIBLE_DEVICES=0 timeout 150 python benchmarks/bench_compile.py --evict --package "$tree" \
                --cache /tmp/coldab_kc --json "$OUT/coldab_${label}_$n.json" -- run "$bonsai" --iso 40 --views 448 \
                --resolution 1024 --quiet ${COLD_ARGS:-} --out /tmp/coldab > "$OUT/coldab_${label}_$n.log" 2>&1
              cp /tmp/coldab/step_000000/metrics.json "$OUT/coldab_${label}_${n}_metrics.json" 2>/dev/null
              python -c "import json, sys; c = json.load(open(sys.argv[1])); m = json.load(open(sys.argv[2]))
print(sys.argv[3], 'wall', c['wall_s'], 'evicted', c['evicted']['gb'], 'GB', {k: m.get(k) for k in
      ('total_seconds', 'seeds_seconds', 'ground_truth_seconds', 'train_seconds', 'ply_fit_seconds', 'psnr_foreground')})
for e in c['timeline']: print('  ', e)" "$OUT/coldab_${label}_$n.json" "$OUT/coldab_${label}_${n}_metrics.json" \
                "$label $n" || tail -n 5 "$OUT/coldab_${label}_$n.log"
            done ;;
    plyfit) CUDA_VISIBLE_DEVICES=0 timeout ${PLYFIT_TIMEOUT:-240} python benchmarks/bench_plyfit.py --data "$BONSAI" \
              ${PLYFIT:---variant default=} > "$OUT/plyfit.json" 2> "$OUT/plyfit.log"; tail -n 12 "$OUT/plyfit.log" ;;
    compile) # cold and warm processes of the same `insitu run`, with and without the kernels compiled ahead
            for v in cold:kc1: warm:kc1: cold_off:kc2:--set=parallel.compile_ahead=false \
                     warm_off:kc2:--set=parallel.compile_ahead=false; do
              IFS=: read -r name cache extra <<< "$v"; rm -rf /tmp/cmp_$name
              CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/bench_compile.py --cache /tmp/$cache \
                --json "$OUT/compile_$name.json" -- run "$BONSAI" --iso 40 --views 448 --resolution 1024 \
                --iterations 4000 $ONE_VIEW --budget 500000 ${extra/=/ } --quiet --out /tmp/cmp_$name > "$OUT/compile_$name.log" 2>&1
              cp /tmp/cmp_$name/step_000000/metrics.json "$OUT/compile_${name}_metrics.json" 2>/dev/null
              python -c "import json, sys; c = json.load(open(sys.argv[1])); m = json.load(open(sys.argv[2]))
print(sys.argv[3], 'wall', c['wall_s'], 'compiled', c['compiled'], 'loaded', c['loaded'], c['seconds_by_thread'],
      {k: m.get(k) for k in ('total_seconds', 'seeds_seconds', 'ground_truth_seconds', 'train_seconds',
                             'psnr_foreground', 'psnr')})" "$OUT/compile_$name.json" "$OUT/compile_${name}_metrics.json" $name
            done
            for caster in "" ${OLD_CASTER:-}; do
              CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_groundtruth.py --data "$BONSAI" --views 448 \
                --resolution 2048 ${caster:+--caster $caster} 2>&1 | tee -a "$OUT/compile_gt.log" | tail -n 1
            done ;;
    anatomy) # where the bonsai's surface error is, before and after training with the defaults (bench_anatomy.py)
            CUDA_VISIBLE_DEVICES=0 timeout ${ANATOMY_TIMEOUT:-150} python benchmarks/bench_anatomy.py --data "$BONSAI" \
              --iso 40 --resolution 1024 --iterations 4000 --set train.batch=1 ${ANATOMY_ARGS:-} --images "$OUT/anatomy" \
              --json "$OUT/anatomy.json" > "$OUT/anatomy.log" 2>&1; tail -c 600 "$OUT/anatomy.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
