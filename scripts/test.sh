#!/usr/bin/env bash
# The README's test command: prepares what the tests need on this machine, then runs them.
# - PostgreSQL on 127.0.0.1:5432 (installed from Debian's packages and started when missing;
#   the tests create a fresh database each through SUBAGENTS_TEST_POSTGRES);
# - redis-server on PATH (the Redis tests start their own servers on free ports);
# - Debian's Chromium and ChromeDriver (the dashboard's browser test);
# - the MCP reference servers and the official TypeScript SDK from the npm registry, pinned;
# - the anthropic and openai Python clients from PyPI, pinned, in a virtualenv under target/.
# Then `cargo test` with any arguments given: `scripts/test.sh --test it security::` runs one
# module. Installing needs root (as on CI); on a machine that already has it all, nothing is
# installed.
set -euo pipefail
cd "$(dirname "$0")/.."

start_postgres() {
    if pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then return; fi
    if ! ls -d /etc/postgresql/*/main >/dev/null 2>&1; then
        # A fresh machine without a server: install Debian's, and let local TCP connections in
        # without a password, as the tests connect (this machine only runs tests).
        echo "installing PostgreSQL"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null
        local hba
        hba="/etc/postgresql/$(ls /etc/postgresql | head -1)/main/pg_hba.conf"
        sed -i -E 's#^(host[[:space:]]+all[[:space:]]+all[[:space:]]+(127\.0\.0\.1/32|::1/128)[[:space:]]+)[^[:space:]]+#\1trust#' "$hba"
    fi
    echo "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
}

start_redis() {
    if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then return; fi
    if command -v redis-server >/dev/null; then
        echo "starting Redis"
        mkdir -p /var/lib/redis /var/log/redis
        redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
            --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
    fi
}

need() {
    command -v "$1" >/dev/null && return
    echo "installing $2 (provides $1)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2") >/dev/null
}

# The store conformance suite and the fleet tests use PostgreSQL (a fresh database per test,
# created through SUBAGENTS_TEST_POSTGRES); the Redis tests start their own redis-server
# processes on free ports, so only the binary is needed. SQLite needs nothing.
need redis-server redis-server
need pg_isready postgresql-client
start_postgres
start_redis
export SUBAGENTS_TEST_POSTGRES="${SUBAGENTS_TEST_POSTGRES:-postgres://postgres@127.0.0.1:5432/postgres}"
for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
pg_isready -h 127.0.0.1 -p 5432 -q || { echo "PostgreSQL is not reachable on 127.0.0.1:5432"; exit 1; }

# The dashboard's browser test drives Debian's Chromium through chromedriver.
need chromium chromium
need chromedriver chromium-driver

# MCP servers the tests call, the official TypeScript SDK whose client drives `subagents mcp`,
# and the Standard Webhooks library the webhook receiver verifies signatures with (from the npm
# registry, pinned); the tests install them themselves
# when this was skipped, as long as node and npm are there.
need node nodejs
need npm npm
export SUBAGENTS_TEST_MCP_DIR="${SUBAGENTS_TEST_MCP_DIR:-$PWD/target/mcp-servers}"
if [ ! -f "$SUBAGENTS_TEST_MCP_DIR/node_modules/@modelcontextprotocol/server-everything/dist/index.js" ] \
    || [ ! -f "$SUBAGENTS_TEST_MCP_DIR/node_modules/@modelcontextprotocol/server-filesystem/dist/index.js" ] \
    || [ ! -f "$SUBAGENTS_TEST_MCP_DIR/node_modules/@modelcontextprotocol/sdk/dist/esm/client/index.js" ] \
    || [ ! -f "$SUBAGENTS_TEST_MCP_DIR/node_modules/standardwebhooks/package.json" ]; then
    echo "installing the MCP reference servers into $SUBAGENTS_TEST_MCP_DIR"
    mkdir -p "$SUBAGENTS_TEST_MCP_DIR"
    npm install --no-audit --no-fund --prefix "$SUBAGENTS_TEST_MCP_DIR" \
        @modelcontextprotocol/server-everything@2026.8.31 @modelcontextprotocol/server-filesystem@2026.8.31 \
        @modelcontextprotocol/sdk@1.32.2 standardwebhooks@1.3.0 >/dev/null
fi

# The providers' official Python clients (pinned, as in tests/it/provider_clients.rs) drive the
# mock model, so its OpenAI and Anthropic wire formats are checked by the real parsers.
need python3 python3
python3 -c 'import ensurepip' 2>/dev/null || {
    echo "installing python3-venv"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv) >/dev/null
}
export SUBAGENTS_TEST_PYCLIENTS="${SUBAGENTS_TEST_PYCLIENTS:-$PWD/target/pyclients}"
if ! "$SUBAGENTS_TEST_PYCLIENTS/bin/python" -c 'import anthropic, openai' 2>/dev/null; then
    echo "installing the anthropic and openai Python clients into $SUBAGENTS_TEST_PYCLIENTS"
    python3 -m venv "$SUBAGENTS_TEST_PYCLIENTS"
    "$SUBAGENTS_TEST_PYCLIENTS/bin/pip" install --quiet --disable-pip-version-check \
        anthropic==0.75.0 openai==2.8.1
fi

# A failing test's own message is what CI shows at the end of its output: no backtrace after it
# (the message names the line).
export RUST_BACKTRACE="${RUST_BACKTRACE:-0}"
cargo test "$@"
