"""``tickloom chat`` on a terminal, driven through a pseudo-terminal (Python's ``pty``: nothing to install).

What a person does at the keyboard: type "helo", press Left, type "l", press Enter (readline edits the line, so
the model receives "hello"); press Ctrl-C in the middle of the reply (the request is cancelled, the session goes
on); type another message and get a whole reply; press Ctrl-C at the prompt (chat leaves cleanly, exit 0). The
keys go through the terminal's line discipline, so Ctrl-C is the SIGINT the tty sends, as it is for a person.
What the model received and how each request ended is read back from the engine's log, which must replay.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from tickloom.events import Finish, LogReader, RequestArrived
from tickloom.tools.cli import main

REPO = Path(__file__).resolve().parent.parent
LEFT = b"\x1b[D"
CTRL_C = b"\x03"
ENTER = b"\r"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")


class Terminal:
    """A child process on a pseudo-terminal: ``send`` keys, ``expect`` output (escape sequences kept)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the slave end is its controlling terminal, stdin, stdout and stderr
            try:
                os.chdir(REPO)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        self.output = b""
        self.pos = 0
        self.status: int | None = None

    def send(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.output += data
        return bool(data)

    def expect(self, pattern: bytes, timeout: float = 60.0) -> bytes:
        """Wait for ``pattern`` (a regex) in the output after the previous match; returns the match."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = regex.search(self.output, self.pos)
            if m is not None:
                self.pos = m.end()
                return m.group(0)
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.5)):
                m = regex.search(self.output, self.pos)
                if m is not None:
                    self.pos = m.end()
                    return m.group(0)
                if left <= 0 or self.wait(0.0) is not None:
                    raise AssertionError(f"no {pattern!r} in the output; it ends with\n"
                                         f"{self.output[-1500:].decode(errors='replace')}")

    def wait(self, timeout: float) -> int | None:
        """The exit status once the child has exited (reading its last output), else None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                while self._read(0.1):
                    pass
                break
            if time.monotonic() >= deadline:
                return None
            self._read(0.05)
        return self.status

    def close(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait(10.0)
        os.close(self.fd)


def test_chat_line_editing_and_ctrl_c_on_a_terminal(tmp_path: Path) -> None:
    log = tmp_path / "chat.tlog"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP", "INPUTRC")}
    env.update(TERM="xterm", INPUTRC="/dev/null", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "tickloom", "chat", "--model", "stub", "--stub-step-time", "0.05",
            "--max-tokens", "150", "--temperature", "0", "--seed", "3", "--log", str(log)]
    term = Terminal(argv, env)
    try:
        term.expect(rb"you> ")
        term.send(b"helo")
        term.send(LEFT)
        term.send(b"l")
        term.send(ENTER)
        term.expect(rb"assistant>\x1b\[0m [ -~]{3}")  # some of the reply, which takes 150 steps of 0.05 s
        term.send(CTRL_C)
        term.expect(rb"\(interrupted\)")
        term.expect(rb"you> ")
        term.send(b"again" + ENTER)
        term.expect(rb"assistant>")
        term.expect(rb"you> ", timeout=90)  # the whole reply, then the next prompt
        term.send(CTRL_C)  # at the prompt: leave
        assert term.wait(60) == 0, term.output.decode(errors="replace")
    finally:
        term.close()
    out = term.output.decode(errors="replace")
    assert "Traceback" not in out, out
    assert "chat: 2 replies" in out, out

    arrivals: list[RequestArrived] = []
    finishes: dict[str, str] = {}
    with LogReader(log) as reader:
        for record in reader.ticks():
            arrivals += [i for i in record.inputs.inputs if isinstance(i, RequestArrived)]
            finishes.update({c.request_id: c.reason for c in record.outputs.commands if isinstance(c, Finish)})
    prompts = ["".join(chr(t + 32) for t in a.prompt_token_ids) for a in arrivals]
    assert len(prompts) == 2, prompts
    assert "hello" in prompts[0] and "helo" not in prompts[0], prompts[0]
    assert "hello" in prompts[1] and "again" in prompts[1], prompts[1]  # the session kept its history
    assert finishes[arrivals[0].request_id] == "cancelled"
    assert finishes[arrivals[1].request_id] in ("length", "stop")
    assert main(["replay", str(log)]) == 0
