#!/usr/bin/env bash
# Packs this machine's CRIU (built by scripts/install-criu.sh) with the shared libraries it needs
# into .device/criu (git-ignored), for a lent GPU machine, which reaches no package registry and
# has had no CRIU so far (bench/gpu_checks.py's CRIU row was "skipped" there). Carry it and put it
# first on PATH:
#   run(carry=[".device"], command='PATH=$PWD/.device/criu/bin:$PATH python3 bench/gpu_checks.py ...')
# glibc and the dynamic loader are not packed: the lent machine's glibc must be at least this one's
# (`ldd --version`); `criu check` there says whether its kernel suits.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${root}/.device/criu
bash "${root}/scripts/install-criu.sh" >/dev/null
binary=$(command -v criu || echo /usr/local/sbin/criu)
rm -rf "${out}"
mkdir -p "${out}/bin" "${out}/lib"
cp "${binary}" "${out}/lib/criu.real"
ldd "${binary}" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "${lib}")" in libc.so.*|ld-linux*) continue ;; esac
    cp -L "${lib}" "${out}/lib/"
done
cat >"${out}/bin/criu" <<'WRAPPER'
#!/bin/sh
# CRIU with the libraries packed beside it (scripts/pack-criu-for-device.sh); what it restores
# keeps its own environment, not this one.
here=$(dirname "$(readlink -f "$0")")/../lib
LD_LIBRARY_PATH="${here}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}" exec "${here}/criu.real" "$@"
WRAPPER
chmod 755 "${out}/bin/criu"
"${out}/bin/criu" --version | head -1
echo "pack-criu-for-device: $(du -sh "${out}" | cut -f1) in ${out}"
