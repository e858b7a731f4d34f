"""`python -m dfq_testing.process_report CODE`: print what this process was given (argv, working directory,
environment, session, what was imported before it ran) as one JSON line, then exit with CODE, or wait for a
signal when CODE is "wait". The fork server's tests compare it with what they asked for."""

import json
import os
import select
import signal
import sys

print(json.dumps({
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "pid": os.getpid(),
    "session": os.getsid(0),
    "stdin": os.read(0, 16).decode(errors="replace") if select.select([0], [], [], 0)[0] else None,
    "torch_imported": "torch" in sys.modules,
    "main": sys.modules["__main__"].__spec__.name,
}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "wait":
    signal.pause()
sys.exit(int(sys.argv[1]))
