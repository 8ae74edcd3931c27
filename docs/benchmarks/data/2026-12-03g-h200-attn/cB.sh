# call B: stage the bundled model's part 1. carry: .device-parts/1
mkdir -p /tmp/stage && cp .device-parts/1/part /tmp/stage/01 && ls -la /tmp/stage /tmp/gs | head -30; cat /tmp/gs/build.rc /tmp/gs/gguf.rc
