"""A warm interpreter for tests that run example scripts as subprocesses (``python script.py ...``).

Every such subprocess spends ~6 CPU-s importing torch, transformers, TRL and trl_es before the script's first line.
:class:`WarmPython` starts one interpreter with the environment the scripts share, imports those libraries once, then
forks a child per script: the child runs it as ``python script.py`` (or ``python -m module``) would (``__main__``,
``sys.argv``, its folder first
on ``sys.path``, the working directory, stdout and stderr to their own files, the exit code), so a test reads the same
``returncode``, ``stdout`` and ``stderr``. What an interpreter reads at start-up (``sitecustomize``, the Hugging Face
cache variables) is the server's: scripts that need other start-up environments need another server.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import tempfile

_SERVER = r"""
import json, os, runpy, sys, traceback
import datasets, transformers, trl, trl_es  # what every script imports: once, before the forks
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pids = []
    for copy in job["copies"]:  # one child per copy (the processes of one world run at once)
        pid = os.fork()
        if pid:
            pids.append(pid)
            continue
        code = 1
        try:
            os.chdir(job["cwd"])
            for fd, path in ((1, copy["stdout"]), (2, copy["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            os.environ.update(copy["env"])
            if job["argv"][0] == "-m":  # `python -m module ...`: the working directory first on sys.path
                sys.argv = list(job["argv"][1:])
                sys.path[0] = os.getcwd()
                runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)  # argv[0]: the module's file
            else:
                sys.argv = list(job["argv"])
                sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script.py` sets it
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:  # sys.exit(n) / sys.exit("message"), as the interpreter reports them
            if isinstance(stop.code, int) or stop.code is None:
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pids": pids}), flush=True)
    codes = {}
    while len(codes) < len(pids):
        pid, status = os.wait()
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid]:  # as torchrun: a failed process stops the others (which would wait in a collective)
            for other in set(pids) - set(codes):
                os.kill(other, 15)
    print(json.dumps({"returncodes": [codes[pid] for pid in pids]}), flush=True)
"""


class WarmPython:
    """``run(argv, cwd)`` -> :class:`subprocess.CompletedProcess` of ``python *argv`` (text stdout/stderr), in a child
    forked from one warm interpreter started with ``env``. Use as a context manager (the server stops at exit)."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.server = subprocess.Popen([sys.executable, "-c", _SERVER], env=self.env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)

    def run(self, argv: list[str], cwd, env: dict[str, str] | None = None, timeout: float = 600):
        """Raises ``TimeoutError`` (the server is stopped) after ``timeout`` seconds."""
        return self.run_copies(argv, cwd, [env or {}], timeout)[0]

    def run_ranks(self, argv: list[str], cwd, world: int, env: dict[str, str] | None = None, timeout: float = 600):
        """``python *argv`` as ``world`` processes at once, each with the variables ``torchrun --nproc_per_node
        world`` gives its workers (rank, world, one node, a free ``MASTER_PORT`` on 127.0.0.1): a list of
        :class:`subprocess.CompletedProcess`, rank order. Raises ``TimeoutError`` as :meth:`run`."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        common = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                  "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                  "TORCHELASTIC_RUN_ID": "none"}
        envs = [{**(env or {}), **common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}
                for r in range(world)]
        return self.run_copies(argv, cwd, envs, timeout)

    def run_copies(self, argv: list[str], cwd, envs: list[dict[str, str]], timeout: float = 600):
        """``python *argv`` once per entry of ``envs`` (its variables set), all at once; their
        :class:`subprocess.CompletedProcess` in that order."""
        with tempfile.TemporaryDirectory() as folder:
            copies = [{"env": env, "stdout": os.path.join(folder, f"stdout{i}"),
                       "stderr": os.path.join(folder, f"stderr{i}")} for i, env in enumerate(envs)]
            job = {"argv": [str(a) for a in argv], "cwd": str(cwd), "copies": copies}
            self.server.stdin.write(json.dumps(job) + "\n")
            self.server.stdin.flush()
            started = self.server.stdout.readline()  # the children's pids, at once
            if not started:
                raise RuntimeError(f"the warm interpreter died before {argv} (exit code {self.server.poll()})")
            ready, _, _ = select.select([self.server.stdout], [], [], timeout)
            if not ready:
                for pid in json.loads(started)["pids"]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                self.close()
                raise TimeoutError(f"{argv} did not finish in {timeout} s")
            reply = self.server.stdout.readline()
            if not reply:
                raise RuntimeError(f"the warm interpreter died running {argv} (exit code {self.server.poll()})")
            results = []
            for copy, code in zip(copies, json.loads(reply)["returncodes"], strict=True):
                with open(copy["stdout"]) as f_out, open(copy["stderr"]) as f_err:
                    results.append(subprocess.CompletedProcess(argv, code, f_out.read(), f_err.read()))
            return results

    def close(self):
        if self.server.poll() is None:
            self.server.kill()
            self.server.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class WarmSubprocess:
    """A stand-in for the ``subprocess`` module of code that runs ``subprocess.run([sys.executable, script, ...],
    env=..., check=...)`` (monkeypatched over that module's ``subprocess``): each such command runs as a child of
    ``warm`` in the current working directory, with ``env`` (default: this process's environment) applied; the
    commands run are kept in ``commands``. Any other command is refused (AssertionError)."""

    CalledProcessError = subprocess.CalledProcessError

    def __init__(self, warm: WarmPython):
        self.warm, self.commands = warm, []

    def run(self, cmd, env=None, check=False, timeout: float = 600):
        cmd = [str(c) for c in cmd]
        self.commands.append(cmd)
        assert cmd[0] == sys.executable, f"not a plain python command: {cmd}"
        proc = self.warm.run(cmd[1:], cwd=os.getcwd(), env=dict(os.environ if env is None else env), timeout=timeout)
        if check and proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc
