#!/usr/bin/env bash
# Prepares a fresh Debian/Ubuntu machine; safe to run again (it skips what is done).
#
#   bash scripts/setup.sh          the main job: a Vulkan driver when none is present (Mesa's
#                                  lavapipe runs Vulkan on the CPU), then .venv with meganeura,
#                                  its direct Vulkan backend and what the examples need
#                                  (.[vulkan,examples]: no PyTorch)
#   bash scripts/setup.sh --dev    the tests: the same, plus the dev extras (PyTorch and the other
#                                  references the tests compare against, pytest) and Chromium for
#                                  the browser tests of the web export (it runs WebGPU headless on
#                                  its own SwiftShader; Playwright drives this system browser and
#                                  downloads none)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") mode=main; extras="vulkan,examples" ;;
  --dev) mode=dev; extras="dev" ;;
  *) echo "scripts/setup.sh: unknown option '$1' (give nothing for the main job, or --dev for the tests)" >&2
     exit 2 ;;
esac
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)

apt_install() {   # apt_install WHY PACKAGE...
  echo "$1: installing $(shift; echo "$@")"
  shift
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

icds=$(ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json 2>/dev/null || true)
if [ -z "$icds" ] || ! ldconfig -p | grep -q libvulkan.so.1; then
  apt_install "no Vulkan driver found" mesa-vulkan-drivers libvulkan1
fi
if [ "$mode" = dev ] && ! command -v chromium >/dev/null 2>&1; then
  apt_install "no chromium found (browser tests of the web export)" chromium
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# the install is redone only when pyproject.toml changed since this mode (or --dev, which
# holds the main job's extras too) last installed it; the package itself is editable
stamp() { echo ".venv/.meganeura-setup-$1"; }
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
done_for() { [ -f "$(stamp "$1")" ] && [ "$(cat "$(stamp "$1")")" = "$want" ]; }
if done_for "$mode" || { [ "$mode" = main ] && done_for dev; }; then
  echo "installed already: .venv has meganeura[$extras] for this pyproject.toml"
else
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  echo "$want" > "$(stamp "$mode")"
fi
echo "ready: .venv/bin/meganeura info"
