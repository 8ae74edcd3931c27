# final call A: stage the model's first part; the fixed dp4a test; det (GLU now on by default) vs default, B=1 and B=64
mkdir -p /tmp/stage && cp .device-parts/0/part /tmp/stage/00
sed -i 's#\.whl/\*\.whl#.whl2/*.whl#' .device/common.sh
source .device/common.sh
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout 170 python3 -m pytest -p no:cacheprovider -o addopts= --tb=short -q tests/test_quant_cuda.py::test_dp4a_gemv_cuda > $OUT/dp4a_test.txt 2>&1; log "dp4a test rc=$? $(tail -1 $OUT/dp4a_test.txt)"
for r in 1 2; do
  tt 45 def-r$r $BL -p 256,8192 -n 128 -r 3
  tt 45 det-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
done
tt 40 b64-def $BL -p 128 -n 128 -r 1 --batch-size 64
tt 40 b64-det $BL -p 128 -n 128 -r 1 --batch-size 64 --deterministic
tail -c 1500 $OUT/err.txt
