"""Pid 1 of an emulated host (tests/hosts/emulated_hosts.py): mounts the host's own places, then reaps.

Runs as the first process of fresh network, mount, PID and UTS namespaces (`unshare ...
--mount-proc`). It mounts tmpfs on /dev/shm, /run and /tmp, binds the shared store at its mount
point, hides the harness's folder (other hosts' state), sets the host name, writes
"ready" to the ready fd and then reaps orphans for the life of
the host. As a PID-namespace init it ignores signals it has no handler for, from inside; the
harness ends it with SIGKILL, which ends every process of the host.
"""
import argparse
import os
import socket
import subprocess
import time


def mount(*args):
    subprocess.run(["mount", *args], check=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hostname", required=True)
    parser.add_argument("--store-source", required=True)
    parser.add_argument("--store-mount", required=True)
    parser.add_argument("--node-dir", required=True)
    parser.add_argument("--hide", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--keep", action="append", default=[],
                        help="a folder under /tmp of the installed image (a checkout and its venv there) that "
                             "stays visible through the host's own /tmp")
    options = parser.parse_args()
    try:
        mount("-t", "tmpfs", "-o", "mode=1777", "host-shm", "/dev/shm")
        mount("-t", "tmpfs", "-o", "mode=755", "host-run", "/run")
        # Folders of the image that lie under /tmp (a checkout in /tmp, as CI's clone may be) are
        # bound aside before the host's own /tmp covers them, then bound back at the same path.
        for index, path in enumerate(options.keep):
            aside = f"/run/meridian-image-{index}"
            os.makedirs(aside)
            mount("--bind", path, aside)
        mount("-t", "tmpfs", "-o", "mode=1777", "host-tmp", "/tmp")
        for index, path in enumerate(options.keep):
            aside = f"/run/meridian-image-{index}"
            os.makedirs(path, exist_ok=True)
            mount("--bind", aside, path)
            mount("--make-private", aside)
            subprocess.run(["umount", aside], check=True)
            os.rmdir(aside)
        os.makedirs(options.node_dir, mode=0o755)
        os.makedirs(options.store_mount, mode=0o755)
        mount("--bind", options.store_source, options.store_mount)
        mount("-t", "tmpfs", "-o", "mode=700", "host-hidden", options.hide)
        socket.sethostname(options.hostname)
        message = "ready\n"
    except Exception as exc:  # noqa: BLE001 - any failure is told to the harness, which gives up
        os.write(options.ready_fd, f"failed {type(exc).__name__}: {exc}\n".encode())
        raise SystemExit(1) from None
    os.write(options.ready_fd, message.encode())
    os.close(options.ready_fd)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.5)


if __name__ == "__main__":
    main()
