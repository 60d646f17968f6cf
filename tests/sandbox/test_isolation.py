"""A job cannot read the node's credentials, the agent's environment or another job's workspace,
runs as its own unprivileged uid in its own cgroup, and is killed as a whole.

Measured on the landed code before this: a member's job ran as the agent's user (root) with the
agent's whole environment (MERIDIAN_AGENT_ENROLLMENT_TOKEN) and read every node token, the secret key
and the SQLite database."""
import os
import pathlib
import signal

import pytest
from polling import poll
from sandbox_helpers import SCRIPTS, UID_BASE, entry, make_node, needs_sandbox, outcome, probe_report, workspace

import portal.settings as portal_settings
from agent import sandbox as agent_sandbox
from agent.node import pid_alive
from runtime import sandbox as mechanisms

pytestmark = [pytest.mark.runtime, needs_sandbox]
SECRETS = {"MERIDIAN_AGENT_ENROLLMENT_TOKEN": "enroll-c0ffee", "MERIDIAN_AGENT_TOKEN": "node-token-beef",
           "SECRET_KEY": "django-secret-key-cafe", "DATABASE_URL": "postgres://meridian:pw-deadbeef@db/meridian"}


def _portal_data_dir(root):
    """A data dir made the way the portal makes its own: the secret key and the SQLite file."""
    data = root / "data"
    data.mkdir()
    os.chmod(data, 0o755)
    portal_settings._secret_key_from_data_dir(data)
    portal_settings._private_sqlite_file(str(data / "meridian.sqlite3"))
    (data / "meridian.sqlite3").write_bytes(b"SQLite format 3\0 the jobs, the users, the node token hashes")
    return data


def test_a_job_reads_neither_the_nodes_credentials_nor_the_agents_environment(node_root, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    data = _portal_data_dir(node_root)
    work, store = node_root / "w", node_root / "store"
    node = make_node(work)
    token = work / "node-token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT, 0o600)  # as agent/main.py writes it
    os.write(fd, b"node-token-beef")
    os.close(fd)
    workspace(work, 31)
    # (/proc/<pid>/cmdline stays world-readable, as on any Linux without hidepid: no secret goes on
    # a command line, the house rule.)
    targets = [token, data / "secret_key", data / "meridian.sqlite3", work / "j", f"/proc/{os.getpid()}/environ"]
    try:
        node.reconcile([entry(31, store, args=["probe", *targets], env={"MY_SETTING": "from the job"})])
        job_dir = node.jobs[31].job_dir
        report = outcome(node, 31)
        assert report["state"] == "finished", report.get("error")
        assert report["sandbox"].startswith(f"uid {mechanisms.identity_for_job(31, base=UID_BASE).uid}, ")
    finally:
        node.kill_all()
    seen = probe_report(work / "workspaces" / "job-31" / "probe.json")
    identity = mechanisms.identity_for_job(31, base=UID_BASE)
    assert (seen["uid"], seen["euid"], seen["gid"], seen["groups"]) == (identity.uid, identity.uid, identity.gid, [])
    env = seen["environ"]
    leaked = {k: v for k, v in env.items() if any(s in v for s in SECRETS.values()) or k in SECRETS}
    assert not leaked
    assert env["MY_SETTING"] == "from the job"  # what the job asked for
    assert {env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]} >= {"0", "1", "127.0.0.1"}
    assert env["HOME"] == str(work / "workspaces" / "job-31")
    refused = {path: outcome_ for path, outcome_ in seen["reads"].items() if not outcome_.startswith("refused:")}
    assert not refused, f"the job could read {refused}"
    # what the agent gave the launcher: the job's environment, not the agent's
    launcher_env = (job_dir / agent_sandbox.SANDBOX_FILE).read_text()
    assert "MY_SETTING" in launcher_env and not any(s in launcher_env for s in SECRETS.values())
    assert oct(os.stat(job_dir / agent_sandbox.SANDBOX_FILE).st_mode & 0o777) == "0o600"


