"""The fake SGLang server (dfq_testing/fake_sglang.py) as a process of its own on loopback: killed, and another
started on the same port with other weights, it is a server restarted behind the same URL; faults are set through
its `POST /fake/faults`. It dies with the process that started it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from dfq_testing.servers import _die_with_parent, free_port

START_TIMEOUT_S = 120


class FakeSglangProcess:
    def __init__(
        self, tokenizer: Path, log: Path, *, port: int | None = None, weights: str = "", noise: float = 0.0,
        logprob_shift: float = 0.0, tokenize: bool = True,
    ) -> None:
        self.tokenizer, self.log = tokenizer, log
        self.port = port or free_port()
        self.weights, self.noise, self.logprob_shift, self.tokenize = weights, noise, logprob_shift, tokenize
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "dfq_testing.fake_sglang", "--tokenizer", str(self.tokenizer),
            "--port", str(self.port), "--weights", self.weights, "--noise", str(self.noise),
            "--logprob-shift", str(self.logprob_shift), *([] if self.tokenize else ["--no-tokenize"]),
        ]

    def start(self) -> FakeSglangProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the fake SGLang server exited while starting:\n{self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"the fake SGLang server is not up after {START_TIMEOUT_S} s")

    def kill(self) -> None:
        """SIGKILL, as a crash would: connections in flight break."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def replaced(self, **settings: Any) -> FakeSglangProcess:
        """Kill this server and start another on its port (the same URL) with `settings` changed."""
        self.kill()
        current = {"weights": self.weights, "noise": self.noise, "logprob_shift": self.logprob_shift,
                   "tokenize": self.tokenize}
        return FakeSglangProcess(self.tokenizer, self.log, port=self.port, **{**current, **settings}).start()

    def set_faults(self, **faults: Any) -> None:
        self._call("/fake/faults", faults)

    def switch_weights(self, weights: str) -> None:
        """Other weights from the next request on, on the same URL and without a restart (a balancer now routing to
        a replica that runs them)."""
        self._call("/fake/weights", {"weights": weights})
        self.weights = weights

    def generate_requests(self) -> int:
        return int(self._call("/fake/stats")["generate_requests"])

    def _call(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())
