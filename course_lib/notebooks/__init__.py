"""The top floor: what the notebooks use besides the algorithms, above everything it uses. Nothing
below imports it.

* ``exercises``: every exercise's check and reference, one module per notebook, sharing ``core``;
* ``widgets``: the sliders (rank, bandwidth, period) of the interactive explorers, and the memory
  calculator;
* ``figures``: the diagrams in ``img/`` and the plots drawn from a notebook's own results;
* ``demos``: small workers the notebooks start to show an algorithm at work;
* ``ddp_program``: torch's DDP program in plain sight, ranks under torchrun, subgroups and timeouts,
  the buckets DDP hands its hook (notebook 04);
* ``ddp_debugging``: a desync, a missing rank and a hung job with the tools that find them, one DDP step
  under ``torch.profiler``, DDP's settings at work (notebook 04);
* ``hook_runs``: runs that may crash or hang, reported instead of raised, and the hooks' timelines
  (notebook 08);
* ``sharding_runs``, ``local_sgd_runs``: the runs of notebooks 05 and 11, each a worker that trains
  and measures;
* ``gpu_results``: what ``benchmarks/gpu_check.py`` measured on a GPU, always named with the device;
* ``throttled_links``: what ``benchmarks/throttled_links.py`` measured on links throttled for real, beside
  the step-time model's predictions.
"""
