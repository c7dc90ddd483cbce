#!/usr/bin/env bash
# Prometheus and its Pushgateway for the metrics tests (tests/run/test_metrics*.py): Debian's packages
# (`prometheus`, `prometheus-pushgateway`), installed with apt-get when missing. The tests start their own servers
# on 127.0.0.1 and stop them after, so the packages' system services are stopped and disabled here (a CI machine
# needs no Prometheus listening on :9090). Idempotent: when both binaries are there it prints one line and returns.
# Needs apt-get and root (or passwordless sudo); elsewhere it says so and exits 1. The tests find the binaries on
# PATH, or at $DSPINE_PROMETHEUS / $DSPINE_PUSHGATEWAY.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if have prometheus && have prometheus-pushgateway; then
  echo "[prometheus] already installed ($(prometheus --version 2>&1 | head -1 | cut -d' ' -f1-3); pushgateway $(prometheus-pushgateway --version 2>&1 | head -1 | cut -d' ' -f3))"
  exit 0
fi
have apt-get || { echo "[prometheus] apt-get not found: install Prometheus and its Pushgateway yourself (or skip the metrics tests)" >&2; exit 1; }
SUDO=()
if [ "$(id -u)" != 0 ]; then
  have sudo && sudo -n true 2>/dev/null || { echo "[prometheus] not root and no passwordless sudo: apt-get install prometheus prometheus-pushgateway yourself" >&2; exit 1; }
  SUDO=(sudo -n)
fi
echo "[prometheus] installing Debian's prometheus and prometheus-pushgateway (~100 MB) ..."
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq >/dev/null || true
# policy-rc.d: the packages' post-install scripts must not start their services (no init system in a container;
# a system Prometheus on :9090 on a CI machine)
pol=/usr/sbin/policy-rc.d
made=0
if [ ! -e "$pol" ]; then printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$pol" >/dev/null; "${SUDO[@]}" chmod +x "$pol"; made=1; fi
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends prometheus prometheus-pushgateway >/dev/null
[ "$made" = 1 ] && "${SUDO[@]}" rm -f "$pol"
if have systemctl && [ -d /run/systemd/system ]; then
  "${SUDO[@]}" systemctl disable --now prometheus prometheus-pushgateway >/dev/null 2>&1 || true
fi
have prometheus && have prometheus-pushgateway || { echo "[prometheus] installed, but the binaries are not on PATH" >&2; exit 1; }
echo "[prometheus] installed ($(prometheus --version 2>&1 | head -1 | cut -d' ' -f1-3))"
