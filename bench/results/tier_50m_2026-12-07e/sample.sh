#!/bin/bash
# every 2 s: time, nr_dirty, nr_writeback (pages), pgmajfault, pgpgout, pgfault, load1
while true; do
  awk -v t=$(date +%s) '/^nr_dirty |^nr_writeback |^pgmajfault |^pgpgout |^pgfault /{a[$1]=$2} END{printf "%s dirty=%d wb=%d majflt=%d pgpgout=%d pgfault=%d ", t, a["nr_dirty"], a["nr_writeback"], a["pgmajfault"], a["pgpgout"], a["pgfault"]}' /proc/vmstat
  cut -d' ' -f1 /proc/loadavg
  sleep 2
done