def test_a_job_cannot_read_another_jobs_workspace(node_root_outside_tmp):
    """By the workspace's mode: outside /tmp, where the job's private /tmp hides nothing."""
    node_root = node_root_outside_tmp
    work, store = node_root / "w", node_root / "store"
    node = make_node(work)
    mine, other = work / "workspaces" / "job-41", work / "workspaces" / "job-42"
    try:
        first = entry(41, store, args=["probe", "--sleep", "3"])
        node.reconcile([first])
        probe_report(mine / "probe.json")  # job 41 wrote its results into its workspace
        node.reconcile([first, entry(42, store, args=["probe", mine / "probe.json", mine], indices=(1,))])
        for job_id in (41, 42):
            report = outcome(node, job_id)
            assert report["state"] == "finished", report.get("error")
    finally:
        node.kill_all()
    reads = probe_report(other / "probe.json")["reads"]
    assert reads[str(mine / "probe.json")].startswith("refused:13")  # EACCES: there, not readable
    assert reads[str(mine)].startswith("refused:13")
    assert (os.stat(mine).st_uid, os.stat(mine).st_mode & 0o777) == (mechanisms.identity_for_job(41, base=UID_BASE).uid,
                                                                       0o700)


def test_a_job_is_confined_to_its_devices_cores_and_its_memory_limit(node_root):
    work, store = node_root / "w", node_root / "store"
    node = make_node(work)
    workspace(work, 51)
    try:
        node.reconcile([entry(51, store, args=["probe", "--sleep", "30"], indices=(1,))])
        seen = probe_report(work / "workspaces" / "job-51" / "probe.json")
        cgroup = agent_sandbox.cgroup_of(node.jobs[51].job_dir)
        assert cgroup is not None
        assert cgroup.cores() == (1,)  # the cpuset behind device 1
        assert seen["affinity"] == [1]
        assert seen["pid"] in cgroup.pids() or any(str(cgroup.dirs[0]).endswith(line.split(":", 2)[2])
                                                   for line in seen["cgroup"].splitlines() if "cpuset" in line)
        limit = cgroup.memory_limit()
        assert limit is not None and limit == node.sandbox.memory_bytes(1)
        # a rank cannot widen its own affinity past the cpuset
        rank_pid = seen["pid"]
        with pytest.raises(OSError):
            os.sched_setaffinity(rank_pid, {0})  # root cannot either: the cpuset refuses it
    finally:
        node.kill_all()


def test_a_cancelled_job_is_killed_as_a_whole_even_what_escaped_its_process_group(node_root):
    """The job's script starts a daemon (its own session, reparented to init) and goes on; killing
    the job kills the daemon too (by pid, the old way, it survived)."""
    work, store = node_root / "w", node_root / "store"
    node = make_node(work)
    space = workspace(work, 61)
    try:
        node.reconcile([entry(61, store, script=SCRIPTS / "daemonize.py", args=["daemon.pid"])])
        pid_file = space / "daemon.pid"
        poll("the daemon to start", lambda: pid_file.exists() and pid_file.read_text().strip())
        daemon = int(pid_file.read_text())
        assert pid_alive(daemon)
        assert os.getppid() != daemon and pathlib.Path(f"/proc/{daemon}").exists()
        assert node.fence([61], why="cancelled", remove_store=True) == [61]
        poll("the daemon to be gone", lambda: not pid_alive(daemon), timeout=10)
    finally:
        node.kill_all()
        try:
            os.kill(daemon, signal.SIGKILL)
        except (NameError, ProcessLookupError):
            pass


def test_an_unconfined_job_says_so_in_its_report_and_still_gets_only_its_environment(node_root, monkeypatch):
    monkeypatch.setenv("MERIDIAN_AGENT_ENROLLMENT_TOKEN", "enroll-c0ffee")
    work, store = node_root / "w", node_root / "store"
    node = make_node(work, mode="off")
    workspace(work, 35)
    try:
        node.reconcile([entry(35, store, args=["probe"])])
        report = outcome(node, 35)
    finally:
        node.kill_all()
    assert report["state"] == "finished", report.get("error")
    assert report["sandbox"].startswith("UNCONFINED")  # the control plane puts it in the job's events
    seen = probe_report(work / "workspaces" / "job-35" / "probe.json")
    assert "MERIDIAN_AGENT_ENROLLMENT_TOKEN" not in seen["environ"]


def test_an_enforced_sandbox_that_cannot_work_fails_the_launch_with_the_reason(node_root, monkeypatch):
    monkeypatch.setattr(mechanisms, "detect_cgroups", lambda: (_ for _ in ()).throw(
        mechanisms.SandboxError("no cgroup v1 cpuset controller mounted at /sys/fs/cgroup/cpuset")))
    work, store = node_root / "w", node_root / "store"
    node = make_node(work, mode="enforce")
    node.reconcile([entry(36, store, args=["probe"])])
    report = outcome(node, 36)
    assert report["state"] == "failed"
    assert "sandbox could not be set up" in report["error"] and "cpuset controller" in report["error"]
