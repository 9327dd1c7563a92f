"""The node-side spot watcher: an EC2 spot interruption notice becomes a Ray drain.

    python -m raytrain_mnist.spot --address HEAD:6379 [--interval 5] [--node-id ID]
        [--metadata-url http://169.254.169.254] [--once] [--dry-run]

AWS announces a spot reclaim about two minutes ahead in the instance metadata (IMDSv2):
``GET /latest/meta-data/spot/instance-action`` answers 404 until then, and then
``{"action": "terminate", "time": "2026-12-01T17:02:00Z"}``. Every request needs a session
token, asked first with ``PUT /latest/api/token``. On a notice the watcher runs, once::

    ray drain-node --address HEAD:6379 --node-id ID --reason DRAIN_NODE_REASON_PREEMPTION
        --reason-message "spot instance-action terminate at ..." --deadline-remaining-seconds N

Ray Train then tells the training run (``ray.train.get_preemption_info()``): it checkpoints
just in time and resumes elsewhere from that step (``worker/preempt.py``). The cluster's
worker start commands (``cluster.yaml``) start this on every spot node; it logs to stderr
and exits after the drain (or with ``--once`` after one look).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

logger = logging.getLogger("raytrain_mnist.spot")

METADATA_URL = "http://169.254.169.254"
TOKEN_TTL_S = 21600  # IMDSv2's longest
_TIMEOUT_S = 2.0


class Metadata:
    """IMDSv2 at ``url``: a session token first (renewed when refused), then the reads."""

    def __init__(self, url: str = METADATA_URL) -> None:
        self.url = url.rstrip("/")
        self._token: str | None = None
        self._token_at = 0.0

    def _new_token(self) -> str:
        request = urllib.request.Request(
            f"{self.url}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as answer:
            return answer.read().decode()

    def get(self, path: str) -> str | None:
        """The text at ``/latest/meta-data/<path>``; None for a 404 (nothing there)."""
        for attempt in range(2):
            if self._token is None or time.monotonic() - self._token_at > TOKEN_TTL_S / 2:
                self._token, self._token_at = self._new_token(), time.monotonic()
            request = urllib.request.Request(
                f"{self.url}/latest/meta-data/{path}",
                headers={"X-aws-ec2-metadata-token": self._token},
            )
            try:
                with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as answer:
                    return answer.read().decode()
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return None
                if exc.code == 401 and attempt == 0:  # the token expired: ask again
                    self._token = None
                    continue
                raise
        return None


def notice(metadata: Metadata, now: float | None = None) -> dict | None:
    """The spot interruption notice (``action``, ``time`` and ``remaining_s``, whole seconds
    left, never negative), or None while there is none."""
    text = metadata.get("spot/instance-action")
    if text is None:
        return None
    found = json.loads(text)
    when = datetime.strptime(found["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    now = time.time() if now is None else now
    return {**found, "remaining_s": max(int(when.timestamp() - now), 0)}


def drain_command(address: str, node_id: str, found: dict) -> list[str]:
    """The ``ray drain-node`` words for notice ``found`` on node ``node_id``."""
    return [
        "ray", "drain-node", "--address", address, "--node-id", node_id,
        "--reason", "DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message", f"spot instance-action {found.get('action')} at {found.get('time')}",
        "--deadline-remaining-seconds", str(found["remaining_s"]),
    ]  # fmt: skip


def this_node_id(address: str) -> str:
    """The id of the Ray node on this machine (a short-lived connection to it)."""
    import ray

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        return ray.get_runtime_context().get_node_id()
    finally:
        ray.shutdown()


def is_spot(metadata: Metadata) -> bool | None:
    """Whether this is a spot instance (``instance-life-cycle``); None off EC2."""
    try:
        return metadata.get("instance-life-cycle") == "spot"
    except OSError:  # no metadata service here (on-prem, a laptop): nothing to watch
        return None


def watch(metadata: Metadata, interval_s: float, once: bool, act) -> dict | None:
    """Poll until a notice (then ``act(notice)`` and return it), or once with ``once``."""
    while True:
        try:
            found = notice(metadata)
        except (OSError, ValueError, KeyError) as exc:  # metadata unreachable or garbled
            logger.warning("spot watcher: cannot read the instance metadata (%s)", exc)
            found = None
        if found is not None:
            act(found)
            return found
        if once:
            return None
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raytrain_mnist.spot", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--address", default="auto", help="the Ray head (HOST:PORT)")
    parser.add_argument("--node-id", help="this node's Ray id (default: asked of Ray)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between looks")
    parser.add_argument("--metadata-url", default=METADATA_URL, help="the instance metadata")
    parser.add_argument("--once", action="store_true", help="look once, then exit")
    parser.add_argument("--dry-run", action="store_true", help="print the drain, do not run it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.interval <= 0:
        parser.error(f"--interval must be > 0, got {args.interval:g}")

    def act(found: dict) -> None:
        node_id = args.node_id or this_node_id(args.address)
        words = drain_command(args.address, node_id, found)
        logger.warning("spot notice: %s at %s; draining node %s", found.get("action"),
                       found.get("time"), node_id)  # fmt: skip
        if args.dry_run:
            print(" ".join(words), flush=True)
            return
        done = subprocess.run(words, capture_output=True, text=True)
        if done.returncode:
            logger.error("ray drain-node failed: %s", (done.stderr or done.stdout).strip())

    metadata = Metadata(args.metadata_url)
    spot = is_spot(metadata)
    if not spot:
        where = "an on-demand instance" if spot is False else "no EC2 instance metadata here"
        logger.info("spot watcher: %s, nothing to watch", where)
        return 0
    found = watch(metadata, args.interval, args.once, act)
    return 0 if found is not None or args.once else 1


if __name__ == "__main__":
    sys.exit(main())
