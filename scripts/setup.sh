#!/usr/bin/env bash
# Prepares a fresh Debian/Ubuntu machine: a Vulkan driver when none is present (Mesa's
# lavapipe runs Vulkan on the CPU), Chromium for the browser tests of the web export (it runs
# WebGPU headless on its own SwiftShader; Playwright drives this system browser, it downloads
# none), then .venv with meganeura and its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
icds=$(ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json 2>/dev/null || true)
if [ -z "$icds" ] || ! ldconfig -p | grep -q libvulkan.so.1; then
  echo "no Vulkan driver found: installing mesa-vulkan-drivers (lavapipe)"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
fi
if ! command -v chromium >/dev/null 2>&1; then
  echo "no chromium found: installing Debian's chromium (browser tests of the web export)"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
echo "ready: .venv/bin/meganeura info"
