"""Run a command with a CPU hog beside it: what `make test-under-load` runs to show the suite holds on
a loaded machine (no float compared to its last digit, no unstated time margin).

    python tests/under_load.py [--hogs N] -- make test

N busy-looping processes (default: two per core) run at normal priority for as long as the command
does, and are killed with it; the load average before and after is printed.
"""

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys


def spin():
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    while True:
        pass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=2 * (os.cpu_count() or 1))
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (e.g. -- make test)")
    hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    print(f"under load: {args.hogs} busy loops on {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    try:
        code = subprocess.call(command)
    finally:
        print(f"load average at the end: {os.getloadavg()[0]:.1f}", flush=True)
        for hog in hogs:
            hog.kill()
            hog.join()
    return code


if __name__ == "__main__":
    sys.exit(main())
