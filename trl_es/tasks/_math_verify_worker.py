"""The helper process behind :func:`trl_es.tasks.gsm.math_verify_equal`: math-verify in its own main thread.

Protocol, one JSON object per line: ``{"ready": true}`` first, then ``{"equal": bool}`` for each request
``{"gold": str, "pred": str, "timeout": int}`` read from stdin; the worker exits when stdin closes.
"""

import json
import logging
import os
import sys


def _equal(gold: str, pred: str, seconds: int) -> bool:
    from math_verify import parse, verify

    gold_parsed = parse(gold, parsing_timeout=seconds)  # SIGALRM limits: this is the main thread, so they work
    pred_parsed = parse(pred, parsing_timeout=seconds)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=seconds))


def main() -> None:
    # Replies go to a private copy of stdout; anything a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8", buffering=1)
    sys.stdout = sys.stderr
    logging.disable(logging.CRITICAL)
    import math_verify  # noqa: F401  (import before announcing readiness: the first request is then fast)

    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:  # until stdin closes: the parent is gone
        try:
            request = json.loads(line)
            equal = _equal(str(request["gold"]), str(request["pred"]), max(1, int(request.get("timeout", 1))))
        except Exception:  # noqa: BLE001  (any failure to parse or compare: not equal)
            equal = False
        replies.write(json.dumps({"equal": equal}) + "\n")


if __name__ == "__main__":
    main()
