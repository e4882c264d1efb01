#!/usr/bin/env bash
# The LangGraph peer comparison: steps/s of the same subagent runs (5 steps, the `echo` tool,
# every step committed to PostgreSQL) as a LangGraph graph with PostgreSQL's checkpointer
# (scripts/langgraph_peer.py) and as `subagents bench`, on one mock model, one database
# server, one machine, one after the other. Prints both JSON lines and the ratio.
#
#   scripts/bench-langgraph.sh [SUBAGENTS_BIN] [-- RUNS STEPS CONCURRENCY]
#
# Defaults: target/release/subagents; 500 runs for the peer and 2,000 for subagents (the peer
# is slower: each takes tens of seconds), 5 steps, concurrency 64. The pinned Python packages
# go into a virtualenv under target/ (PyPI only).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/subagents}
runs=500 steps=5 conc=64
if [ "${2:-}" = "--" ]; then runs=${3:-$runs} steps=${4:-$steps} conc=${5:-$conc}; fi
venv=target/langgraph-venv
if ! "$venv/bin/python" -c "import langgraph, langgraph.checkpoint.postgres, langchain_openai" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "langgraph==1.2.24" "langgraph-checkpoint-postgres==3.2.0" \
        "langchain-openai==1.8.1" "psycopg[binary,pool]==3.3.9"
fi
port=18090
trap 'pkill -f "mock-llm --port $port" 2>/dev/null || true' EXIT
"$bin" mock-llm --port $port >/dev/null 2>&1 &
sleep 0.5
fresh() {
    psql -q -h 127.0.0.1 -U postgres -c "DROP DATABASE IF EXISTS $1" postgres >/dev/null 2>&1
    psql -q -h 127.0.0.1 -U postgres -c "CREATE DATABASE $1" -c "CHECKPOINT" postgres >/dev/null
}
fresh sa_lgpeer
peer=$("$venv/bin/python" scripts/langgraph_peer.py --base-url "http://127.0.0.1:$port/v1" \
    --dsn postgres://postgres@127.0.0.1/sa_lgpeer --runs "$runs" --steps "$steps" --concurrency "$conc")
echo "$peer"
# The peer's database goes before ours runs: left in place, its autovacuum and the checkpoint
# of its writes ran during our bench (seen as a third fewer steps/s, varying run to run).
psql -q -h 127.0.0.1 -U postgres -c "DROP DATABASE IF EXISTS sa_lgpeer" postgres >/dev/null
fresh sa_bench
sleep 2
ours=$("$bin" bench --base-url "http://127.0.0.1:$port/v1" --dsn postgres://postgres@127.0.0.1/sa_bench \
    --runs $((runs * 4)) --steps "$steps" --concurrency "$conc")
echo "$ours"
python3 - "$peer" "$ours" <<'PY'
import json, sys
peer, ours = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert peer["answered"] == peer["runs"], "the peer's runs did not all answer"
assert ours["ok"], "subagents' runs did not all succeed"
print(f"subagents {ours['steps_per_s']:.0f} steps/s, LangGraph {peer['steps_per_s']:.0f} steps/s: "
      f"{ours['steps_per_s'] / peer['steps_per_s']:.1f}x")
PY
