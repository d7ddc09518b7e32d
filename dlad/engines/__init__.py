"""The Python side of the plane's engines: what a Python-backed engine runs (python.py)."""
