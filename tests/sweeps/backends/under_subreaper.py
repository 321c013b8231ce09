"""Run a command as the child of a child subreaper (``PR_SET_CHILD_SUBREAPER``), as an init
that reaps would be, and report what the command's process tree left behind once it exited:
every process handed to this one (orphans, zombies included), one JSON line on the last line
of stdout: {"code": <the command's exit code>, "left": [[pid, state, name], ...]}.

Usage: python tests/sweeps/backends/under_subreaper.py CMD [ARGS...]. A zombie under pid 1 in
a container whose pid 1 does not reap is what a process tree leaves when a parent dies before
its child; here such a child comes to this process instead, and is counted."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def _children(of: int) -> list[list]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == of:
            out.append([int(entry.name), fields[0], name])
    return out


def main(argv: list[str]) -> int:
    if ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    code = subprocess.run(argv).returncode
    left = _children(os.getpid())
    print(json.dumps({"code": code, "left": left}), flush=True)
    for pid, _, _ in left:  # not ours to keep: end and reap what the command left
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
