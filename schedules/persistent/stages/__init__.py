"""The persistent kernel's stages (:mod:`..kernel` composes them), one job a file:

- ``weights``: W_hh resident in registers and shared memory (or streamed from L2), chunk by
  chunk for the products;
- ``exchange``: h between blocks (tagged words, the counter barrier, cooperative groups' grid
  sync): staging h_{t-1}, publishing h_t, arriving and waiting;
- ``cuda_cores`` / ``tensor_cores``: the recurrent products of a chunk, and h's layout for them;
- ``reduction``: the CUDA-core sums over a warp's lanes, into shared memory;
- ``cell``: the cell on a thread's (unit, batch) pairs, with its states in registers;
- ``input_projection``: the fused input projection, before the time loop or overlapped with it.

Each function takes the :class:`~..spec.KernelSpec` first, then the buffers it reads and
writes, then the thread's indices.
"""
