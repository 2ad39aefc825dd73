"""The child processes of one `wicore caption` run (its redis-server and workers), in one process
group of their own. The terminal's Ctrl-C reaches only the parent, which stops them in order; at
the end whatever is left of the group gets SIGKILL; and on Linux each child is sent SIGTERM if
the parent dies without cleaning up (SIGKILL), so no run leaves processes behind."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl():
    """libc's prctl, looked up in the parent: the child, between fork and exec, only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


class ProcessGroup:
    def __init__(self) -> None:
        self.pgid: int | None = None
        self.members: list[subprocess.Popen] = []
        self._prctl = _prctl()

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """Start a child in the group. The first child founds it, and so does a child started
        once every member has exited: a group ends with its last member, and its number may
        later name another group, which no child of ours may join."""
        if not any(member.poll() is None for member in self.members):
            self.pgid = None
        try:
            process = subprocess.Popen(args, process_group=self.pgid or 0, preexec_fn=self._die_with_parent, **kwargs)
        except PermissionError:  # the group's last member exited just now (setpgid: EPERM)
            if self.pgid is None:
                raise
            self.pgid = None
            return self.popen(args, **kwargs)
        self.pgid = self.pgid or process.pid
        self.members.append(process)
        return process

    def _die_with_parent(self) -> None:
        if self._prctl is not None:
            self._prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to every process still in the group (a no-op once they are all gone)."""
        if self.pgid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)
