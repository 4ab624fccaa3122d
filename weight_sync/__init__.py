"""Weight sync: both halves of the byte-exact protocol by which the learner pushes its weights into the
generators' running vLLM engines, in one package that both services import.

A layer between ``shared`` and the services: torch is allowed here, vLLM is imported only inside the
functions that need it, and nothing here imports a service (``tests/unit/test_architecture.py``).

* :mod:`weight_sync.protocol`: layout, bucket arithmetic, announcement, runtime facts - used by both sides.
* :mod:`weight_sync.plan`: the push plan (transport per generator, ranks, dtype), pure.
* :mod:`weight_sync.collective` (gloo, NCCL), :mod:`weight_sync.transport_ipc` (CUDA IPC),
  :mod:`weight_sync.transport_shm` (shared memory): each transport's sending and receiving halves.
* :mod:`weight_sync.sender`: the learner's pusher; :mod:`weight_sync.send_buffers`: parameters kept in its
  send buffers.
* :mod:`weight_sync.receiver`: the vLLM worker extension; :mod:`weight_sync.direct_load`: its load paths.
"""
