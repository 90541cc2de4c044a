"""Several processes as one job (issue #25), on 127.0.0.1: two CPU processes of 2 devices each
(tests/multihost_worker.py), JAX's CPU collectives across them (gloo, JAX 0.11.2's default).

These run in the default suite (CI). What a 2-process test costs is its processes: each one
imports JAX and compiles every program it runs (the same ones in both). So one job
(``test_one_job_over_two_processes``) checks the engines, a checkpoint that differs between the
processes and a killed process; the single-process reference runs in the test's own process
while the job compiles; the command-line tests run ``jaxspec launch`` and the supervisor in the
test's process, so that only the job's processes are started."""

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
from jaxspec.launch import ended, free_port, is_gloo
from tests.multihost_worker import NEW, PROMPTS, write_checkpoints

ROOT = pathlib.Path(__file__).resolve().parents[1]

# the suite's own variables, kept when a test clears a job's (its home; the compile cache off)
SUITE_ENV = ("JAXSPEC_HOME", "JAXSPEC_COMPILE_CACHE")
# the job's --timeout in the 2-process job (join, heartbeats, the checks' waits): a kill costs
# about this much; the job's checks meet right after a collective, so its processes never drift
# this far apart
TIMEOUT = 10


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXSPEC_") or k in SUITE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _in_process(monkeypatch) -> None:
    """For a command run by ``main`` here that starts job processes: no job variables, and the
    processes it starts import this checkout (they run ``python -m jaxspec.cli``)."""
    for k in list(os.environ):
        if k.startswith("JAXSPEC_") and k not in SUITE_ENV:
            monkeypatch.delenv(k)
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    monkeypatch.chdir(ROOT)


def _pair(case, folder, tmp, timeout):
    """The two processes of a job running ``tests.multihost_worker CASE``, their output in
    files (a pipe nobody reads could fill and stop a process), and their OUT files."""
    port = free_port(None)
    outs = [tmp / f"{case}{k}.json" for k in range(2)]
    procs = []
    for k in range(2):
        argv = [case, f"127.0.0.1:{port}", str(k), str(folder), str(outs[k]), str(timeout)]
        cmd = [sys.executable, "-m", "tests.multihost_worker", *argv]
        log = tmp / f"{case}{k}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        p.log = log
        procs.append(p)
    return procs, outs


def _log(p) -> str:
    return p.log.read_text(errors="replace")[-3000:]


def _finish(procs, limit_s) -> None:
    """Wait for every process; kill them all and fail if one runs past ``limit_s``."""
    end = time.monotonic() + limit_s
    for k, p in enumerate(procs):
        try:
            p.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _kill(procs)
            pytest.fail(f"process {k} ran past {limit_s} s:\n{_log(p)}")


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multihost")
    write_checkpoints(folder)
    return folder


def test_one_job_over_two_processes(checkpoints, tmp_path):
    """One job of 2 processes (the worker's CASE ``job``):

    - TP=4 over both processes: autoregressive, chain and tree return exactly the greedy tokens
      of one process on one device, and so does SwiftSpec with the target on process 0's
      devices and the draft on process 1's; both processes return them;
    - a checkpoint that differs between the processes is a CheckpointError in each, naming both;
    - process 1 killed, process 0 raises within the timeout and the test ends in bounded time.
    """
    procs, outs = _pair("job", checkpoints, tmp_path, TIMEOUT)
    try:
        # the single-process reference, in this process while the job's processes compile
        want = generate(
            load(checkpoints / "target"), PROMPTS, method="autoregressive", max_new_tokens=NEW
        ).tokens
        end = time.monotonic() + 300
        while not all(out.exists() for out in outs):
            for k, p in enumerate(procs):
                assert p.poll() is None, f"process {k} ended ({p.returncode}):\n{_log(p)}"
            assert time.monotonic() < end, f"no results within 300 s:\n{_log(procs[0])}"
            time.sleep(0.05)
        # process 0 now waits in a check that process 1 will never reach: kill it there
        assert procs[0].poll() is None, f"process 0 ended before the kill:\n{_log(procs[0])}"
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _finish(procs[:1], 120)
        took = time.monotonic() - killed_at
        procs[1].wait()
    finally:
        _kill(procs)
    got = [json.loads(out.read_text()) for out in outs]
    for k, g in enumerate(got):
        assert g["local"] == [d for d in g["devices"] if (d >= 2048) == (k == 1)]
        assert g["target_devices"] == sorted(g["devices"])  # the mesh spans both
        for method in ("autoregressive", "chain", "tree", "swiftspec"):
            assert g[method] == want, (k, method)
        assert g["swiftspec_split"] == [2, 2]
        assert g["checkpoint_error"], f"process {k} loaded another checkpoint than process 0's"
        kind, message = g["checkpoint_error"]
        assert kind == "CheckpointError", message
        assert re.search("disagree on the checkpoint.*target.*draft", message), message
    # the key-value wait gives a WorkerError; JAX's heartbeats may abort the process first
    assert procs[0].returncode in (2, -signal.SIGABRT), _log(procs[0])
    if procs[0].returncode == 2:
        kind, message = got[0]["error"]
        assert kind == "WorkerError" and "process 1 did not reach" in message, message
        assert got[0]["waited_s"] < TIMEOUT + 5, got[0]["waited_s"]
    assert took < TIMEOUT + 30, took


