"""The process's global random generator, for the code that must seed it.

torch's layers draw their initial weights from the global generator, and torch's PowerSGD draws its
first Q's from it (seeded, inside ``fork_rng``). Ranks that are processes each have their own; ranks
that are threads of one process (:mod:`course_lib.simulated`) share it, and one rank's seeding would
interleave with another's draws. Code that seeds the global generator and draws from it holds
:data:`global_generator` meanwhile, so that each seeded draw is what it would be in a process of its own.
"""

import threading

global_generator = threading.RLock()
