#!/usr/bin/env bash
# Side-by-side benchmark of two builds of subagents on one machine, alternating, so that the
# machine's drift (figures here swing ±30 % between minutes) falls on both alike.
#
#   scripts/bench-pair.sh [-n PAIRS] [-d postgres|sqlite] OLD_BIN NEW_BIN [bench args…]
#
# Each run gets a fresh database (PostgreSQL: `sa_bench` on 127.0.0.1, dropped and created;
# SQLite: a file in a new temporary directory), a freshly started mock model
# (`$MOCK_BIN mock-llm`, OLD_BIN unless MOCK_BIN is set; its own process, so its CPU is not
# ours), and a short warm-up. Around the
# bench it reads the whole machine's busy time (/proc/stat) and the mock's CPU, and the bench's
# own CPU from /usr/bin/time, and prints one line per run:
#   steps/s, our CPU per step inside the bench's window and for the whole process, the whole
#   machine's and the mock's CPU per step, ours and the machine's divided by the mock's, and
#   commit_ratio when --calibrate is given.
# The mock does the same work for every step of two builds that send the same requests, so
# "ours/mock" cancels most of the machine's drift: over five pairs whose steps/s swung ±20 %,
# it stayed within ±5 %. It compares builds only while their requests to the model are alike.
# With --calibrate the whole-process figure includes the calibration: compare the window's.
#
# Default bench args: --runs 2000 --steps 5 --concurrency 64 (PostgreSQL) or 32 (SQLite).
set -euo pipefail

pairs=3
db=postgres
while getopts "n:d:" opt; do
    case $opt in
        n) pairs=$OPTARG ;;
        d) db=$OPTARG ;;
        *) echo "usage: $0 [-n PAIRS] [-d postgres|sqlite] OLD_BIN NEW_BIN [bench args…]" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ $# -ge 2 ] || { echo "usage: $0 [-n PAIRS] [-d postgres|sqlite] OLD_BIN NEW_BIN [bench args…]" >&2; exit 2; }
old=$1 new=$2
shift 2
if [ $# -eq 0 ]; then
    if [ "$db" = postgres ]; then set -- --runs 2000 --steps 5 --concurrency 64; else set -- --runs 2000 --steps 5 --concurrency 32; fi
fi
port=18089
work=$(mktemp -d)
trap 'pkill -f "mock-llm --port $port" 2>/dev/null || true; rm -rf "$work"' EXIT

busy() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }

one() {
    local bin=$1; shift
    local dsn
    if [ "$db" = postgres ]; then
        psql -q -h 127.0.0.1 -U postgres -c "DROP DATABASE IF EXISTS sa_bench" postgres >/dev/null 2>&1
        psql -q -h 127.0.0.1 -U postgres -c "CREATE DATABASE sa_bench" postgres >/dev/null
        # The previous run's dirty pages written out now, not during this run: without it the
        # second run of every pair was the slower, whichever build it was.
        psql -q -h 127.0.0.1 -U postgres -c "CHECKPOINT" postgres >/dev/null
        dsn=postgres://postgres@127.0.0.1/sa_bench
    else
        rm -rf "$work/db" && mkdir -p "$work/db"
        dsn="sqlite://$work/db/bench.db"
    fi
    pkill -f "mock-llm --port $port" 2>/dev/null || true
    sleep 0.2
    "${MOCK_BIN:-$old}" mock-llm --port $port >/dev/null 2>&1 &
    local mock=$!
    sleep 0.5
    "$bin" bench --runs 2 --steps 2 --concurrency 2 --base-url "http://127.0.0.1:$port/v1" --dsn "$dsn" >/dev/null 2>&1
    local b0 m0 b1 m1
    b0=$(busy); m0=$(ticks $mock)
    /usr/bin/time -f "%U %S" -o "$work/time" "$bin" bench --base-url "http://127.0.0.1:$port/v1" --dsn "$dsn" "$@" >"$work/out.json"
    b1=$(busy); m1=$(ticks $mock)
    kill $mock
    python3 - "$bin" "$b0" "$b1" "$m0" "$m1" "$work/out.json" "$work/time" <<'PY'
import json, sys
bin_, b0, b1, m0, m1, out, tm = sys.argv[1], *map(float, sys.argv[2:6]), sys.argv[6], sys.argv[7]
j = json.load(open(out))
u, s = map(float, open(tm).read().split()[-2:])
n = j["steps"]
ratio = j.get("commit_ratio")
print(f"{bin_}: ok={j['ok']} steps/s {j['steps_per_s']:.0f}  ours(window) {j['cpu_ms_per_step']:.3f} ms"
      f"  ours(whole) {(u + s) * 1000 / n:.3f} ms  machine {(b1 - b0) * 10 / n:.3f} ms"
      f"  mock {(m1 - m0) * 10 / n:.3f} ms  ours/mock {(u + s) * 100 / max(m1 - m0, 1):.2f}"
      f"  machine/mock {(b1 - b0) / max(m1 - m0, 1):.2f}"
      + (f"  commits/s {j['commits_per_s']:.0f}  ratio {ratio:.3f}" if ratio else ""))
PY
}

for _ in $(seq 1 "$pairs"); do
    one "$old" "$@"
    one "$new" "$@"
done
