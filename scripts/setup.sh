#!/usr/bin/env bash
# Installs what Limbo needs from Debian's archive (only what is missing), makes
# the fast OpenMP OpenBLAS the system BLAS, and builds into ./build.
#
#   scripts/setup.sh --limbo   what `limbo` and the default job need, and builds
#                              only `limbo` (scripts/run-default.sh)
#   scripts/setup.sh           everything: the tests, benchmarks and their tools
#                              too, and builds every target (scripts/run-tests.sh)
#
# Prints one line per phase with the time since the start; each phase's full
# output goes to build/logs/<phase>.log, and a failure names its phase and log
# and exits non-zero. Idempotent: a second run installs nothing and rebuilds
# only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=all
case "${1:-}" in
  --limbo) MODE=limbo ;;
  "" | --all) ;;
  *)
    echo "usage: scripts/setup.sh [--limbo | --all]" >&2
    exit 2
    ;;
esac

# Building `limbo` and running the default job (LeNet on Fashion-MNIST).
LIMBO_PACKAGES=(
  build-essential cmake ccache pkg-config libssl-dev
  libtorch-dev libgloo-dev libzmq3-dev cppzmq-dev libopenblas0-openmp
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev zlib1g-dev
  libcpp-httplib-dev libjs-chart.js dataset-fashion-mnist
  python3-dev pybind11-dev
)
# PyTorch for Python, for a user's own loop with the `limbo` module (the
# README's Python example). With --limbo it is installed while `limbo`
# builds (the download overlaps the compiler), and waited for before the
# end.
PYTHON_PACKAGES=(python3-torch python3-numpy)
# The tests, benchmarks and experiments, on top: GoogleTest, network
# namespaces, etcd and the certificates of its TLS tests, PyTorch for Python
# (the side-by-side baseline and oracle; torchvision for the augmentation
# oracle), plots, the real-browser test, a real Slurm (its tests start their
# own daemons).
TEST_PACKAGES=(
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  iproute2 openssl etcd-server etcd-client
  python3-torchvision python3-matplotlib python3-prometheus-client chromium
  python3-pytest
  munge slurmctld slurmd slurm-client
)
PACKAGES=("${LIMBO_PACKAGES[@]}")
if [ "$MODE" = all ]; then PACKAGES+=("${PYTHON_PACKAGES[@]}" "${TEST_PACKAGES[@]}"); fi

BUILD_DIR="${LIMBO_BUILD_DIR:-build}"
JOBS="${LIMBO_JOBS:-2}"
LOGS="$BUILD_DIR/logs"
mkdir -p "$LOGS"
T0="${LIMBO_T0:-$(date +%s)}"  # run-default.sh passes its own start
TTY=0
if [ -t 1 ]; then TTY=1; fi

elapsed() {
  local s=$(($(date +%s) - T0))
  printf '%d:%02d' $((s / 60)) $((s % 60))
}
# begin TEXT: starts a phase's line; end TEXT: finishes it (one line each).
begin() { printf '[%s] %s ... ' "$(elapsed)" "$1"; }
end() { printf '%s (%s)\n' "$1" "$(elapsed)"; }

# fail PHASE LOG STATUS [HINT]: names the failed phase and its log, shows
# what in the log explains it, and exits with the phase's status.
fail() {
  local phase="$1" log="$2" status="$3" hint="${4:-}"
  printf 'FAILED\n'
  printf '\nsetup: %s failed (exit %s)\n' "$phase" "$status" >&2
  if [ -n "$hint" ]; then printf '  %s\n' "$hint" >&2; fi
  printf '  full log: %s\n' "$log" >&2
  if grep -qE 'error:|Error [0-9]|CMake Error' "$log" 2>/dev/null; then
    printf '  first errors:\n' >&2
    grep -m 8 -E 'error:|Error [0-9]|CMake Error' "$log" | sed 's/^/    /' >&2
  else
    printf '  last lines:\n' >&2
    tail -n 12 "$log" | sed 's/^/    /' >&2
  fi
  exit "$status"
}

