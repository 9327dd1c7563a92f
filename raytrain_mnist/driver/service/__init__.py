"""A warm training service: one long-lived ``TorchTrainer`` whose workers train ``fit``
requests one after another (library code: it never prints).

A new ``TorchTrainer`` per run pays for a controller, N workers and a process group, each a
new Python importing torch: seconds that a short run spends on nothing else. A service pays
them once::

    fit --service S (any shell)        the service's driver (service start)   Train workers
    validate, claim the run       ──►  ServiceQueue (a named actor)    ──────► rank 0 takes a
    render events, exit code      ◄──  one TorchTrainer.fit() for good        request; all
    Ctrl-C: cancel the request         the checkpoints filed into the run ◄── train it

* :class:`ServiceQueue`, a threaded actor on the service driver's node, named after the
  service: the FIFO of requests, each request's stream of progress and committed epochs
  (what a ``fit``'s run channel carries), its state, and the service's own record (workers,
  device, requests served). A request is data: the validated training settings, the run's
  storage and name, the checkpoint it resumes from. The queue refuses a run outside the
  service's storage roots.
* :func:`run_service`: the service's driver. It loads MNIST once, starts (or joins) Ray,
  starts the queue and the trainer (:func:`~raytrain_mnist.worker.service.serve_requests`),
  and runs until :meth:`ServiceQueue.stop` or Ctrl-C.
* The controller's callback :func:`filing_callbacks` files every committed checkpoint
  into the request's run as Ray Train would have written it there
  (:mod:`~raytrain_mnist.driver.runs.filing`), then passes the epoch to the requester.
* The requester's side is :func:`raytrain_mnist.driver.fitting.fit` with
  ``--service``: :class:`ServiceClient` finds the service, checks that it can honour the
  run, sends the request and follows it.

A requester that stops asking about its request for :data:`REQUEST_LEASE_S` (killed with
SIGKILL) is taken to have gone: its request is cancelled, as its run's claim lapses.
"""

from raytrain_mnist.driver.service.client import ServiceClient, ServiceData
from raytrain_mnist.driver.service.queue import (
    NAMESPACE,
    ServiceQueue,
    find_queue,
    queue_name,
    registry_file,
)
from raytrain_mnist.driver.service.request import check_request, within_roots
from raytrain_mnist.driver.service.running import (
    ServiceResult,
    ServiceSpec,
    filing_callbacks,
    run_service,
    status,
    stop,
)

__all__ = [
    "NAMESPACE",
    "ServiceClient",
    "ServiceData",
    "ServiceQueue",
    "ServiceResult",
    "ServiceSpec",
    "check_request",
    "filing_callbacks",
    "find_queue",
    "queue_name",
    "registry_file",
    "run_service",
    "status",
    "stop",
    "within_roots",
]
