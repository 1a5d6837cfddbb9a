#!/usr/bin/env bash
# Installs the headless browser tests/test_playground.py drives (Debian's chromium), plus the
# fonts it needs to render text in screenshots. Idempotent: exits at once when already there.
# Without it the playground test skips; nothing else needs a browser.
set -euo pipefail

have_browser() {
    local b
    for b in "${SHOAL_CHROMIUM:-}" chromium chromium-browser google-chrome-stable google-chrome; do
        [ -n "$b" ] && command -v "$b" >/dev/null 2>&1 && return 0
    done
    return 1
}

if have_browser && fc-list 2>/dev/null | grep -q .; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-browser: need root or sudo" >&2; exit 1; }
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# chromium: the browser (headless mode is built in); fonts-dejavu-core: text in screenshots.
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
have_browser || { echo "install-browser: chromium still not found after install" >&2; exit 1; }
echo "install-browser: $(chromium --version 2>/dev/null || true)"
