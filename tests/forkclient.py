"""The client of tests/forkserver.py: a stand-in for ``python -m slimectl ARGS`` or ``python SCRIPT ARGS``.

    python -I -S forkclient.py slimectl ARGS...     (what the recipe's scripts call as $SLIMECTL)
    python -I -S forkclient.py python SCRIPT ARGS... (what they call as $PYTHON: wait_for.py)
    python -I -S forkclient.py --socket PATH python -m MODULE ARGS...   (the server named here, not in the env)

It asks the fork server at $SLIMECTL_FORK_SOCKET (or --socket) to fork a child that runs the command with this
process's argv, environment, working directory and stdin/stdout/stderr (the file descriptors
themselves travel over the Unix socket), then waits and exits as the child did (the same exit code,
or the same signal). SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2/SIGQUIT sent to this process go on to the child's process group.
If this process dies (kill -9 of its host), the server sees the socket close and kills the child's
process group with SIGKILL. Standard library only, so it starts in a few hundredths of a CPU second.
"""

import json
import os
import signal
import socket
import sys


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def main() -> None:
    args = sys.argv[1:]
    socket_path = os.environ.get("SLIMECTL_FORK_SOCKET")
    if args[:1] == ["--socket"]:  # the server named in the command itself (one command, no environment to set)
        socket_path, args = args[1], args[2:]
    mode, *argv = args
    child = {"pid": None, "pending": []}

    def forward(sig, _frame):
        if child["pid"] is None:  # before the server answered: delivered once it has
            child["pending"].append(sig)
            return
        try:
            os.killpg(child["pid"], sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    job = {"mode": mode, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(sock, [json.dumps(job).encode() + b"\n"], [0, 1, 2])
    answers = sock.makefile("rb")
    line = answers.readline()
    if not line:
        sys.exit("forkclient: the fork server closed the connection")
    child["pid"] = json.loads(line)["pid"]
    for sig in child["pending"]:
        forward(sig, None)
    line = answers.readline()
    if not line:
        sys.exit("forkclient: the fork server died")
    rc = json.loads(line)["rc"]
    if rc < 0:  # died by a signal: die by the same one
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)

if __name__ == "__main__":
    main()
