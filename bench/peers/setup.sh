#!/usr/bin/env bash
# Install the systems kvpool-bench compares against, on a fresh Debian machine (run as root).
#
#   bench/peers/setup.sh                 # everything: redis mooncake libcachesim etcd hosts fonts
#   bench/peers/setup.sh redis           # only Redis (the CI smoke needs just this)
#   PEERS="redis libcachesim" bench/peers/setup.sh
#
# Idempotent: what is already installed is left alone. Quiet on success, loud on failure.
# PYTHON (default python3) selects the interpreter whose pip gets the Python packages.
set -euo pipefail

MOONCAKE_VERSION="${MOONCAKE_VERSION:-0.3.13.post1}"
PYTHON="${PYTHON:-python3}"
peers=("$@")
if [ ${#peers[@]} -eq 0 ]; then
    read -r -a peers <<<"${PEERS:-redis mooncake libcachesim etcd hosts fonts}"
fi

die() { echo "setup.sh: $*" >&2; exit 1; }
log() { echo "setup.sh: $*" >&2; }

[ "$(id -u)" -eq 0 ] || die "run as root (apt-get and pip install system-wide)"

apt_updated=0
apt_install() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ $apt_updated -eq 0 ]; then
        apt-get update -qq >/dev/null || die "apt-get update failed"
        apt_updated=1
    fi
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
}

pip_install() {
    # $1: import probe; rest: pip requirement(s)
    local probe="$1"; shift
    if "$PYTHON" -c "$probe" >/dev/null 2>&1; then return 0; fi
    log "pip install $*"
    "$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@" \
        || die "pip install $* failed"
    "$PYTHON" -c "$probe" >/dev/null 2>&1 || die "installed $* but '$PYTHON -c \"$probe\"' still fails"
}

for peer in "${peers[@]}"; do
    case "$peer" in
    redis)
        apt_install redis-server
        # The Debian service may auto-start on 6379; the bench starts its own servers on free ports.
        command -v redis-server >/dev/null || die "redis-server not on PATH after install"
        ;;
    etcd)
        # The cluster tests start their own etcd (leader election of masters) on free ports.
        apt_install etcd-server
        command -v etcd >/dev/null || die "etcd not on PATH after install"
        ;;
    mooncake)
        # libibverbs is a hard link-time dependency of the transfer engine even with protocol=tcp.
        apt_install libibverbs1
        pip_install "from mooncake.store import MooncakeDistributedStore" \
            "mooncake-transfer-engine-non-cuda==${MOONCAKE_VERSION}"
        ;;
    libcachesim)
        pip_install "import libcachesim" "libcachesim==0.3.5"
        ;;
    hosts)
        # Hosts as network namespaces: iproute2 makes them, ethtool gives their veths a NIC's
        # offloads (kvpool-netns, python/tests/netns.py).
        apt_install iproute2 ethtool
        ;;
    fonts)
        # The PNG plots need one TrueType font (DejaVu Sans); most images have it already.
        apt_install fonts-dejavu-core
        ;;
    *)
        die "unknown peer '$peer' (redis, mooncake, libcachesim, etcd, hosts, fonts)"
        ;;
    esac
done
