"""``tickloom chat`` on a terminal, driven through a pseudo-terminal (Python's ``pty``: nothing to install).

What a person does at the keyboard: type "helo", press Left, type "l", press Enter (readline edits the line, so
the model receives "hello"); press Ctrl-C in the middle of the reply (the request is cancelled, the session goes
on); type another message and get a whole reply; press Ctrl-C at the prompt (chat leaves cleanly, exit 0). The
keys go through the terminal's line discipline, so Ctrl-C is the SIGINT the tty sends, as it is for a person.
What the model received and how each request ended is read back from the engine's log, which must replay.

The same again in a tmux pane (skipped where tmux is not installed), keys sent and the screen read as tmux does for
a person, plus Up to recall the previous message and Ctrl-D to leave.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tickloom.engine.model.stub import StubTokenizer
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

    arrivals, finishes = _arrivals_and_finishes(log)
    prompts = ["".join(chr(t + 32) for t in a.prompt_token_ids) for a in arrivals]
    assert len(prompts) == 2, prompts
    assert "hello" in prompts[0] and "helo" not in prompts[0], prompts[0]
    assert "hello" in prompts[1] and "again" in prompts[1], prompts[1]  # the session kept its history
    assert finishes[arrivals[0].request_id] == "cancelled"
    assert finishes[arrivals[1].request_id] in ("length", "stop")
    assert main(["replay", str(log)]) == 0


TMUX = shutil.which("tmux")


class TmuxPane:
    """A command in a detached tmux session on a private socket and config (never a user's tmux server): ``keys``
    and ``type`` send keys as tmux does for a person at the keyboard, ``screen`` reads the pane (history too,
    wrapped lines joined), ``wait_for`` polls it.

    The command's exit status is written to a file by a ``sh`` around it: tmux 3.3a's ``#{pane_dead_status}``
    stayed empty in about one run in four on a loaded machine: the exited command stayed a zombie that the tmux
    server never reaped (while pane_dead was 1). The shell traps SIGINT with a handler (an ignored signal would stay
    ignored in the command; a handled one is reset to the default at exec) and, as POSIX says, runs the trap only
    after the foreground command ends, so Ctrl-C acts on the command alone."""

    def __init__(self, tmp_path: Path, argv: list[str], env: dict[str, str]) -> None:
        assert TMUX is not None
        sock = tmp_path / "sock"
        if len(str(sock)) > 100:  # a unix socket's path has a ~108-byte limit
            sock = Path(tempfile.mkdtemp(prefix="tl-tmux-")) / "sock"
        conf = tmp_path / "tmux.conf"
        conf.write_text("set -g remain-on-exit on\nset -g history-limit 10000\nset -g status off\n")
        self.status_file = tmp_path / "status"
        self.base = [TMUX, "-S", str(sock), "-f", str(conf)]
        self.env = env
        wrapped = ["/bin/sh", "-c", 'trap : INT; "$@"; echo $? > "$0.tmp" && mv "$0.tmp" "$0"', str(self.status_file),
                   *argv]
        self.tmux("new-session", "-d", "-s", "chat", "-x", "120", "-y", "40", "-c", str(REPO), *wrapped)

    def tmux(self, *args: str) -> str:
        done = subprocess.run([*self.base, *args], env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"tmux {' '.join(args)}: {done.stderr}"
        return done.stdout

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "chat", *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-l", text)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def wait_for(self, ok: Callable[[list[str]], bool], what: str, timeout: float = 60.0) -> list[str]:
        """The screen's lines (right-stripped, blank ones dropped) once ``ok`` holds for them."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [line.rstrip() for line in self.screen().splitlines() if line.strip()]
            if ok(lines):
                return lines
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} on the screen within {timeout} s:\n" + "\n".join(lines[-30:]))
            time.sleep(0.05)

    def exit_status(self, timeout: float = 60.0) -> int:
        """The command's exit status (128 + N if signal N killed it), once it has exited."""
        deadline = time.monotonic() + timeout
        while not self.status_file.exists():
            assert time.monotonic() < deadline, "the command did not exit:\n" + self.screen()
            time.sleep(0.05)
        return int(self.status_file.read_text())

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], env=self.env, capture_output=True, timeout=60)


def _prompt(lines: list[str]) -> str | None:
    """What the last line holds after ``you>``, if it is the prompt line."""
    if lines and lines[-1].startswith("you>"):
        return lines[-1][len("you>"):].strip()
    return None


def _replies(lines: list[str]) -> list[str]:
    return [line[len("assistant> "):] for line in lines if line.startswith("assistant> ")]


