"""Distributed training from first principles: the code behind the course's notebooks.

What a student learns, in the order the notebooks use it:

* ``launch`` (00): start worker processes that join one process group (``spawn``, on
  ``torch.multiprocessing.start_processes``), or join the group ``torchrun`` describes;
* ``accumulation`` (01): what ``backward``, ``step`` and ``zero_grad`` do; gradient accumulation
  (per-token losses normalised by the global token count), and ``no_sync`` under DDP;
* ``collectives`` (02, 04): broadcast, reduce and all-reduce built on ``send`` and ``recv``, and the
  all-reduce's two halves, reduce-scatter and all-gather;
* ``data_parallel`` (03): data parallelism from scratch: per-parameter, flat, overlapped and bucketed
  all-reduce of the gradients, the same gradients as torch's DDP;
* ``sharding`` (04): sharded data parallelism: ZeRO-1 as torch's ``ZeroRedundancyOptimizer``, and
  ZeRO stages 1 to 3 (FSDP) on flat even shards, with the memory arithmetic and a measured ledger;
* ``costmodel`` (02, 09, 10): the alpha-beta cost of each collective, bus bandwidth, fits, step-time
  predictions (also with a period), typical interconnects; arithmetic only;
* ``bandwidth`` (02, 10): measuring collectives in worker processes, as nccl-tests does;
* ``lowrank`` (05): power iteration against the SVD, and the power step PowerSGD is built on;
* ``hooks`` (03, 06, 07): DDP communication hooks (all-reduce, fp16, bf16), every byte counted;
* ``memory`` (06, 08): error feedback, the one memory of every compressor and of PowerSGD, kept
  per parameter (and DGC's, with momentum);
* ``powersgd`` (06, 07): the PowerSGD hook with error feedback, a drop-in for torch's;
* ``compressors`` (08): what is sent: sparsification and quantization (top-k, random-k, threshold,
  QSGD, signSGD, TernGrad, fp16, bf16), numerics only;
* ``exchange`` (08): how payloads travel: all-reduce when they can be summed, all-gather otherwise;
* ``compression`` (08): how DDP calls them: a compressor, a memory and an exchange as one hook;
* ``local_sgd`` (09): communicating less often: the periodic model averager, post-local SGD (hook
  and optimizer) and DiLoCo, drop-ins for torch's;
* ``train`` (03, 06, 07, 08, 10): data-parallel training on the digits, in notebooks and under
  ``torchrun``: ``TrainConfig`` in (its fields in groups), the training loop step by step (batch,
  zero_grad, forward and loss, backward, step, record), ``TrainResult`` out.

The course's own support, in ``support``: none of it is an algorithm.

* ``support.digits``: the bundled dataset, the MLP every notebook trains, batch slicing;
* ``support.demos``: small workers the notebooks start to show an algorithm at work;
* ``support.ddp_program``: torch's DDP program in plain sight, the buckets DDP hands a hook, ranks
  under torchrun, subgroups and timeouts (notebook 03);
* ``support.hook_runs``: a training run told as how it ended (finished, raised, crashed, hung), and
  when each hook's collectives ran, step by step (notebook 07);
* ``support.sharding_runs``: the runs of notebook 04, each a worker that trains sharded and
  measures;
* ``support.local_sgd_runs``: the runs of notebook 09, each a worker that trains communicating less
  often and measures;
* ``support.exercises``: every exercise's check and reference answer;
* ``support.figures``: the diagrams in ``img/`` and plots of a notebook's own results;
* ``support.widgets``: the rank and bandwidth sliders, the memory calculator;
* ``support.timing``: the median of repeated timings;
* ``support.shapes``: parameter shapes of well-known models (ResNet-18 for CIFAR-10), written out;
* ``support.checks``: argument checks that name the bad argument, its value and what is allowed;
* ``support.progress``: a progress bar that a saved notebook shows finished;
* ``support.gpu_results``: what ``benchmarks/gpu_check.py`` measured on a GPU, always named with the device.
"""

__version__ = "0.1.0"
