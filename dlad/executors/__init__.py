"""Executors: one per engine, between the scheduler and the devices (``base.py`` is the seam).

``dla.py`` is the DLA core's executor (batch 1, back to back, pre/post fenced to the task);
``factory.py`` builds every executor of a plan from the config.
"""
