#!/bin/bash
# usage: monitor.sh OUTDIR SECONDS  -- samples every new ps??????-N namespace (created after start)
out=$1; secs=$2; mkdir -p $out
before=$(ip netns list | awk '{print $1}')
end=$(( $(date +%s) + secs ))
suffix=""
while [ $(date +%s) -lt $end ]; do
  if [ -z "$suffix" ]; then
    for ns in $(ip netns list | awk '{print $1}'); do
      echo "$before" | grep -qx "$ns" && continue
      [[ $ns =~ ^ps([0-9a-f]{6})-[0-9]+$ ]] && suffix=${BASH_REMATCH[1]}
    done
    sleep 0.2; continue
  fi
  t=$(date +%s.%N)
  for ns in $(ip netns list | awk '{print $1}' | grep "^ps$suffix-"); do
    i=${ns##*-}
    { echo "T $t"; tc -s class show dev psv$suffix-$i; } >> $out/down_$i.txt 2>/dev/null
    { echo "T $t"; ip netns exec $ns tc -s class show dev eth0; } >> $out/up_$i.txt 2>/dev/null
    { echo "T $t"; ip netns exec $ns ss -tin; } >> $out/ss_$i.txt 2>/dev/null
  done
  sleep 1
done
