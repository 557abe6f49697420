#!/usr/bin/env bash
# Installs what Limbo needs from Debian's archive (only what is missing), makes
# the fast OpenMP OpenBLAS the system BLAS, and builds into ./build.
# Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ccache pkg-config libssl-dev iproute2 openssl etcd-server etcd-client
  libtorch-dev libgloo-dev libzmq3-dev cppzmq-dev
  libopenblas0-openmp
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev zlib1g-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  dataset-fashion-mnist
  python3-torch python3-numpy python3-matplotlib
  libcpp-httplib-dev libjs-chart.js chromium python3-prometheus-client
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  # Packages with a service (etcd-server) must not start it: the tests start
  # their own etcd members on their own ports. A policy-rc.d that denies
  # starts, only for this install and only if the machine has none.
  policy_added=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d > /dev/null
    $SUDO chmod 755 /usr/sbin/policy-rc.d
    policy_added=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  if [ "$policy_added" = 1 ]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi
fi

# libtorch's linear layers call the system libblas.so.3. Debian's default is
# the slow reference BLAS; point it at OpenBLAS built for OpenMP, which shares
# libtorch's OpenMP thread pool instead of oversubscribing the cores.
ARCH_TRIPLET="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)"
OPENBLAS="/usr/lib/${ARCH_TRIPLET}/openblas-openmp/libblas.so.3"
ALT="libblas.so.3-${ARCH_TRIPLET}"
if [ -e "$OPENBLAS" ]; then
  current="$(update-alternatives --query "$ALT" 2>/dev/null | awk '/^Value:/{print $2}')"
  if [ "$current" != "$OPENBLAS" ]; then
    echo "setup: selecting $OPENBLAS as the system BLAS"
    $SUDO update-alternatives --set "$ALT" "$OPENBLAS"
  fi
  OPENLAPACK="/usr/lib/${ARCH_TRIPLET}/openblas-openmp/liblapack.so.3"
  LALT="liblapack.so.3-${ARCH_TRIPLET}"
  if [ -e "$OPENLAPACK" ]; then
    lcur="$(update-alternatives --query "$LALT" 2>/dev/null | awk '/^Value:/{print $2}')"
    [ "$lcur" = "$OPENLAPACK" ] || $SUDO update-alternatives --set "$LALT" "$OPENLAPACK"
  fi
fi

BUILD_DIR="${LIMBO_BUILD_DIR:-build}"
JOBS="${LIMBO_JOBS:-2}"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release > "$BUILD_DIR.configure.log" 2>&1 ||
  { cat "$BUILD_DIR.configure.log"; exit 1; }
cmake --build "$BUILD_DIR" -j "$JOBS"
