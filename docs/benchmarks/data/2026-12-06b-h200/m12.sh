# call 12: the decode attention's partitions past the length exiting before the PDL wait (new) against HEAD's kernel
# (head: .device/paged_decode_head.py swapped into src/ in place, so the CPU kernels' cache path is the same),
# random packed weights (profile_decode), and the attention's CUDA tests on the new kernel
source .device/common.sh
cp src/monobatch/kernels/paged_decode.py /tmp/paged_decode_new.py
use() { if [ $1 = head ]; then cp .device/paged_decode_head.py src/monobatch/kernels/paged_decode.py; else cp /tmp/paged_decode_new.py src/monobatch/kernels/paged_decode.py; fi; }
P="python3 scripts/profile_decode.py --no-profile -n 64 --shape llama-8b --quant Q4_K"
P1="python3 scripts/profile_decode.py --no-profile -n 64 --shape llama-1b --quant Q4_0"
use new; tt 70 prof8b-new-r1 $P; use head; tt 30 prof8b-head-r1 $P; use new
for t in tests/test_pdl_ptx.py tests/test_decode_graphs.py::test_a_kernel_after_the_attention_sees_what_the_kernel_before_it_wrote tests/test_decode_graphs.py::test_attention_waits_for_a_slow_writer tests/test_decode_graphs.py::test_triton_kernel_on_cuda tests/test_kv_window.py::test_window_kernels_cuda; do
  left=$((END - 10 - (SECONDS - T0))); ((left < 20)) && { log "SKIP $t"; continue; }
  PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout $left python3 -m pytest -p no:cacheprovider -o addopts= --tb=short -q $t >> $OUT/tests.txt 2>&1; log "test ${t##*::} rc=$? $(tail -1 $OUT/tests.txt)"; done
for a in new head; do use $a; tt 25 prof1b-$a-r1 $P1; done
for a in new head; do use $a; tt 25 prof8b-$a-r2 $P; done
for a in head new; do use $a; tt 25 prof1b-$a-r2 $P1; done
for a in new head; do use $a; tt 25 prof8b2k-$a $P -p 2048; done
use new; cd $OUT && tar czf all.tgz --remove-files $(ls | grep -v all.tgz)
