"""Runs another script (argv[1], with the rest of argv) while a child process of this rank holds a
file open at /dev/nvidia0, as a process using GPU 0 would: what the CRIU engine's launcher looks for
before a dump (runtime/criu_cuda.py). The file is a plain one on a tmpfs the child mounts over /dev
in a mount namespace of its own (root, `unshare --mount`): nothing of the machine's /dev changes,
and the rank itself keeps the real /dev. The child is this rank's, so it ends with the rank's PID
namespace (the CRIU engine's) or when the script returns.
Usage: gpu_file_holder.py SCRIPT [SCRIPT ARGS...]
"""
import runpy
import subprocess
import sys

HOLD = "mount -t tmpfs meridian-test-dev /dev && exec 3>/dev/nvidia0 && echo held && exec sleep 600"


def main():
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", HOLD],
                              stdout=subprocess.PIPE)
    # Its own word, not /proc: a CRIU engine's rank has a PID namespace of its own and the host's /proc.
    if holder.stdout.readline() != b"held\n":
        sys.exit(f"gpu_file_holder: the holder did not open /dev/nvidia0 (exit {holder.wait()})")
    print(f"holder {holder.pid} holds /dev/nvidia0", flush=True)
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        holder.kill()
        holder.wait()


if __name__ == "__main__":
    main()
