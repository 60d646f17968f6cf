#!/usr/bin/env bash
# Install CRIU 4.1.1 to /usr/local/sbin/criu, built from Debian trixie's source package.
#
# Why from source: bookworm's criu 3.17.1 fails `criu check` on recent kernels (unknown vDSO
# layout) and trixie's binary .deb needs glibc 2.38. The trixie *source* builds on bookworm.
# Idempotent: does nothing when `criu --version` already reports a major version >= 4.
# Needs root (apt-get, install into /usr/local/sbin). Used by CI and by developers.
set -euo pipefail

want_major=4
if command -v criu >/dev/null 2>&1; then
    have=$(criu --version 2>/dev/null | awk '/^Version:/ {print $2}')
    if [[ -n "${have}" && "${have%%.*}" -ge ${want_major} ]]; then
        echo "install-criu: criu ${have} already installed at $(command -v criu); nothing to do"
        exit 0
    fi
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "install-criu: must run as root (apt-get and /usr/local/sbin)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
src_list=/etc/apt/sources.list.d/meridian-trixie-src.sources
if [[ ! -f ${src_list} ]]; then
    cat >"${src_list}" <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
apt-get update -q
apt-get install -y -q --no-install-recommends \
    build-essential dpkg-dev pkgconf \
    libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler python3-protobuf \
    libnl-3-dev libnet1-dev libcap-dev libbsd-dev libnftables-dev libgnutls28-dev uuid-dev \
    iproute2 util-linux

work=$(mktemp -d /tmp/criu-build.XXXXXX)
trap 'rm -rf "${work}"' EXIT
cd "${work}"
# The .dsc and debian.tar.xz are not needed (we build upstream's source, Debian's patches only
# touch packaging), and some mirrors lack them: keep going as long as the upstream tarball came,
# and check it against the sha256 in trixie's Sources index.
apt-get source -q --download-only criu/trixie || true
orig=$(ls criu_*.orig.tar.* 2>/dev/null | head -1)
if [[ -z "${orig}" ]]; then
    echo "install-criu: could not download criu's source from trixie (see apt errors above)" >&2
    exit 1
fi
want_sha=$(apt-cache showsrc criu 2>/dev/null \
    | awk '/^Checksums-Sha256:/ {f=1; next} /^[^ ]/ {f=0} f && $3 == "'"${orig}"'" {print $1; exit}')
have_sha=$(sha256sum "${orig}" | awk '{print $1}')
if [[ -z "${want_sha}" || "${want_sha}" != "${have_sha}" ]]; then
    echo "install-criu: sha256 of ${orig} (${have_sha}) does not match trixie's index (${want_sha:-none})" >&2
    exit 1
fi
mkdir criu-src
tar -xf "${orig}" -C criu-src --strip-components=1
cd criu-src
make -j"$(nproc)" criu >/dev/null
install -m 0755 criu/criu /usr/local/sbin/criu
hash -r
echo "install-criu: installed $(/usr/local/sbin/criu --version | head -1)"
/usr/local/sbin/criu check && echo "install-criu: criu check passed"
