"""Distributed training from first principles: the code behind the course's notebooks.

What a student learns, in the order the notebooks use it:

* ``launch`` (00): start worker processes that join one process group (``spawn``, on
  ``torch.multiprocessing.start_processes``), or join the group ``torchrun`` describes;
* ``accumulation`` (01): what ``backward``, ``step`` and ``zero_grad`` do; gradient accumulation
  (per-token losses normalised by the global token count), and ``no_sync`` under DDP;
* ``collectives`` (02, 05): broadcast, reduce and all-reduce built on ``send`` and ``recv``, and the
  all-reduce's two halves, reduce-scatter and all-gather;
* ``data_parallel`` (03): data parallelism from scratch: per-parameter, flat, overlapped and bucketed
  all-reduce of the gradients, the same gradients as torch's DDP;
* ``sharding`` (05): sharded data parallelism: ZeRO-1 as torch's ``ZeroRedundancyOptimizer``, and
  ZeRO stages 1 to 3 (FSDP) on flat even shards, with the memory arithmetic and a measured ledger;
* ``costmodel`` (02, 09, 11, 12): the alpha-beta cost of each collective, bus bandwidth, fits, step-time
  predictions (also with a period), typical interconnects; arithmetic only;
* ``bandwidth`` (02, 12): measuring collectives in worker processes, as nccl-tests does;
* ``lowrank`` (06): power iteration against the SVD, and the power step PowerSGD is built on;
* ``hooks`` (03, 04, 07, 08): DDP communication hooks (all-reduce, fp16, bf16), every byte counted;
* ``memory`` (07, 09): error feedback, the one memory of every compressor and of PowerSGD, kept
  per parameter (and DGC's, with momentum);
* ``powersgd`` (07, 08): the PowerSGD hook with error feedback, a drop-in for torch's;
* ``compressors`` (09): what is sent: sparsification and quantization (top-k, random-k, threshold,
  QSGD, signSGD, TernGrad, fp16, bf16), numerics only;
* ``exchange`` (09): how payloads travel: all-reduce when they can be summed, all-gather otherwise;
* ``compression`` (09): how DDP calls them: a compressor, a memory and an exchange as one hook;
* ``local_sgd`` (11): communicating less often: the periodic model averager, post-local SGD (hook
  and optimizer) and DiLoCo, drop-ins for torch's;
* ``train`` (03, 04, 07, 08, 09, 12): data-parallel training on the digits, in notebooks and under
  ``torchrun``: ``TrainConfig`` in (its fields in groups), the training loop step by step (batch,
  zero_grad, forward and loss, backward, step, record), ``TrainResult`` out;
* ``verdicts`` (06, 10, 11): telling two methods apart over a few seeds: the gap between their
  means, its standard error, and a verdict given only two standard errors from its line;
* ``simulated`` (for many workers): the same workers as ``launch.spawn`` runs, each rank a thread
  of one process over an in-process group, so that p can reach 64 on a laptop; equal to real gloo
  processes (``tests/test_simulated.py``).

The package is built in floors: each module imports only from its own floor or below, never
above (``tests/test_package.py`` reads every import and fails on one that runs up).

* the ground floor, ``utils``: small utilities every module may use: ``utils.checks`` (argument
  checks that name the bad argument), ``utils.digits`` (the bundled dataset, the MLP every notebook
  trains, batch slicing), ``utils.progress`` (a progress bar a saved notebook shows finished),
  ``utils.timing`` (the median of repeated timings), ``utils.shapes`` (parameter shapes of
  ResNet-18 for CIFAR-10, written out), ``utils.rng`` (a lock on the global random generator, for
  ranks that are threads), ``utils.per_rank`` (a counter per rank, when ranks are threads);
* the algorithms above it: the modules listed above;
* the top floor, ``notebooks``: what the notebooks use besides the algorithms:
  ``notebooks.exercises`` (each exercise's check and reference, one module per notebook, sharing
  ``notebooks.exercises.core``: ``notebooks.exercises.nb00``, ``notebooks.exercises.nb01``,
  ``notebooks.exercises.nb02``, ``notebooks.exercises.nb03``, ``notebooks.exercises.nb04``,
  ``notebooks.exercises.nb05``, ``notebooks.exercises.nb06``, ``notebooks.exercises.nb07``,
  ``notebooks.exercises.nb08``, ``notebooks.exercises.nb09``, ``notebooks.exercises.nb11``,
  ``notebooks.exercises.nb12``),
  ``notebooks.widgets`` (the explorers: ``notebooks.widgets.low_rank``, ``notebooks.widgets.links``,
  ``notebooks.widgets.zero_memory``, sharing ``notebooks.widgets.common``), ``notebooks.figures``
  (the diagrams in ``img/`` and plots of a notebook's own results), ``notebooks.demos`` (small
  workers the notebooks start), ``notebooks.ddp_program`` (torch's DDP program in plain sight,
  notebook 04), ``notebooks.ddp_debugging`` (a desync, a missing rank, a hung job, the profiler and DDP's
  settings at work, notebook 04), ``notebooks.hook_runs`` (runs told as how they ended, and the hooks' timelines,
  notebook 08), ``notebooks.sharding_runs`` and ``notebooks.local_sgd_runs`` (the runs of notebooks
  05 and 11), ``notebooks.gpu_results`` (what ``benchmarks/gpu_check.py`` measured on a GPU),
  ``notebooks.throttled_links`` (what ``benchmarks/throttled_links.py`` measured on links throttled for
  real, beside the step-time model).
"""

__version__ = "0.1.0"
