# The UNet helper's GPU round (run from the repository root on the GPU machine; logs and small results in $OUT):
# build, kernel tests, debug states from dev/unet.py + test_unet, per-layer profile, a short training run with
# samples, and the benchmark against PyTorch. Keeps under ~400 s on an H100.
set -o pipefail
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
(make -j4 train_unet && make -C dev -j4 test_unet conv2d groupnorm attention linear resample elementwise timestep_embedding) > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
el build ok
for f in conv2d groupnorm attention linear resample elementwise timestep_embedding; do timeout 60 ./dev/$f --test > $OUT/${f}_test.log 2>&1; done
grep -hE "FAIL|passed" $OUT/*_test.log | head -20
timeout 90 ./dev/conv2d 6 2>&1 | grep -vE "^PASS" > $OUT/conv2d_bench.log; grep -B30 "^version 5 (same" $OUT/conv2d_bench.log
python3 dev/unet.py --debug_state /tmp/full32.bin --batch_size 32 --zero_init 0 --n_steps 10 --data_file data/sunflowers64.bin > $OUT/gen.log 2>&1
python3 dev/unet.py --debug_state /tmp/full7.bin --batch_size 7 --zero_init 1 --n_steps 10 >> $OUT/gen.log 2>&1
el gen ok
timeout 60 ./dev/test_unet > $OUT/test_default.log 2>&1; grep -vE "^PASS" $OUT/test_default.log | tail -5
timeout 90 ./dev/test_unet /tmp/full32.bin /tmp/full7.bin > $OUT/test_full.log 2>&1; grep -vE "^PASS" $OUT/test_full.log | tail -12
grep -E "PASS full32.bin (out|loss|step)" $OUT/test_full.log | cut -c1-150
el tests done
UNET_PROFILE=1 timeout 60 ./train_unet --steps 20 --log_every 10 --save_every 0 --output_dir /tmp/prof > $OUT/profile.log 2>&1; grep -A12 "per-step" $OUT/profile.log
timeout 60 ./train_unet --steps 200 --log_every 50 --save_every 200 --output_dir /tmp/run > $OUT/train.log 2>&1; tail -6 $OUT/train.log; cp /tmp/run/log.csv $OUT/train_log.csv
timeout 40 python3 scripts/generate.py --checkpoint /tmp/run/model.bin --out $OUT/samples_200.png --sampler ddim --steps 50 --device gpu 2>&1 | tail -3
el train+sample done
timeout $(( 395 - ($(date +%s) - T0) )) python3 dev/bench_unet.py --out $OUT/bench --conv_versions 5,6 --modes eager,eager,reduce-overhead,compile 2>&1 | tail -14
el end
