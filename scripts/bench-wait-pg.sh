#!/usr/bin/env bash
# The cross-process wait on PostgreSQL without Redis: `serve --workers 0` and one `worker`, each
# its own process, and 40 sequential `POST /v1/runs/wait` of 1-step runs against the mock model;
# prints p50, p90 and the slowest, in ms. What it measures is how the API process hears a run that
# the worker process ended (bench-latency measures the same with Redis).
#
#   scripts/bench-wait-pg.sh [BIN]      (default target/release/subagents; drops and creates sa_wait)
set -euo pipefail
bin=${1:-target/release/subagents}
psql -q -h 127.0.0.1 -U postgres -c "DROP DATABASE IF EXISTS sa_wait" postgres >/dev/null 2>&1
psql -q -h 127.0.0.1 -U postgres -c "CREATE DATABASE sa_wait" postgres >/dev/null
export DATABASE_URL=postgres://postgres@127.0.0.1/sa_wait OPENAI_BASE_URL=http://127.0.0.1:18097/v1
export OPENAI_API_KEY=x SUBAGENTS_MODEL=mock-model RUST_LOG=warn
unset REDIS_URL
"$bin" mock-llm --port 18097 >/dev/null 2>&1 & mock=$!
"$bin" serve --workers 0 --port 18096 >/dev/null 2>&1 & serve=$!
"$bin" worker >/dev/null 2>&1 & worker=$!
trap 'kill $worker $serve $mock 2>/dev/null; wait 2>/dev/null' EXIT
for _ in $(seq 1 100); do curl -sf http://127.0.0.1:18096/readyz >/dev/null && break; sleep 0.1; done
python3 - <<'PY'
import json, time, urllib.request
def one():
    req = urllib.request.Request("http://127.0.0.1:18096/v1/runs/wait",
        data=json.dumps({"input": "SCENARIO steps=1"}).encode(), headers={"content-type": "application/json"})
    t = time.perf_counter()
    r = json.load(urllib.request.urlopen(req))
    assert r["status"] == "succeeded", r
    return (time.perf_counter() - t) * 1000
for _ in range(3):
    one()
xs = sorted(one() for _ in range(40))
print(f"p50 {xs[20]:.1f} ms  p90 {xs[36]:.1f} ms  slowest {xs[-1]:.1f} ms")
PY
