"""Running one trainpipe run on many processes (issue 10).

- ``env.py``: who am I (rank, world size, launcher) from the environment torchrun / accelerate set, the
  process group (gloo on the CPU, NCCL on CUDA) and the few collectives the loop needs.
- ``launch.py``: ``trainpipe run --nproc-per-node N`` starts its workers through torch's elastic launcher
  (torchrun semantics) and returns their exit code; ``trainpipe launch --emit`` writes torchrun / sbatch /
  PyTorchJob files for a cluster.
- ``ddp.py``: DDP around the model (communication hooks for gradient compression) and the hang watchdog that
  names the rank which stopped answering.

Heavy imports (torch) happen inside functions, as everywhere in trainpipe.
"""
