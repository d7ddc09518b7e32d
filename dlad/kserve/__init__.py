"""The Open Inference Protocol (KServe v2) in front of dlad: HTTP/REST and gRPC.

Triton's clients (``tritonclient``, perf_analyzer, the C++/Java/Go clients), KServe routing and
any language with an HTTP or gRPC library reach dlad through these ports. They are front doors
only: a request is checked by the daemon's own decoder (``dlad.protocol.decode_request``, the
ZeroMQ INFER's checks and limits) and runs through the native plane like any ZeroMQ INFER
(:meth:`dlad.frontend.Frontend.infer_local`): one admission, one scheduler, one set of engines
and statuses.

:mod:`dlad.kserve.core` maps a protocol-neutral request to an INFER and its answer back;
:mod:`dlad.kserve.http` (aiohttp) and :mod:`dlad.kserve.grpc` (grpcio) speak the two
transports. docs/protocol.md, "The Open Inference Protocol", is the user's page.
"""
