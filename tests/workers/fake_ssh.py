"""A stand-in for `ssh` in tests: every "host" is this machine (but `unreachable*`, which fails as ssh does). It takes ssh's options, records
the host it was asked for (FAKE_SSH_LOG), and runs the remote command with /bin/sh -c, as sshd
runs it through the user's shell, with stdin passed through (so EOF reaches the agent as over ssh)."""

import os
import sys

args = sys.argv[1:]
while args and args[0].startswith("-"):
    option = args.pop(0)
    if option in ("-o", "-p", "-i", "-l"):
        args.pop(0)
host, remote = args[0], " ".join(args[1:])
if host.startswith("unreachable"):
    sys.stderr.write(f"ssh: Could not resolve hostname {host}: Name or service not known\n")
    sys.exit(255)
if os.environ.get("FAKE_SSH_LOG"):
    with open(os.environ["FAKE_SSH_LOG"], "a") as log:
        log.write(f"{host} {'check' if remote == 'true' else 'start'}\n")
os.execv("/bin/sh", ["/bin/sh", "-c", remote])
