"""The course's own support, apart from what a student learns: none of it is an algorithm.

* ``digits``: the bundled dataset (scikit-learn's handwritten digits), the MLP every notebook
  trains, and how a global batch is sliced among ranks;
* ``demos``: small workers the notebooks start to show an algorithm at work;
* ``exercises``: every exercise's check and reference, one pattern for all notebooks;
* ``figures``: the diagrams in ``img/`` and the plots drawn from a notebook's own results;
* ``widgets``: the sliders (rank, bandwidth) of the interactive explorers;
* ``timing``: the median of repeated timings;
* ``shapes``: parameter shapes of well-known models, written out from their architecture;
* ``ddp_program``: torch's DDP program in plain sight, ranks under torchrun, subgroups and timeouts,
  the buckets DDP hands its hook (notebook 03);
* ``hook_runs``: runs that may crash or hang, reported instead of raised, and the hooks' timelines
  (notebook 07);
* ``checks``: argument checks that name the bad argument, its value and what is allowed;
* ``progress``: a progress bar that a saved notebook shows finished.
"""
