"""``sweeps run``'s workers are forked from a fork server that imported what trials use
(sweeps.backends.worker_forkserver). Real processes: a small driver script (run in its own session,
so that a signal to its group never reaches pytest) starts the server and forks workers; the pause
points make the signal tests deterministic (the process stops itself once its handlers are set,
and stays stopped until it is sent SIGCONT).

The contract: a worker reads its go on its pipe (EOF is a clean stop, exit 0); until its go,
SIGINT, SIGTERM and SIGHUP end it quietly (128 + n), as they end the server while it imports;
a signal to the whole process group ends the waiting workers, never the server; the server and
its workers die with the driver, SIGKILL included; the worker's environment is the one it was
forked with; ``ps`` tells the server and each worker apart."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.sweeps.study_helpers import sweeps_env

pytestmark = pytest.mark.slow  # each test starts a fork server, which imports torch and MLflow

# The driver's helpers: fork a worker; wait until a process has stopped itself at a pause point
# (a state that lasts until SIGCONT: no race); stop it with a signal; report as JSON lines.
PRELUDE = textwrap.dedent("""
    import json, os, signal, sys, time
    import psutil
    from sweeps.backends import worker_forkserver

    def say(**kw):
        print(json.dumps(kw), flush=True)

    def stopped(proc):
        while proc.status() != psutil.STATUS_STOPPED:
            time.sleep(0.05)

    def paused_server():
        while True:  # named before it pauses; listed once it has stopped
            found = [p for p in psutil.Process().children() if p.name() == "sweeps-forksrv"]
            if found and found[0].status() == psutil.STATUS_STOPPED:
                return found[0]
            time.sleep(0.05)

    def interrupt(pid, signum):
        os.kill(pid, signum)  # pending while it is stopped, as a terminal's Ctrl-C would be
        os.kill(pid, signal.SIGCONT)
