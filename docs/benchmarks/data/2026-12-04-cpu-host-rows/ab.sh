# before = src/ of a016379, after = src/ of da775e7 (each a `git archive <commit> src` copy)
cd /work/main
for i in 1 2 3; do
  PYTHONPATH=/tmp/hbase/src .venv/bin/python scripts/profile_host_rows.py -b 32,128 --rounds 2 --graphs --json /tmp/hb/ab_before_$i.json > /tmp/hb/ab_before_$i.txt 2>&1
  PYTHONPATH=/tmp/hnew/src .venv/bin/python scripts/profile_host_rows.py -b 32,128 --rounds 2 --graphs --json /tmp/hb/ab_after_$i.json > /tmp/hb/ab_after_$i.txt 2>&1
done
echo finished > /tmp/hb/ab.done
