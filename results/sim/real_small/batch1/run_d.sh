#!/bin/bash
cd /work/main
while kill -0 $1 2>/dev/null; do sleep 2; done
R=.venv/bin/recover
common="--model small --replicas 4 --microbatches 8 --steps 80 --seed 0"
run() { name=$1; shift; echo "$(date +%T) start $name"; /usr/bin/time -f "$name %e s" $R train $common --out /tmp/val5/$name "$@" > /tmp/val5/$name.log 2>&1; echo "$(date +%T) end $name rc=$?"; }
p=d
run recover_plan_$p --system recover --faults /tmp/val5/plan_$p.json
run ckpt-restart_plan_$p --system ckpt-restart --checkpoint-every 20 --faults /tmp/val5/plan_$p.json
run elastic_plan_$p --system elastic --checkpoint-every 20 --faults /tmp/val5/plan_$p.json
run torchft_plan_$p --system torchft --faults /tmp/val5/plan_$p.json
run plain_3 --system plain
echo done
