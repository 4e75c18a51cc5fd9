"""End-to-end training benchmark: compressed optimizers against the data-parallel peers a user
would pick instead, on the same model, data and seeds (docs/design.md section 4).

A small GPT-style causal language model (byte-level, vocabulary 256; presets ``tiny`` ~1M and
``small`` ~9M parameters, or any ``--layers/--width/--heads/--context``) is trained on a corpus
that ships with Python: the help texts of ``pydoc_data.topics`` (~0.5 MB of English prose and
code; ``--corpus PATH`` takes any text file instead, ``--corpus stdlib`` the standard library's
``.py`` sources, 12.6 MB, for runs longer than one pass over the help texts). Nothing is downloaded.

Methods (``--methods``, comma-separated):

* ``ddp_adamw``: ``DistributedDataParallel`` + ``torch.optim.AdamW``, gradients averaged by an
  fp32 allreduce hook equivalent to DDP's default (torch's ``allreduce_hook``);
* ``ddp_fp16``: the same with ``fp16_compress_hook`` (``ddp_bf16``: ``bf16_compress_hook``, NCCL only);
* ``ddp_powersgd``: the same with torch's PowerSGD hook (``--powersgd-rank``; PowerSGD starts
  after the same warmup as ours, ``start_powerSGD_iter = --freeze-step``). On Gloo it can abort
  with a size mismatch or hang when its compression starts (its allreduces are launched from
  future callbacks, in an order that can differ between ranks when several DDP buckets are in
  flight); ``ddp_powersgd+serial`` runs one bucket's hook at a time, which keeps the order;
* ``onebit_adam``, ``onebit_lamb``, ``zero_one_adam``: this library's optimizers on the plain model
  (standalone mode), warmup of ``--freeze-step`` steps (1-bit LAMB at ``--lamb-lr``: LAMB's trust
  ratio takes a larger lr than Adam). ``--no-overlap`` communicates in ``step()`` instead of
  during backward; ``--ddp-hook`` runs them under DDP with
  :func:`compressed_opt.register_ddp_comm_hook`. They run with ``path="1bit"`` (the 1-bit
  exchange in every bucket). A method may carry its own options: ``onebit_adam+ddp``,
  ``onebit_adam+nooverlap``, ``onebit_adam+overlap``; ``+flat`` / ``+node`` (``hierarchy=``);
  ``+measure`` (``path="measure"``, the library's default: each bucket, and on several nodes the
  exchange, as measured faster).

Every method runs in processes of its own (a hang or crash of one cannot take the others along):
a rank that completes no step for ``--stall-timeout`` seconds reports a hang and exits, and all
ranks are killed after ``--method-timeout``; a method whose ranks crash, hang or diverge (NaN
loss) is reported as *failed*, with the reason, never as slow. Every method starts from the same
initial model (same seed) and sees the same batches: global batch ``--batch * world_size``
sequences of ``--seq-len`` bytes drawn by step number, rank ``r`` takes its ``r``-th shard.
The learning rate warms up linearly over ``--lr-warmup`` steps, then decays (cosine) to 10%.

Where the ranks run:

* ``--launch N`` (default 2): N local processes, Gloo (NCCL with ``--device cuda``), file store;
* ``--link 1gbit|100mbit|RATE|none``: 2 ranks in network namespaces joined by a veth pair limited
  to that rate in each direction (``benchmarks/slowlink.py``); the wire bytes are counted on the
  veth; with ``--ranks-per-node L`` each namespace is a node of L ranks started by ``torchrun
  --nnodes 2`` (c10d rendezvous), and the wire bytes are a node's. ``--link-emulation``: as root
  the namespaces are made on this machine (``netns``); any other user gets the same link inside a
  user namespace of its own (``userns``: ``unshare --user --map-root-user --net --mount``, no root
  needed); where neither can be made, ``auto`` (the default) *models* the link instead (``model``:
  2 local ranks over loopback, each step's measured time plus its bytes / RATE, labelled MODELLED
  in the table; never plain loopback);
* under ``torchrun`` (``torchrun --nproc-per-node N benchmarks/train.py``): the methods run one
  after the other in the launched processes (no isolation between methods; peak memory is then
  cumulative).

What is reported per method (JSON ``--out-dir/NAME.json``, plots ``NAME.png``, a table):

* step time: median over the steps of the warmup stage and of the compression stage (the first
  2 steps of each stage are left out); a step's time is the maximum over the ranks of
  forward + backward + ``optimizer.step()`` + ``zero_grad``;
* samples/s in the method's steady stage (compression stage when it has one);
* bytes sent per step per rank: ours from ``backend.stats``, DDP methods counted in their comm
  hook (every ``all_reduce`` the hook issues, ring volume ``2 (N-1)/N * bytes``); on the slow link
  also the bytes counted on the veth (``tx_bytes``, Ethernet frames with headers and ACKs);
* loss at equal steps: the mean training loss of the last 10% of steps (every method the same
  steps), and the held-out loss at the end; time to a target loss (``--target-loss``, default
  1.05 x ``ddp_adamw``'s final loss) in training wall time;
* peak memory per rank (CPU: ``ru_maxrss``; CUDA: ``max_memory_allocated``);
* with ``--breakdown``: the steady step split into *compute* (forward + backward with no
  communication, timed separately at the end), *communication paid* (forward + backward beyond
  that compute, plus the time ``step()`` waits for or runs communication) and *update*
  (the rest of ``step()``), and, beside it, the time spent in compression kernels and in
  collectives (ours: each compression kernel, seen through the library's observer hook
  ``compressed_opt.comm.observe``, and each collective of the optimizer's backend, which is
  wrapped; DDP: inside the comm hook, and the time an allreduce is in flight). With ``overlap``
  the kernels and collectives run during backward, so they are not a part of the step's sum: the
  comparison of *communication paid* with them shows what the overlap hid.

Run ``python -P benchmarks/train.py --help`` (``make demo``, ``make bench``). The package, one idea
a module: ``model`` and ``data`` (the GPT and its batches), ``methods`` (what each method builds),
``instrument`` (counting and timing communication), ``loop`` (one method on the ranks of a process
group), ``runner`` (a method in processes of its own: local, over the slow link, or under
torchrun), ``report`` (summaries, the table, JSON and plots), ``cli`` (the command line). Shared
with the other benchmarks: ``benchmarks/common.py``. This folder (``benchmarks/``) must be on
``sys.path``: ``benchmarks/train.py`` puts it there.
"""