# run PHASE LOG CMD...: CMD's output goes to LOG; fails the phase on error.
run() {
  local phase="$1" log="$2"
  shift 2
  local status=0
  "$@" >>"$log" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then fail "$phase" "$log" "$status" "$(hint_for "$log")"; fi
}

hint_for() {
  if grep -qiE 'Temporary failure resolving|Could not resolve|Failed to fetch|Unable to connect|Connection (failed|timed out)|Network is unreachable' "$1" 2>/dev/null; then
    echo "the package archive could not be reached: is this machine online, and does /etc/apt/sources.list name a Debian mirror?"
  elif grep -qiE 'Permission denied|are you root' "$1" 2>/dev/null; then
    echo "installing packages needs root: run as root, or as a user who may sudo"
  elif grep -qiE 'No space left' "$1" 2>/dev/null; then
    echo "the disk is full"
  fi
}

# ---- packages ----
# missing_of PKG...: those of PKG not installed, on one line.
missing_of() {
  local p
  for p in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then printf '%s ' "$p"; fi
  done
}
read -r -a missing <<<"$(missing_of "${PACKAGES[@]}")"
if [ "${#missing[@]}" -gt 0 ]; then
  log="$LOGS/packages.log"
  : >"$log"
  begin "installing ${#missing[@]} packages (${missing[*]:0:4}$([ "${#missing[@]}" -gt 4 ] && echo ' ...'))"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
      echo "no root" >>"$log"
      fail "installing packages" "$log" 1 "installing packages needs root, and sudo is not installed: run this as root, or install as root: apt-get install ${missing[*]}"
    fi
    SUDO="sudo"
  fi
  run "installing packages (apt-get update)" "$log" $SUDO apt-get update
  # Packages with a service (etcd-server) must not start it: the tests start
  # their own etcd members on their own ports. A policy-rc.d that denies
  # starts, only for this install and only if the machine has none.
  policy_added=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod 755 /usr/sbin/policy-rc.d
    policy_added=1
  fi
  status=0
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${missing[@]}" >>"$log" 2>&1 || status=$?
  if [ "$policy_added" = 1 ]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi
  if [ "$status" -ne 0 ]; then fail "installing packages (apt-get install)" "$log" "$status" "$(hint_for "$log")"; fi
  end "done"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  printf '[%s] packages: all %d present\n' "$(elapsed)" "${#PACKAGES[@]}"
fi

# libtorch's linear layers call the system libblas.so.3. Debian's default is
# the slow reference BLAS; point it at OpenBLAS built for OpenMP, which shares
# libtorch's OpenMP thread pool instead of oversubscribing the cores.
ARCH_TRIPLET="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)"
OMP_DIR="/usr/lib/${ARCH_TRIPLET}/openblas-openmp"
# libtorch loads libopenblas.so.0 and libblas.so.3 / liblapack.so.3 through
# these alternatives. Installing the test packages brings the pthread
# OpenBLAS, whose higher priority would take libopenblas.so.0 over.
to_select=()
for lib in libblas.so.3 liblapack.so.3 libopenblas.so.0; do
  want="$OMP_DIR/$lib"
  [ -e "$want" ] || continue
  now="$(update-alternatives --query "$lib-${ARCH_TRIPLET}" 2>/dev/null | awk '/^Value:/{print $2}')"
  if [ "$now" != "$want" ]; then to_select+=("$lib"); fi
done
if [ "${#to_select[@]}" -gt 0 ]; then
  log="$LOGS/blas.log"
  : >"$log"
  begin "selecting OpenBLAS (OpenMP) for ${to_select[*]}"
  for lib in "${to_select[@]}"; do
    run "selecting the system BLAS ($lib)" "$log" $SUDO update-alternatives --set "$lib-${ARCH_TRIPLET}" "$OMP_DIR/$lib"
  done
  end "done"
fi

# ---- build ----
log="$LOGS/configure.log"
: >"$log"
tests=AUTO
if [ "$MODE" = all ]; then tests=ON; fi
first=0
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then first=1; fi
if [ "$first" = 1 ]; then begin "configuring"; fi
run "configuring (cmake)" "$log" cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DLIMBO_BUILD_TESTS="$tests"
if [ "$first" = 1 ]; then end "done"; fi

# --limbo: PyTorch for Python installs while limbo builds (apt's lock is
# free again once the packages phase ended).
py_pid=""
py_log="$LOGS/python-packages.log"
if [ "$MODE" = limbo ]; then
  read -r -a py_missing <<<"$(missing_of "${PYTHON_PACKAGES[@]}")"
  if [ "${#py_missing[@]}" -gt 0 ]; then
    : >"$py_log"
    SUDO_PY=""
    if [ "$(id -u)" -ne 0 ]; then SUDO_PY="sudo"; fi
    # Without fresh package lists (none were missing above, so no update
    # ran) the install may not find them: it updates and tries again.
    py_install() { DEBIAN_FRONTEND=noninteractive $SUDO_PY apt-get install -y --no-install-recommends "${py_missing[@]}"; }
    { py_install || { $SUDO_PY apt-get update && py_install; }; } >>"$py_log" 2>&1 &
    py_pid=$!
    printf '[%s] installing PyTorch for Python (%s) while limbo builds\n' "$(elapsed)" "${py_missing[*]}"
  fi
fi

target=()
what="every target (limbo, tests, benchmarks)"
if [ "$MODE" = limbo ]; then
  target=(--target limbo limbo_python)
  what="limbo and its Python module"
fi
log="$LOGS/build.log"
: >"$log"
begin "building $what on $JOBS cores"
status=0
cmake --build "$BUILD_DIR" -j "$JOBS" "${target[@]}" >>"$log" 2>&1 &
pid=$!
if [ "$TTY" = 1 ]; then
  # On a terminal the line shows make's progress while it runs.
  line="[$(elapsed)] building $what on $JOBS cores ... "
  while kill -0 "$pid" 2>/dev/null; do
    pct="$(grep -oE '^\[ *[0-9]+%\]' "$log" 2>/dev/null | tail -n 1 | tr -d '[] ' || true)"
    printf '\r%s%s ' "$line" "${pct:-}"
    sleep 1
  done
  printf '\r%s' "$line"
fi
wait "$pid" || status=$?
if [ "$status" -ne 0 ]; then fail "building $what" "$log" "$status" "$(hint_for "$log")"; fi
if grep -qE 'Building CXX|Linking CXX' "$log"; then end "done"; else end "up to date"; fi

if [ -n "$py_pid" ]; then
  begin "finishing the install of PyTorch for Python"
  status=0
  wait "$py_pid" || status=$?
  if [ "$status" -ne 0 ]; then fail "installing PyTorch for Python" "$py_log" "$status" "$(hint_for "$py_log")"; fi
  end "done"
fi

# `import limbo` from Debian's Python without PYTHONPATH: a .pth file in
# its site directory names this build's module folder (what `pip install
# -e` does); rewritten when the checkout moves.
if [ -d "$BUILD_DIR/python/limbo" ] && [ -x /usr/bin/python3 ]; then
  site="$(/usr/bin/python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)"
  want="$(cd "$BUILD_DIR/python" && pwd)"
  if [ -n "$site" ] && [ "$(cat "$site/limbo.pth" 2>/dev/null)" != "$want" ]; then
    log="$LOGS/python-path.log"
    : >"$log"
    begin "making \`import limbo\` work for /usr/bin/python3 ($site/limbo.pth)"
    run "writing $site/limbo.pth" "$log" $SUDO mkdir -p "$site"
    echo "$want" | $SUDO tee "$site/limbo.pth" >>"$log" 2>&1 || fail "writing $site/limbo.pth" "$log" 1
    end "done"
  fi
fi
