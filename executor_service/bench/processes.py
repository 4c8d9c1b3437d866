"""What every benchmark does with processes: child processes stopped on exit,
progress lines on stderr, the CPU time a process tree has used."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and its living descendants, every thread (Linux
    ``/proc``; processes that have exited no longer count)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # After the command's closing parenthesis: state, ppid, ..., utime, stime.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(times.get(pid, 0.0) for pid in tree)


def progress(name: str, message: str) -> None:
    print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextmanager
def child_process(
    args: list[str], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``args`` running with pipes to stdin and stdout; terminated (killed after 30 s) on exit."""
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
