#!/bin/bash
# usage: roof.sh TAG ROUNDS ; alternates before (main copy) and after (worktree)
tag=$1; n=$2
for r in $(seq 1 $n); do
  for side in before after; do
    dir=/work/wt/i17; [ $side = before ] && dir=/tmp/i17/base
    cd $dir
    f=/tmp/i17/out/${tag}_${side}${r}.txt
    { echo "# $side ($dir) round $r start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"; 
      OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m pytest -s -m bench benchmarks/test_bench_attention.py -k roofline 2>&1 | grep -v "^$";
      echo "# end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"; } > $f
  done
done
echo ALLDONE
