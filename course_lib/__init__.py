"""Distributed training from first principles: the code behind the course's notebooks.

One concept per module: ``launch`` (start worker processes), ``accumulation``, ``collectives``,
``lowrank``, ``hooks``, ``powersgd``, ``bandwidth``; ``exercises`` checks students' answers.
"""

__version__ = "0.1.0"
