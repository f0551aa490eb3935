"""``rpb calibrate`` / ``rpb retention`` killed by SIGKILL (no cleanup runs) while it publishes its output
folder: ``python tests/workers/kill_worker.py POINT OUT rpb-args...``. POINT ``before-publish``: every file written
into the temporary folder, nothing renamed; ``mid-swap``: the previous folder renamed away, the new one not
yet in its place. Only renames that touch OUT's name count."""

import os
import signal
import sys

from rpb.cli import main

point, out = sys.argv[1], os.path.basename(os.path.normpath(sys.argv[2]))
real_replace, calls = os.replace, []


def replace(src, dst, *args, **kwargs):
    if out in os.path.basename(os.fspath(src)) or out in os.path.basename(os.fspath(dst)):
        calls.append((src, dst))
        if len(calls) == {"before-publish": 1, "mid-swap": 2}[point]:
            os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst, *args, **kwargs)


os.replace = replace
sys.exit(main(sys.argv[3:]))
