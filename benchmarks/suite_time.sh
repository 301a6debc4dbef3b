#!/usr/bin/env bash
# The suite on a fresh clone, as CI runs it (.ci/run = make test, ../shared beside it): writes the JSON that
# benchmarks/readme_tables.py --suite puts into the README.
#   benchmarks/suite_time.sh [OUT_JSON]      (default bench_results/suite.json; takes ~5 min of install + the suite)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$repo/bench_results/suite.json}
work=$(mktemp -d)
git clone -q "$repo" "$work/main"
ln -s "$(cd "$repo/../shared" && pwd)" "$work/shared"
cd "$work/main"
make install >/dev/null
commit=$(git rev-parse --short HEAD)
log="$work/suite.log"
# the machine's speed around the suite (benchmarks/cpu_speed.py: median seconds of a fixed one-thread workload)
speed() { .venv/bin/python benchmarks/cpu_speed.py 2>/dev/null | .venv/bin/python -c "import json, sys; print(json.load(sys.stdin)['seconds'])" || echo null; }
speed_before=$(speed)
start=$(date +%s)
set +e
.ci/run >"$log" 2>&1
rc=$?
set -e
end=$(date +%s)
speed_after=$(speed)
last=$(grep -E "^[=]* ?[0-9]+ (passed|failed)" "$log" | tail -n 1)
passed=$(grep -oE "[0-9]+ passed" <<<"$last" | grep -oE "[0-9]+" || echo 0)
skipped=$(grep -oE "[0-9]+ skipped" <<<"$last" | grep -oE "[0-9]+" || echo 0)
failed=$(grep -oE "[0-9]+ failed" <<<"$last" | grep -oE "[0-9]+" || echo 0)
mkdir -p "$(dirname "$out")"
printf '{"passed": %s, "failed": %s, "skipped": %s, "seconds": %s, "commit": "%s", "date": "%s", "rc": %s, "cpu_speed_s": [%s, %s], "summary": "%s"}\n' \
    "$passed" "$failed" "$skipped" "$((end - start))" "$commit" "$(date +%F)" "$rc" "$speed_before" "$speed_after" \
    "$last" >"$out"
cat "$out"
cp "$log" "$(dirname "$out")/suite.log"
rm -rf "$work"
exit $rc
