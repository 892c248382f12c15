#!/usr/bin/env bash
# The browser test drives Debian's chromium (no browser download is possible here). Install it when
# missing and we can (root with apt-get); otherwise say so: the browser test then skips with its reason.
set -uo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing Debian's chromium for the browser test (once)"
  if apt-get install -y --no-install-recommends chromium >/tmp/eagle3-apt-chromium.log 2>&1 \
     || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends chromium >>/tmp/eagle3-apt-chromium.log 2>&1; }; then
    exit 0
  fi
  echo "   chromium could not be installed (see /tmp/eagle3-apt-chromium.log); the browser test will be skipped"
else
  echo "== chromium is not installed (apt-get install chromium); the browser test will be skipped"
fi
exit 0
