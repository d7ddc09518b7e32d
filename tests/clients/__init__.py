"""Tests of the client SDK (clients/dlad_client) against a fake daemon."""
