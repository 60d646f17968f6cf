"""A job's script that looks around: who it runs as, its environment, its cores and cgroup, and
whether it can read each path it is given. Writes $HOME/<name>.json (HOME is its workspace).

    probe.py NAME [--sleep S] [PATH ...]
"""
import json
import os
import sys
import time

name, rest = sys.argv[1], sys.argv[2:]
sleep_s = 0.0
if rest[:1] == ["--sleep"]:
    sleep_s, rest = float(rest[1]), rest[2:]
reads = {}
for path in rest + [f"/proc/{os.getppid()}/environ"]:
    try:
        with open(path, "rb") as handle:
            reads[path] = "read:" + handle.read(200).decode(errors="replace")
    except OSError as exc:
        reads[path] = f"refused:{exc.errno}"
with open("/proc/self/cgroup") as handle:
    cgroup = handle.read()
report = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
          "environ": dict(os.environ), "affinity": sorted(os.sched_getaffinity(0)), "cgroup": cgroup,
          "reads": reads, "cwd": os.getcwd(), "pid": os.getpid()}
with open(os.path.join(os.environ["HOME"], f"{name}.json"), "w") as handle:
    json.dump(report, handle)
time.sleep(sleep_s)
