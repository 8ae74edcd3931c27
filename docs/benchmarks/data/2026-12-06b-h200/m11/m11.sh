# call m11 as run (inline, same warm machine): the llama-1b files on both engines, then the CUDA tests m9 had no time for
source .device/common.sh; export MONOBATCH_CUDA_PACKED=1; END=330; LB=/tmp/gs/build/bin; ls /tmp/gs/*.gguf > $OUT/files.txt
for q in llama-1b-Q4_0 llama-1b-Q4_K_M; do f=/tmp/gs/$q.gguf; MB="python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 256 -n 128 -r 3"
tt 30 lb-$q $LB/llama-bench -m $f -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl
tt 40 packaged-$q $MB; MONOBATCH_DECODE_SPLITS=8,2 tt 40 splits8-$q $MB; done
for t in tests/test_quant_cuda.py::test_dp4a_pair_cuda tests/test_decode_graphs.py::test_attention_waits_for_a_slow_writer tests/test_decode_graphs.py::test_triton_kernel_on_cuda tests/test_kv_window.py::test_window_kernels_cuda; do
left=$((END - 10 - (SECONDS - T0))); ((left < 20)) && { log "SKIP $t"; continue; }
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout $left python3 -m pytest -p no:cacheprovider -o addopts= --tb=short -q $t >> $OUT/tests.txt 2>&1; log "test ${t##*::} rc=$? $(tail -1 $OUT/tests.txt)"; done
cd $OUT && tar czf all.tgz --remove-files $(ls | grep -v all.tgz)
