"""Several processes as one job (issue #25), on 127.0.0.1: two CPU processes of 2 devices each
(tests/multihost_worker.py), JAX's CPU collectives across them (gloo, JAX 0.11.2's default).

The 2-process runs compile every program in both processes on the shared CI cores (a minute
or more), so they are marked slow; the launcher's and the job flags' bad inputs run by
default."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxspec import generate, load
from jaxspec.cli import main
from jaxspec.errors import OptionError
from jaxspec.launch import ended, free_port
from tests.multihost_worker import NEW, PROMPTS

ROOT = pathlib.Path(__file__).resolve().parents[1]

# the suite's own variables, kept when a test clears a job's (its home; the compile cache off)
KEEP_ENV = ("JAXSPEC_SUPERVISED", "JAXSPEC_HOME", "JAXSPEC_COMPILE_CACHE")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXSPEC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _start(case, pid, port, folder, out, timeout=30, n=None):
    argv = [case, f"127.0.0.1:{port}", str(pid), str(folder), str(out), str(timeout)]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.multihost_worker", *argv],
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _pair(case, folder, tmp, timeout=30):
    port = free_port(None)
    outs = [tmp / f"{case}{k}.json" for k in range(2)]
    return [_start(case, k, port, folder, outs[k], timeout) for k in range(2)], outs


def _finish(procs, limit_s):
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=limit_s)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0].decode(errors="replace"))
            pytest.fail(f"a worker ran past {limit_s} s:\n{logs[-1][-3000:]}")
    return logs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multihost")
    r = subprocess.run(
        [sys.executable, "-m", "tests.multihost_worker", "write", str(folder)],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return folder


@pytest.mark.slow
def test_target_mesh_over_two_processes_gives_single_process_tokens(checkpoints, tmp_path):
    """TP=4 over both processes: autoregressive, chain and tree return exactly the greedy
    tokens of one process on one device; SwiftSpec with the target on process 0's devices and
    the draft on process 1's too. Both processes return them."""
    want = generate(
        load(checkpoints / "target"), PROMPTS, method="autoregressive", max_new_tokens=NEW
    ).tokens
    procs, outs = _pair("engines", checkpoints, tmp_path)
    logs = _finish(procs, 600)
    for k, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"process {k}:\n{log[-3000:]}"
    for k, out in enumerate(outs):
        got = json.loads(out.read_text())
        assert got["local"] == [d for d in got["devices"] if (d >= 2048) == (k == 1)]
        assert got["target_devices"] == sorted(got["devices"])  # the mesh spans both
        for method in ("autoregressive", "chain", "tree", "swiftspec"):
            assert got[method] == want, (k, method)
        assert got["swiftspec_split"] == [2, 2]


@pytest.mark.slow
def test_killed_process_raises_in_the_other_within_the_timeout(checkpoints, tmp_path):
    timeout = 5
    procs, outs = _pair("killed", checkpoints, tmp_path, timeout)
    end = time.monotonic() + 300
    while not outs[1].exists():
        assert procs[1].poll() is None and time.monotonic() < end, _finish(procs, 30)
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    log = _finish(procs[:1], 120)[0]
    took = time.monotonic() - killed_at
    procs[1].wait()
    # the key-value wait gives a WorkerError; JAX's heartbeats may abort the process first
    assert procs[0].returncode in (2, -signal.SIGABRT), log[-3000:]
    if procs[0].returncode == 2:
        kind, message = json.loads(outs[0].read_text())["error"]
        assert kind == "WorkerError" and "process 1 did not reach" in message
    assert took < timeout + 30, took


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,kind,match",
    [
        ("processes", "OptionError", "disagree on --num-processes.*process 1: 3"),
        ("checkpoint", "CheckpointError", "disagree on the checkpoint.*target.*draft"),
    ],
)
def test_mismatch_between_processes_is_an_error_in_each(checkpoints, tmp_path, case, kind, match):
    procs, outs = _pair(case, checkpoints, tmp_path, 10)
    logs = _finish(procs, 300)
    for out, log in zip(outs, logs, strict=True):
        assert out.exists(), log[-3000:]
        got_kind, message = json.loads(out.read_text())["error"]
        assert got_kind == kind, message
        assert re.search(match, message), message


# ------------------------------------------------------------------ the launcher's bad inputs


@pytest.mark.parametrize(
    "argv,match",
    [
        (["launch", "-n", "0", "--", "generate", "x"], "-n must be at least 1"),
        (["launch", "-n", "2", "--", "convert", "a", "b"], "runs generate or bench"),
        (["launch", "-n", "2"], "got nothing"),
        (["launch", "-n", "2", "--", "generate", "x", "--process-id", "1"], "sets --process-id"),
        (["launch", "-n", "2", "--timeout", "0", "--", "generate", "x"], "at least 1 second"),
        (["launch", "-n", "2", "--port", "70000", "--", "generate", "x"], r"\[1, 65535\]"),
        (["generate", "x", "--num-processes", "2", "--process-id", "2", "--coordinator",
          "127.0.0.1:1234"], r"--process-id must be in \[0, 1\]"),
        (["generate", "x", "--num-processes", "2", "--process-id", "-1", "--coordinator",
          "127.0.0.1:1234"], r"--process-id must be in \[0, 1\]"),
        (["generate", "x", "--num-processes", "0", "--process-id", "0", "--coordinator",
          "127.0.0.1:1234"], "--num-processes must be an integer >= 1"),
        (["generate", "x", "--num-processes", "2", "--process-id", "0", "--coordinator",
          "localhost"], "--coordinator takes HOST:PORT"),
        (["generate", "x", "--num-processes", "2"], "--coordinator, --process-id missing"),
        (["generate", "x", "--timeout", "5"], "--timeout applies to a distributed job"),
        (["bench", "--budget-s", "9", "--num-processes", "2", "--process-id", "0",
          "--coordinator", "127.0.0.1:1234"], "--budget-s stops by the clock"),
        (["generate", "x", "--model", "/nonexistent", "--tp", "99"], r"--tp must be in \[1, \d+\]"),
    ],
)  # fmt: skip
def test_job_bad_inputs(argv, match, capsys, monkeypatch):
    for k in list(os.environ):  # the job's variables; the suite's home and cache setting stay
        if k.startswith("JAXSPEC_") and k not in KEEP_ENV:
            monkeypatch.delenv(k)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err


def test_job_from_environment_variables(capsys, monkeypatch):
    monkeypatch.setenv("JAXSPEC_NUM_PROCESSES", "two")
    assert main(["generate", "x"]) == 2
    assert "JAXSPEC_NUM_PROCESSES must be int, got 'two'" in capsys.readouterr().err


def test_launcher_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OptionError, match=f"port {port} on 127.0.0.1 is in use"):
            free_port(port)
        assert main(["launch", "-n", "2", "--port", str(port), "--", "generate", "x"]) == 2


def test_an_ended_process_is_told_in_words():
    assert "ended by JAX's distributed runtime" in ended(1, -signal.SIGABRT, 5.0)
    assert "within --timeout 5 s" in ended(1, -signal.SIGABRT, 5.0)
    assert ended(0, -signal.SIGKILL, 5.0) == "process 0 was killed by SIGKILL."
    assert ended(1, 3, 5.0) == "process 1 failed with exit code 3."


@pytest.mark.slow
def test_launch_runs_generate_as_two_processes_and_only_process_0_prints(checkpoints):
    """``jaxspec launch -n 2 -- generate ... --tp 4``: the target over both processes, one
    answer printed, the same as one process on one device prints."""
    words = "w5 w9 w14 w3 w27 w9 w14 w3 w27 w40 w8"
    gen = ["generate", words, "--raw", "--model", str(checkpoints / "target")]
    gen += ["--max-new-tokens", "8", "--method", "chain", "--draft", "ngram"]
    cli = [sys.executable, "-m", "jaxspec.cli"]
    env = {**_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    one = subprocess.run([*cli, *gen], env=env, cwd=ROOT, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    launch = ["launch", "-n", "2", "--devices-per-process", "2", "--timeout", "30", "--"]
    two = subprocess.run(
        [*cli, *launch, *gen, "--tp", "4"], env=_env(), cwd=ROOT, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.strip()
    assert two.stderr.count("[chain] 8 tokens in") == 1, two.stderr[-3000:]


@pytest.mark.slow
def test_a_process_that_never_joins_is_a_worker_error_within_the_timeout(checkpoints):
    """``jaxspec generate --coordinator ...`` started as process 0 of 2 with no process 1: its
    supervisor reports JAX's abort as a ``WorkerError`` (``error: ...``, exit code 2)."""
    job = ["--coordinator", f"127.0.0.1:{free_port(None)}", "--num-processes", "2"]
    job += ["--process-id", "0", "--timeout", "5"]
    gen = ["generate", "w5 w9", "--raw", "--model", str(checkpoints / "target"), *job]
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "jaxspec.cli", *gen], env=_env(), cwd=ROOT, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: process 0 was ended by JAX's distributed runtime"), last
    assert r.stdout == "" and took < 5 + 60, took
