#!/usr/bin/env bash
# Times workloads against the strongest PyTorch at real size, one process per workload and
# mode (a run cut short keeps what finished), 3 warm-ups and 10 samples as the committed
# tables use. The one-token phase runs last: a device-side assert there ends the process.
# Usage: bench/strongest.sh OUT_DIR SECONDS_PER_RUN WORKLOAD[:MODES[:SECONDS]] ...
# e.g. bench/strongest.sh out 280 smollm2:strict,accelerated:300 whisper:strict
set -uo pipefail
out=$1; limit=$2; shift 2
mkdir -p "$out"
for spec in "$@"; do
  IFS=: read -r w modes secs <<< "$spec"
  modes=${modes:-strict,accelerated}; secs=${secs:-$limit}
  for m in ${modes//,/ }; do
    echo "== $w $m $(date +%T)"
    timeout -s INT -k 30 "$secs" python3 -m meganeura.bench run --size real --workloads "$w" --modes "$m" \
      --phases inference,flb,train_step,minimal --warmup 3 --samples 10 --no-progress \
      --out "/tmp/strongest/$w-$m" 2>&1 | grep -v "^\s*$" | tail -40
    cp "/tmp/strongest/$w-$m/bench.json" "$out/$w-$m.json" 2>/dev/null || echo "$w $m: no result"
  done
done