@pytest.mark.slow
@pytest.mark.skipif(TMUX is None, reason="needs tmux (not installed): the test drives chat in a tmux pane")
def test_chat_in_tmux_arrow_keys_history_and_ctrl_c(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Keys as tmux sends them: Left edits the line, Up recalls the previous message, Ctrl-C stops a long reply
    and keeps the session, the next message gets a whole reply, Ctrl-D leaves with status 0; the log replays."""
    log = tmp_path / "chat.tlog"
    max_tokens = 300  # 15 s a reply at 0.05 s a step: long enough to interrupt on a slow machine
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP", "TMUX", "TMUX_PANE")}
    env.update(INPUTRC="/dev/null", HF_HUB_OFFLINE="1")  # readline's defaults, whatever the user's ~/.inputrc
    argv = [sys.executable, "-m", "tickloom", "chat", "--model", "stub", "--stub-step-time", "0.05",
            "--max-tokens", str(max_tokens), "--temperature", "0", "--seed", "3", "--log", str(log)]
    pane = TmuxPane(tmp_path, argv, env)
    try:
        pane.wait_for(lambda s: _prompt(s) == "", "first prompt")
        pane.type("helo")
        pane.keys("Left", "Left")
        pane.type("l")
        lines = pane.wait_for(lambda s: _prompt(s) == "hello", "edited line 'you> hello'")
        screen = "\n".join(lines)
        assert "^[" not in screen and "[D" not in screen, screen  # the arrow key was not inserted as text
        pane.keys("Enter")

        pane.wait_for(lambda s: len(_replies(s)) == 1 and len(_replies(s)[0]) >= 5, "reply streaming")
        pane.keys("C-c")
        lines = pane.wait_for(lambda s: "(interrupted)" in s and _prompt(s) == "" and s.index("(interrupted)")
                              < len(s) - 1, "'(interrupted)' and a new prompt")
        assert lines[lines.index("(interrupted)") - 1].startswith("assistant> "), lines
        stopped = _replies(lines)[0]

        pane.keys("Up")  # history: the previous message comes back, then is extended and sent
        lines = pane.wait_for(lambda s: _prompt(s) == "hello", "the previous message recalled by Up")
        assert _replies(lines)[0] == stopped, lines  # the stopped reply did not grow
        pane.keys("C-e")
        pane.type(" again")
        pane.keys("Enter")
        lines = pane.wait_for(lambda s: len(_replies(s)) == 2 and _prompt(s) == "", "a whole second reply",
                              timeout=180)
        assert len(_replies(lines)[1]) == max_tokens, lines

        pane.keys("C-d")  # end of input at the prompt: leave
        assert pane.exit_status() == 0, pane.screen()
        out = pane.screen()
    finally:
        pane.kill()
    assert "Traceback" not in out, out
    assert "chat: 2 replies" in out, out

    arrivals, finishes = _arrivals_and_finishes(log)
    prompts = [StubTokenizer().decode(a.prompt_token_ids) for a in arrivals]
    first, rest = "<user>hello <assistant>", " <user>hello again <assistant>"
    assert len(prompts) == 2 and prompts[0] == first, prompts  # Left edited the line: "hello", never "helo"
    assert prompts[1].startswith(first) and prompts[1].endswith(rest), prompts  # Up recalled "hello"
    kept = prompts[1][len(first):-len(rest)]  # the stopped reply, as the history kept it: what was shown
    assert 0 < len(kept) < max_tokens, kept
    # The terminal echoes the Ctrl-C it turned into SIGINT ("^C"), wherever the reply had got to by then.
    echoes = [i for i in range(len(stopped)) if stopped.startswith("^C", i)]
    shown = {stopped} | {stopped[:i] + stopped[i + 2:] for i in echoes}
    assert kept.rstrip() in {text.rstrip() for text in shown}, (kept, stopped)
    assert [finishes[a.request_id] for a in arrivals] == ["cancelled", "length"], finishes
    assert main(["replay", str(log)]) == 0
    assert "identical" in capsys.readouterr().out


def _arrivals_and_finishes(log: Path) -> tuple[list[RequestArrived], dict[str, str]]:
    """The log's arrivals in order, and each request's finish reason."""
    arrivals: list[RequestArrived] = []
    finishes: dict[str, str] = {}
    with LogReader(log) as reader:
        for record in reader.ticks():
            arrivals += [i for i in record.inputs.inputs if isinstance(i, RequestArrived)]
            finishes.update({c.request_id: c.reason for c in record.outputs.commands if isinstance(c, Finish)})
    return arrivals, finishes


def test_chat_help_lists_the_commands_and_is_not_sent_to_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import io

    log = tmp_path / "chat.tlog"
    monkeypatch.setattr(sys, "stdin", io.StringIO("/help\nhi\n/exit\n"))
    assert main(["chat", "--model", "stub", "--max-tokens", "3", "--log", str(log)]) == 0
    captured = capsys.readouterr()
    assert "commands: /help lists these, /reset forgets the conversation" in captured.out
    assert "chat: 1 reply, 3 tokens" in captured.err
    arrivals, _ = _arrivals_and_finishes(log)
    assert [StubTokenizer().decode(a.prompt_token_ids) for a in arrivals] == ["<user>hi <assistant>"]
