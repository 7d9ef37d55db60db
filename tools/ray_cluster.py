"""A two-node Ray cluster on this one machine: a head node and a worker node started with `ray start`
as separate processes, the GPUs split between them with CUDA_VISIBLE_DEVICES; a command run against
it; both nodes stopped. For trying `--ray ADDRESS` across nodes without a second machine, on GPUs or
(with --num-cpus and no GPUs) on a CPU.

    python tools/ray_cluster.py [--head-gpus 0,1] [--worker-gpus 2,3] [--num-cpus 4] -- \\
        minicpm bulk items.txt --out voices/ --ray {address} --replicas 4 --seed 7

`{address}` in the command becomes the head's address (HOST:PORT), which RAY_ADDRESS also holds.
Prints the address on stderr once both nodes are up, exits with the command's status. Each node is
its own `ray start --block` in a process group of its own, stopped by signalling that group: `ray
stop` would stop every Ray on the machine, other users' included. The nodes' files go to a temporary
directory of their own (not /tmp/ray), removed at the end.

The cluster uses Ray's token authentication with a token drawn for it: the nodes and the command get
RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (a client that names an address, as `--ray HOST:PORT` does,
sends a token only when told to: Ray 2.60 enables it by itself only for a cluster it finds, `auto`).

As a module (tools/scale_bench.py, tests/test_ray.py): `with two_nodes(...) as cluster:` (or
`nodes([gpus, ...])`, any number of nodes, one for a running cluster of one machine), then
`cluster.address` and `cluster.env` (the variables a client adds to its environment).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Sequence

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ray_command() -> list[str]:
    """`ray` of this Python's environment (the one the nodes and the command share)."""
    found = shutil.which("ray", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


def node_args(gpus: str | None, num_cpus: int | None) -> list[str]:
    """A node's resources: the GPUs CUDA_VISIBLE_DEVICES gives it (none for ""), its CPUs. Every port
    a node opens is chosen free here, so two nodes (or two clusters) share the machine."""
    args = ["--disable-usage-stats", "--block", "--node-ip-address", HOST,
            "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port())]
    if gpus is not None:
        args += ["--num-gpus", str(len([g for g in gpus.split(",") if g.strip()]))]
    if num_cpus is not None:
        args += ["--num-cpus", str(num_cpus)]
    return args


class Cluster(NamedTuple):
    address: str  # the head's HOST:PORT
    env: dict  # what a client of it adds to its environment (RAY_ADDRESS and the token)


def node_env(gpus: str | None, shared: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(shared)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(ray_command() + ["start", *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to the node's process group (its `ray start`, the GCS, the raylet and its workers,
    which die with it), SIGKILL to what is left after `timeout`."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def wait_nodes(address: str, shared: dict, count: int, procs: list[subprocess.Popen], logs: list[Path],
               timeout: float) -> None:
    """Until `count` nodes are alive in the cluster at `address` (or one of `procs` exits: an error
    with its log)."""
    code = ("import ray, sys, time\n"
            f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n"
            f"end = time.monotonic() + {timeout}\n"
            f"while sum(n['Alive'] for n in ray.nodes()) < {count} and time.monotonic() < end:\n"
            "    time.sleep(0.5)\n"
            f"sys.exit(0 if sum(n['Alive'] for n in ray.nodes()) >= {count} else 3)\n")
    check = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=node_env(None, shared))
    while check.poll() is None:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                check.kill()
                raise RuntimeError(f"a Ray node exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    if check.returncode != 0:
        raise RuntimeError(f"the cluster at {address} did not get {count} nodes: "
                           f"{check.stderr.read().decode()[-2000:]}")


@contextlib.contextmanager
def nodes(gpus: Sequence[str | None], num_cpus: int | None = None, timeout: float = 120, env: dict | None = None):
    """A cluster of `len(gpus)` nodes on this machine: a head node, then a worker node for each further
    entry (each entry the CUDA_VISIBLE_DEVICES of its node, "" for none; None: Ray's own count; `env`:
    more variables for every node, e.g. a PYTHONPATH their workers import the code from); yields a
    Cluster once every node is up, stops them all at the end."""
    if not gpus:
        raise ValueError("a cluster needs at least its head node")
    tmp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # (short: Ray's socket paths must fit 107 bytes)
    port = free_port()
    address = f"{HOST}:{port}"
    shared = {**(env or {}), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    procs: list[subprocess.Popen] = []
    logs = [tmp / ("head.log" if k == 0 else f"worker-{k}.log") for k in range(len(gpus))]
    try:
        for k, node_gpus in enumerate(gpus):
            where = (["--head", "--port", str(port), "--include-dashboard=false", "--temp-dir", str(tmp / "ray"),
                      "--ray-client-server-port", str(free_port())] if k == 0 else ["--address", address])
            procs.append(_start([*where, *node_args(node_gpus, num_cpus)], node_env(node_gpus, shared), logs[k]))
            wait_nodes(address, shared, k + 1, procs, logs[: k + 1], timeout)
        yield Cluster(address, {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token",
                                "RAY_AUTH_TOKEN": shared["RAY_AUTH_TOKEN"]})
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def two_nodes(head_gpus: str | None = None, worker_gpus: str | None = None, num_cpus: int | None = None,
              timeout: float = 120, env: dict | None = None):
    """`nodes` of a head and one worker node."""
    return nodes([head_gpus, worker_gpus], num_cpus, timeout, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the head node ('' for none)")
    ap.add_argument("--worker-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the worker node ('' for none)")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs each node offers [default: Ray's count]")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command ({address}: the head's)")
    opts = ap.parse_args()
    command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    if not command:
        ap.error("give a command after --")
    with two_nodes(opts.head_gpus, opts.worker_gpus, opts.num_cpus) as cluster:
        print(f"ray_cluster: head and worker at {cluster.address}", file=sys.stderr, flush=True)
        code = subprocess.run([part.replace("{address}", cluster.address) for part in command],
                              env={**os.environ, **cluster.env}).returncode
    sys.exit(code)


if __name__ == "__main__":
    main()
