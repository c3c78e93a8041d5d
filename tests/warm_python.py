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

import json
import os
import select
import subprocess
import sys
import tempfile

_SERVER = r"""
import json, os, runpy, sys, traceback
import datasets, transformers, trl, trl_es  # what every script imports: once, before the forks
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(job["cwd"])
            for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            os.environ.update(job["env"])
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
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
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
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            job = {"argv": [str(a) for a in argv], "cwd": str(cwd), "stdout": out, "stderr": err, "env": env or {}}
            self.server.stdin.write(json.dumps(job) + "\n")
            self.server.stdin.flush()
            started = self.server.stdout.readline()  # the child's pid, at once
            if not started:
                raise RuntimeError(f"the warm interpreter died before {argv} (exit code {self.server.poll()})")
            ready, _, _ = select.select([self.server.stdout], [], [], timeout)
            if not ready:
                os.kill(json.loads(started)["pid"], 9)
                self.close()
                raise TimeoutError(f"{argv} did not finish in {timeout} s")
            reply = self.server.stdout.readline()
            if not reply:
                raise RuntimeError(f"the warm interpreter died running {argv} (exit code {self.server.poll()})")
            with open(out) as f_out, open(err) as f_err:
                return subprocess.CompletedProcess(argv, json.loads(reply)["returncode"], f_out.read(), f_err.read())

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