def test_a_different_process_count_is_an_error_in_each(tmp_path):
    procs, outs = _pair("processes", tmp_path, tmp_path, TIMEOUT)
    _finish(procs, 120)
    for p, out in zip(procs, outs, strict=True):
        assert out.exists(), _log(p)
        kind, message = json.loads(out.read_text())["error"]
        assert kind == "OptionError", message
        assert re.search("disagree on --num-processes.*process 1: 3", message), message


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
        if k.startswith("JAXSPEC_") and k not in SUITE_ENV:
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


def test_the_relay_drops_gloos_connection_lines_whole_or_torn():
    """gloo reports its connections on stdout from several threads, so one line can lose its
    "[Gloo] Rank n" to another (seen in CI); neither may reach the printed answer."""
    torn = b"[Gloo] Rank 0[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of "
    torn += b"connected peer ranks is : 3\n"
    rest = b" is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
    assert is_gloo(torn) and is_gloo(rest)
    assert is_gloo(b"[Gloo] Rank 2 is connected to 3 peer ranks.\n")
    assert not is_gloo(b"w52 w37 w35 w50 w37 w35 w50 w37\n")
    assert not is_gloo(b"def connected(peer, ranks): ...\n")  # an answer about graphs stays


def test_launch_runs_generate_as_two_processes_and_only_process_0_prints(
    checkpoints, capfd, monkeypatch
):
    """``jaxspec launch -n 2 -- generate ... --tp 4``: the target over both processes, one
    answer printed, the same as one process on one device prints. Both commands run in this
    process (the launcher starts the job's two)."""
    _in_process(monkeypatch)
    words = "w5 w9 w14 w3 w27 w9 w14 w3 w27 w40 w8"
    gen = ["generate", words, "--raw", "--model", str(checkpoints / "target")]
    gen += ["--max-new-tokens", "8", "--method", "chain", "--draft", "ngram"]
    assert main(gen) == 0  # one process, one device
    one = capfd.readouterr()
    launch = ["launch", "-n", "2", "--devices-per-process", "2", "--timeout", "30", "--"]
    assert main([*launch, *gen, "--tp", "4"]) == 0, capfd.readouterr().err[-3000:]
    two = capfd.readouterr()
    assert two.out == one.out and one.out.strip(), (one.out, two.out)
    assert two.err.count("[chain] 8 tokens in") == 1, two.err[-3000:]


def test_a_process_that_never_joins_is_a_worker_error_within_the_timeout(
    checkpoints, capfd, monkeypatch
):
    """``jaxspec generate`` started as process 0 of 2 with no process 1, its job given by the
    ``JAXSPEC_*`` variables (as a scheduler sets them): its supervisor (here, in this process)
    reports JAX's abort of the job process it started as a ``WorkerError`` (``error: ...``,
    exit code 2)."""
    _in_process(monkeypatch)
    timeout = 2
    job = {"COORDINATOR": f"127.0.0.1:{free_port(None)}", "NUM_PROCESSES": "2"}
    job |= {"PROCESS_ID": "0", "TIMEOUT": str(timeout)}
    for k, v in job.items():
        monkeypatch.setenv(f"JAXSPEC_{k}", v)
    t0 = time.monotonic()
    assert main(["generate", "w5 w9", "--raw", "--model", str(checkpoints / "target")]) == 2
    took = time.monotonic() - t0
    r = capfd.readouterr()
    last = r.err.strip().splitlines()[-1]
    assert last.startswith("error: process 0 was ended by JAX's distributed runtime"), r.err
    assert f"within --timeout {timeout} s" in last, last
    assert r.out == "" and took < timeout + 60, took
