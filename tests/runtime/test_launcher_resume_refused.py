"""What meridian-run does with a resume the framework engine refused, for a job spanning hosts
(runtime.launcher.Launcher.resume_refused): no rank process is started, the refusal is written
where a rank writes it. The single-host restart runs real ranks: tests/runtime/corpus."""
import json
from types import SimpleNamespace

import pytest

from runtime import spool as spool_files
from runtime.exits import REFUSED_FILE, LaunchError
from runtime.launcher import Launcher, parse_args


def a_hosts_launcher_whose_rank_refused(tmp_path, *, policy):
    tmp_path.mkdir()
    script = tmp_path / "train.py"
    script.write_text("")
    launcher = Launcher(parse_args(["--ranks", "2", "--if-resume-refused", policy, "--job-dir", str(tmp_path / "job"),
                                    "--job-id", f"j7-g2-{policy}", str(script)]))
    # What start_rendezvous sets on a host of a job spanning hosts (its peers); only its presence counts here.
    launcher.peers = SimpleNamespace()
    rank_dir = spool_files.rank_dir(launcher.spool, 0)
    rank_dir.mkdir(parents=True)
    (rank_dir / REFUSED_FILE).write_text(json.dumps({"reason": "the initial weights differ (an unseeded script?)"}))
    return launcher


def test_a_job_spanning_hosts_that_asked_to_restart_fails_saying_the_restart_is_not_applied(tmp_path):
    launcher = a_hosts_launcher_whose_rank_refused(tmp_path / "restart", policy="restart")

    with pytest.raises(LaunchError) as refused:
        launcher.resume_refused(0)

    assert "--if-resume-refused restart is not applied to a job spanning hosts" in str(refused.value)
    assert str(refused.value).endswith("the initial weights differ (an unseeded script?)")
    assert not launcher.restarted and launcher.ranks == []
    # A job that did not ask to restart fails with the reason alone.
    with pytest.raises(LaunchError) as plain:
        a_hosts_launcher_whose_rank_refused(tmp_path / "fail", policy="fail").resume_refused(0)
    assert str(plain.value) == ("resume refused by the framework engine (rank 0): the initial weights differ "
                                "(an unseeded script?)")
