# call m10 as run (inline; the machine still warm from m9, /tmp/gs holding m9's llama.cpp build and GGUFs):
# llama-8b Q4_K_M on both engines, two rounds; m9's own rows.jsonl did not come back (more than 8 files under $OUT)
source .device/common.sh; export MONOBATCH_CUDA_PACKED=1; f=/tmp/gs/llama-8b-Q4_K_M.gguf; LB=/tmp/gs/build/bin; MB="python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 256,2048 -n 128 -r 3"; T=/tmp/gs/table.json
for r in 1 2; do tt 40 lb-r$r $LB/llama-bench -m $f -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl
MONOBATCH_PACKED_GEMV_CONFIGS=$T tt 60 table-r$r $MB
MONOBATCH_DECODE_SPLITS=8,2 MONOBATCH_PACKED_GEMV_CONFIGS=$T tt 60 splits8-r$r $MB
MONOBATCH_PACKED_GEMV_PAIR=1 MONOBATCH_PACKED_GEMV_CONFIGS=$T tt 60 pair-r$r $MB
tt 60 packaged-r$r $MB; done
tt 40 lbpp $LB/llama-bench -m $f -ngl 99 -fa on -p 2048 -n 0 -r 3 -o jsonl
cd $OUT && tar czf all.tgz --remove-files $(ls | grep -v all.tgz)
