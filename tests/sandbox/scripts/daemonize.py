"""A job's script that leaves a daemon behind: double fork, new session, sleeps; the job goes on."""
import os
import sys
import time

pid_file = os.path.join(os.environ["HOME"], sys.argv[1])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(pid_file + ".tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        time.sleep(600)
    os._exit(0)
time.sleep(600)
