"""Programs that talk to dlad from the outside: the client SDK (:mod:`clients.dlad_client`) and,
next to it, the load-testing harness. Nothing here is imported by the daemon."""
