"""`furlong serve` as a process: it prints its base URL, serves the OpenAI API there, and exits 0
on SIGINT and on SIGTERM; a bad model directory exits 2 naming it."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading

import openai
import pytest
from gateway_models import write_random_dir
from polling import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVE = [sys.executable, "-m", "furlong.controller.cli", "serve"]


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_dir(tmp_path_factory.mktemp("serve") / "model")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serve_prints_its_url_serves_and_stops_on_a_signal(model_dir, signum):
    proc = subprocess.Popen(
        SERVE
        + ["--model", str(model_dir), "--port", "0", "--served-model-name", "tiny", "--num-threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    try:

        def url_line() -> str | None:
            if proc.poll() is not None:
                raise AssertionError(f"furlong serve exited {proc.returncode}: {proc.stderr.read()}")
            try:
                return lines.get_nowait()
            except queue.Empty:
                return None

        line = wait_until(url_line, timeout_s=90, what="furlong serve's URL line")
        assert line.startswith("furlong serve: tiny on http://127.0.0.1:") and line.rstrip().endswith("/v1")
        base_url = line.split(" on ", 1)[1].strip()
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["tiny"]
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
            )
            assert reply.choices[0].finish_reason in ("stop", "length")
            assert reply.model_extra["furlong"]["policy_version"] == 0
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_a_bad_model_directory(tmp_path):
    missing = tmp_path / "nowhere"
    done = subprocess.run(SERVE + ["--model", str(missing)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert str(missing) in done.stderr and done.stderr.startswith("furlong serve:")
    bad_port = subprocess.run(
        SERVE + ["--model", str(missing), "--port", "70000"], capture_output=True, text=True, timeout=120
    )
    assert bad_port.returncode == 2 and "--port" in bad_port.stderr
