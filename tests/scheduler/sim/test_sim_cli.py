"""The command line prints the table and writes a self-contained HTML report."""
import json
import re

from scheduler.sim.__main__ import main

ROWS = [
    ("2017-10-09 06:00:00", 600.0, 2), ("2017-10-09 06:01:00", 60.0, 1),
    ("2017-10-09 06:02:00", 1200.0, 8), ("2017-10-09 06:03:00", 30.0, 1),
    ("2017-10-09 06:04:00", 900.0, 4), ("2017-10-09 06:05:00", 45.0, 2),
]


def write_csv(path):
    lines = ["timestamp,duration,num_gpus,gpu_time,cluster"]
    lines += [f"{t},{d},{g},{d * g},team{i % 2}" for i, (t, d, g) in enumerate(ROWS)]
    path.write_text("\n".join(lines) + "\n")


def test_cli_prints_a_row_per_policy_and_writes_report_and_json(tmp_path, capsys):
    csv_path = tmp_path / "jobs.csv"
    write_csv(csv_path)
    report = tmp_path / "report.html"
    summary = tmp_path / "summary.json"
    code = main(["--trace", str(csv_path), "--fleet", "philly", "--policies", "fifo,tiresias,gandiva,meridian",
                 "--report", str(report), "--json", str(summary)])
    assert code == 0
    out = capsys.readouterr().out
    for name in ("fifo", "tiresias", "gandiva", "meridian"):
        assert re.search(rf"^\s*{name}\s+6\s", out, re.M), out
    page = report.read_text()
    assert "Job completion time (CDF)" in page
    assert not re.search(r"<script[^>]+src=", page)  # plotly.js is inline, no CDN
    data = json.loads(summary.read_text())
    assert [s["policy"] for s in data["summaries"]] == ["fifo", "tiresias", "gandiva", "meridian"]
    assert all(s["finished"] == 6 for s in data["summaries"])


def test_cli_rejects_an_unknown_policy_with_a_clear_message(tmp_path, capsys):
    csv_path = tmp_path / "jobs.csv"
    write_csv(csv_path)
    assert main(["--trace", str(csv_path), "--policies", "fifo,slurm"]) == 2
    assert "unknown policy 'slurm'" in capsys.readouterr().err


def test_cli_rejects_a_negative_premium_reserve(tmp_path, capsys):
    csv_path = tmp_path / "jobs.csv"
    write_csv(csv_path)
    assert main(["--trace", str(csv_path), "--policies", "meridian", "--premium-reserve", "-1"]) == 2
    assert "--premium-reserve must be >= 0" in capsys.readouterr().err
