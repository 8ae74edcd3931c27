cd /work/main
for i in 1 2 3; do
  PYTHONPATH=/tmp/base/src .venv/bin/python scripts/profile_host_rows.py --rounds 2 --graphs --json /tmp/hb/ab_before_$i.json > /dev/null 2>&1
  PYTHONPATH=src .venv/bin/python scripts/profile_host_rows.py --rounds 2 --graphs --json /tmp/hb/ab_after_$i.json > /dev/null 2>&1
done
echo finished > /tmp/hb/ab.done
