#!/bin/bash
# usage: spy.sh out variant steps delay dur
cd /work/main
python bench/bench_tier_push.py --steps $3 --variants $2 --out /tmp/h44d/spyrun > /dev/null 2>&1 &
P=$!
sleep $4
py-spy record --gil -r 1000 --format raw -d $5 -o $1 --pid $P >/dev/null 2>&1
wait $P
