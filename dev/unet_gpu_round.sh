# The UNet's GPU round (run from the repository root on the GPU machine; logs and small results in $OUT): build, the
# layer tests, debug states (fp32 and PyTorch bf16 autocast) from dev/unet.py + test_unet, a short training run with
# samples, the convolution benchmark (bf16 beside tf32), and the step benchmark against PyTorch's best settings.
# About 10 minutes on an H100 (PyTorch's torch.compile warm-ups take most of it).
set -o pipefail
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
(make -j16 train_unet && make -C dev -j16 test_unet conv2d groupnorm attention linear resample elementwise timestep_embedding) > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
el build ok
for f in groupnorm attention linear resample elementwise timestep_embedding; do timeout 120 ./dev/$f --test > $OUT/${f}_test.log 2>&1; done
grep -hE "^FAIL|passed" $OUT/*_test.log | head -20
timeout 120 ./dev/conv2d 7 > $OUT/conv2d_7.log 2>&1; grep -E "^FAIL|passed|^version" $OUT/conv2d_7.log
python3 dev/unet.py --debug_state /tmp/full32.bin --batch_size 32 --zero_init 0 --n_steps 10 --data_file data/sunflowers64.bin --autocast_bf16 1 > $OUT/gen.log 2>&1
python3 dev/unet.py --debug_state /tmp/full7.bin --batch_size 7 --zero_init 0 --n_steps 10 --autocast_bf16 1 >> $OUT/gen.log 2>&1
el gen ok
timeout 120 ./dev/test_unet > $OUT/test_default.log 2>&1; grep -vE "^PASS" $OUT/test_default.log | tail -5
timeout 150 ./dev/test_unet /tmp/full32.bin /tmp/full7.bin > $OUT/test_full.log 2>&1; grep -vE "^PASS" $OUT/test_full.log | tail -12
el tests done
timeout 60 ./train_unet --steps 200 --log_every 50 --save_every 200 --output_dir /tmp/run > $OUT/train.log 2>&1; tail -4 $OUT/train.log
timeout 40 python3 scripts/generate.py --checkpoint /tmp/run/model.bin --out $OUT/samples_200.png --sampler ddim --steps 50 --device cuda 2>&1 | tail -1
el train+sample done
timeout $(( 590 - ($(date +%s) - T0) )) python3 dev/bench_unet.py --out $OUT/bench --modes best --batch_sizes 32,128 --precisions bf16 2>&1 | tail -12
el end