""")


def _drive(script: str, timeout: float = 600, **env: str) -> tuple[list[dict], str]:
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(script)], env=sweeps_env(**env),
                          capture_output=True, text=True, timeout=timeout, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()], proc.stderr


def test_a_worker_waits_for_its_go_and_stops_at_eof_and_ps_tells_it_from_the_server():
    (seen,), err = _drive("""
        worker_forkserver.start()
        w = worker_forkserver.fork_worker({**os.environ, "SWEEPS_PAUSE": "worker_before_go"}, 3)
        me = psutil.Process(w.pid)
        stopped(me)  # ready for its go: named by now
        server = psutil.Process(me.ppid())
        names = (me.name(), server.name(), server.ppid() == os.getpid())
        waiting = w.poll()
        w.stdin.close()  # EOF instead of a go: the driver stopped before sending it
        os.kill(w.pid, signal.SIGCONT)
        say(names=names, waiting=waiting, code=w.wait(600))
    """)
    assert seen == {"names": ["sweeps-worker-3", "sweeps-forksrv", True], "waiting": None, "code": 0}
    assert "Traceback" not in err, err


def test_before_its_go_a_stop_signal_ends_a_worker_quietly_and_a_group_signal_spares_the_server():
    """Each worker stops itself at ``worker_before_go`` (its own environment says so: the server's
    does not, so this also shows a worker takes the environment it is forked with), then gets one
    stop signal. A SIGTERM to the whole process group then ends the workers waiting for their go,
    and the server forks the next worker as before."""
    lines, err = _drive("""
        worker_forkserver.start()
        for i, signum in enumerate((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
            w = worker_forkserver.fork_worker({**os.environ, "SWEEPS_PAUSE": "worker_before_go"}, i)
            stopped(psutil.Process(w.pid))
            interrupt(w.pid, signum)
            say(signal=int(signum), code=w.wait(600))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the driver has its own handler; not under test here
        waiting = [worker_forkserver.fork_worker(dict(os.environ), i) for i in range(2)]
        os.killpg(0, signal.SIGTERM)
        say(group=[w.wait(600) for w in waiting])
        after = worker_forkserver.fork_worker(dict(os.environ), 2)
        after.stdin.close()
        say(after=after.wait(600))
    """)
    assert lines[:3] == [{"signal": int(s), "code": 128 + s}
                         for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
    assert lines[3:] == [{"group": [128 + signal.SIGTERM] * 2}, {"after": 0}]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_ctrl_c_while_the_server_imports_ends_it_quietly():
    """``SWEEPS_PAUSE=worker_importing`` stops the server with its quiet handlers set, before it
    imports anything; the driver is its parent and reads its exit status."""
    (seen,), err = _drive("""
        worker_forkserver.start()
        server = paused_server()
        interrupt(server.pid, signal.SIGINT)
        _, status = os.waitpid(server.pid, 0)
        say(code=os.waitstatus_to_exitcode(status))
    """, SWEEPS_PAUSE="worker_importing")
    assert seen == {"code": 128 + signal.SIGINT}
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_server_that_exits_while_a_worker_is_asked_for_is_reported_and_the_next_ask_starts_another():
    """The driver asks for a worker while the server imports, and a Ctrl-C ends the server: the
    ask fails with a clear error (the supervisor then starts nothing, since the driver has the
    signal too); the next ask starts a fresh server."""
    lines, err = _drive("""
        import threading
        worker_forkserver.start()
        del os.environ["SWEEPS_PAUSE"]  # the first server's only
        threading.Thread(target=lambda: interrupt(paused_server().pid, signal.SIGINT)).start()
        try:
            worker_forkserver.fork_worker(dict(os.environ), 0)
        except worker_forkserver.ServerGone as exc:
            say(gone=str(exc))
        w = worker_forkserver.fork_worker(dict(os.environ), 1)
        w.stdin.close()
        say(code=w.wait(600))
    """, SWEEPS_PAUSE="worker_importing")
    assert lines[0]["gone"].startswith("the fork server of the workers exited before it forked worker 0")
    assert lines[1:] == [{"code": 0}]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_worker_whose_server_is_killed_reads_as_killed_and_the_next_fork_starts_a_new_server():
    """The OOM killer picks the server: its workers die with it (SIGKILL), which the driver reads as
    their exit status (so their trials are requeued as after any kill), not as an exit with an
    error; the next worker asked for comes from a new server."""
    (seen,), err = _drive("""
        worker_forkserver.start()
        w = worker_forkserver.fork_worker({**os.environ, "SWEEPS_PAUSE": "worker_before_go"}, 0)
        me = psutil.Process(w.pid)
        stopped(me)
        server = psutil.Process(me.ppid())
        server.kill()
        code = w.wait(600)
        after = worker_forkserver.fork_worker({**os.environ, "SWEEPS_PAUSE": "worker_before_go"}, 1)
        stopped(psutil.Process(after.pid))
        new_server = psutil.Process(after.pid).ppid() != server.pid
        after.stdin.close()
        os.kill(after.pid, signal.SIGCONT)
        say(code=code, polled=w.poll(), after=after.wait(600), new_server=new_server)
    """)
    assert seen == {"code": -signal.SIGKILL, "polled": -signal.SIGKILL, "after": 0, "new_server": True}


def test_the_server_and_its_workers_die_with_the_driver_even_by_sigkill():
    driver = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent("""
        worker_forkserver.start()
        # Busy (stopped at a pause point): they would not notice the driver's end by themselves.
        workers = [worker_forkserver.fork_worker({**os.environ, "SWEEPS_PAUSE": "worker_before_go"}, i)
                   for i in range(2)]
        for w in workers:
            stopped(psutil.Process(w.pid))
        say(workers=[w.pid for w in workers])
        sys.stdin.readline()  # until the test kills this driver
    """)], env=sweeps_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert driver.stdout is not None
        pids = json.loads(driver.stdout.readline())["workers"]
        workers = [psutil.Process(pid) for pid in pids]
        server = psutil.Process(workers[0].ppid())
        assert server.name() == "sweeps-forksrv" and server.ppid() == driver.pid
        driver.send_signal(signal.SIGKILL)
        driver.wait(60)
        _, alive = psutil.wait_procs([server, *workers], timeout=120)  # PR_SET_PDEATHSIG: at once
        assert alive == []
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_a_worker_forked_after_the_drivers_directory_changed_works_there(tmp_path):
    """The server started in one folder; a worker forked later runs in the driver's folder then
    (a study's runs/ is relative to it)."""
    (seen,), _ = _drive(f"""
        worker_forkserver.start()
        os.chdir({str(tmp_path)!r})
        w = worker_forkserver.fork_worker({{**os.environ, "SWEEPS_PAUSE": "worker_before_go"}}, 0)
        stopped(psutil.Process(w.pid))  # ready for its go: it has taken the driver's folder
        cwd = psutil.Process(w.pid).cwd()
        w.stdin.close()
        os.kill(w.pid, signal.SIGCONT)
        say(cwd=cwd, code=w.wait(600))
    """)
    assert seen == {"cwd": str(tmp_path), "code": 0}


def test_the_server_starts_without_waiting_for_its_imports():
    """``start`` returns while the server is stopped before its imports (it would never return if it
    waited for them); forking a worker waits for them."""
    (seen,), _ = _drive("""
        worker_forkserver.start()
        server = paused_server()
        torch_before = any("libtorch" in m.path for m in server.memory_maps())
        os.kill(server.pid, signal.SIGCONT)
        w = worker_forkserver.fork_worker(dict(os.environ), 0)
        torch_after = any("libtorch" in m.path for m in server.memory_maps())
        w.stdin.close()
        say(before=torch_before, after=torch_after, code=w.wait(600))
    """, SWEEPS_PAUSE="worker_importing")
    assert seen == {"before": False, "after": True, "code": 0}


def test_a_kept_server_forks_the_workers_of_each_study_with_that_drivers_output(tmp_path):
    """Kept between two studies (kept_between_studies), one server forks the workers of both, each
    writing where the driver's standard output and error point at its fork (a notebook or a test
    that redirects them between studies); the server ends with the scope."""
    (seen,), _ = _drive(f"""
        servers, outputs = set(), []
        with worker_forkserver.kept_between_studies():
            for i in range(2):
                with worker_forkserver.running(), open(os.path.join({str(tmp_path)!r}, f"out{{i}}"), "w") as out:
                    saved = os.dup(1), os.dup(2)
                    os.dup2(out.fileno(), 1)
                    os.dup2(out.fileno(), 2)
                    try:
                        w = worker_forkserver.fork_worker({{**os.environ, "SWEEPS_PAUSE": "worker_before_go"}}, i)
                    finally:
                        os.dup2(saved[0], 1)
                        os.dup2(saved[1], 2)
                    stopped(psutil.Process(w.pid))  # ready for its go
                    servers.add(psutil.Process(w.pid).ppid())
                    outputs.append([os.readlink(f"/proc/{{w.pid}}/fd/{{fd}}") for fd in (1, 2)])
                    w.stdin.close()
                    os.kill(w.pid, signal.SIGCONT)
                    assert w.wait(600) == 0
        (server,) = servers
        say(outputs=outputs, server_gone=not psutil.pid_exists(server))
    """)
    assert seen == {"outputs": [[str(tmp_path / f"out{i}")] * 2 for i in range(2)], "server_gone": True}
