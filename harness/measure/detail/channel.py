"""The pipe pair between the driver and one side worker: one JSON object per line each way.

A dedicated pair of file descriptors, not the worker's stdout: whatever the op under test prints
goes to the worker's log and can never be taken for a reply.
"""
from __future__ import annotations

import os
import select
import time

from harness.measure.model import decode, encode


class ChannelClosed(Exception):
    """The other end closed its side of the pipe (the process ended)."""


class ChannelTimeout(Exception):
    """No whole message arrived in time."""


class Channel:
    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd, self.write_fd = read_fd, write_fd
        self._buf = b""

    def send(self, message: dict) -> None:
        data = encode(message)
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
        except (BrokenPipeError, OSError) as e:
            raise ChannelClosed(f"the other end is gone ({e})") from None

    def recv(self, timeout: float | None = None) -> dict:
        """The next message; ChannelTimeout after `timeout` seconds (None: wait for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.read_fd], [], [], wait)
            if not ready:
                raise ChannelTimeout(f"no reply within {timeout:.0f} s")
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise ChannelClosed("the other end closed the pipe")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return decode(line)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
