"""What `timeshared` says to systemd and takes from it: sd_notify, the watchdog, socket activation.

Written against the protocol (a datagram of `KEY=VALUE` lines to $NOTIFY_SOCKET; fds from 3 on
with $LISTEN_FDS, $LISTEN_PID and $LISTEN_FDNAMES) rather than libsystemd, so that it needs no
C library and runs the same outside systemd, where every call is a no-op. The variables are
taken out of the environment once read: nothing this process starts inherits them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import structlog

from timeshare.cycle.workers import SERVICE_VARIABLES

log = structlog.get_logger(__name__)

FIRST_LISTEN_FD = 3  # SD_LISTEN_FDS_START


@dataclass
class Notifier:
    """Sends sd_notify messages; without $NOTIFY_SOCKET it only remembers what it would send."""

    address: str | None = None
    ready_sent: bool = False  # READY=1 went out once (start-up is over for systemd)
    stopping_sent: bool = False
    sent: list[str] = field(default_factory=list)  # the last few messages, for `status`
    _socket: socket.socket | None = None

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str]) -> Notifier:
        address = environ.get("NOTIFY_SOCKET") or None
        if address is not None and address.startswith("@"):
            address = "\0" + address[1:]  # an abstract socket
        return cls(address)

    def notify(self, **fields: str | int) -> None:
        """One datagram of `KEY=VALUE` lines. Never blocks (it is called on the event loop: a
        full receive queue drops the message) and never raises (systemd may be gone)."""
        message = "\n".join(f"{key}={value}" for key, value in fields.items())
        self.sent = [*self.sent[-9:], message]
        if self.address is None:
            return
        try:
            if self._socket is None:
                kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                self._socket = socket.socket(socket.AF_UNIX, kind)
            self._socket.sendto(message.encode(), self.address)
        except OSError as exc:  # BlockingIOError included: systemd is not reading
            log.warning("systemd.notify.failed", error=str(exc), message=message)

    def ready(self, status: str) -> None:
        self.ready_sent = True
        self.notify(READY=1, STATUS=status)

    def status(self, status: str) -> None:
        self.notify(STATUS=status)

    def watchdog(self) -> None:
        self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> None:
        self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    def reloading(self) -> None:
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify(RELOADING=1, MONOTONIC_USEC=monotonic_usec)

    def stopping(self, status: str) -> None:
        """STOPPING=1, once, however many paths lead to the exit."""
        if not self.stopping_sent:
            self.stopping_sent = True
            self.notify(STOPPING=1, STATUS=status)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def watchdog_interval_s(environ: MutableMapping[str, str]) -> float | None:
    """Half the watchdog interval systemd asked for (None: no watchdog for this process)."""
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        log.warning("systemd.watchdog.ignored", WATCHDOG_USEC=usec)
        return None


def listen_sockets(environ: MutableMapping[str, str]) -> dict[str, socket.socket]:
    """The sockets systemd passed (socket activation), by name ("unknown" when unnamed)."""
    count, pid = environ.get("LISTEN_FDS"), environ.get("LISTEN_PID")
    if not count or pid != str(os.getpid()):
        return {}
    names = environ.get("LISTEN_FDNAMES", "").split(":")
    sockets: dict[str, socket.socket] = {}
    for index in range(int(count)):
        fd = FIRST_LISTEN_FD + index
        os.set_inheritable(fd, False)  # workers must not hold the control socket open
        name = names[index] if index < len(names) and names[index] else "unknown"
        sockets[name] = socket.socket(fileno=fd)
    return sockets


def take_service_variables(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Remove systemd's per-service variables from `environ`; return what they were."""
    return {name: environ.pop(name) for name in SERVICE_VARIABLES if name in environ}
