# lease 3, call 5: part 0; deterministic decode A/B (tree vs .base = 21d19dd, before the host-written layout) and the default; B=64 batched det vs default
mkdir -p /tmp/stage && cp .device-parts/0/part /tmp/stage/00
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt
for r in 1 2; do
  tt 120 def-r$r $BL -p 256,8192 -n 128 -r 3
  tt 90 det-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
  PYTHONPATH=/tmp/site:$PWD/.base/src tt 90 detbase-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
done
for r in 1 2 3; do
  tt 60 b64def-r$r $BL -p 128 -n 128 -r 2 --batch-size 64
  tt 60 b64det-r$r $BL -p 128 -n 128 -r 2 --batch-size 64 --deterministic
done
tail -c 1500 $OUT/err.txt
