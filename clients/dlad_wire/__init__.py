"""dlad's wire, declared once: the messages and their codec (:mod:`dlad_wire.protocol`), the
statuses and their error classes (:mod:`dlad_wire.errors`), and the rules both ends check, in
C++ headers the daemon compiles too (``native/``), read here through ``dlad_wire._rules``.

It ships in the ``dlad-client`` distribution with the SDK (:mod:`dlad_client`); the daemon
(``dlad``) depends on it. ``docs/protocol.md`` is the specification.
"""
