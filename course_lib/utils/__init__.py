"""The ground floor: small utilities every module of the package may use, and which use nothing of
the package but each other. None of it is an algorithm, and none of it serves one notebook only.

* ``checks``: argument checks that name the bad argument, its value and what is allowed;
* ``digits``: the bundled dataset (scikit-learn's handwritten digits), the MLP every notebook
  trains, and how a global batch is sliced among ranks;
* ``progress``: a progress bar that a saved notebook shows finished;
* ``timing``: the median of repeated timings;
* ``shapes``: parameter shapes of well-known models, written out from their architecture.
"""
