"""Triton kernels of the chunked SSD scan (Mamba-2), one concept per file, each with a torch ``_ref`` twin.

The scan of ``model/ssd.py`` in chunks of Q tokens, per head h (group g = h // r):

    forward   chunk_cumsum   G = within-chunk cumsum of dt A                    [b, h, c*q]
              chunk_states   S_c, the state entering chunk c (chunk state and
                             state passing fused in one sequential loop; FP32
                             recurrence, snapshots in the input dtype)         [b, h, c, p, n]
              chunk_scan     y = (L o C B^T o dt) x + exp(G) C S_c              [b, l, h, p]
    backward  chunk_states   (recomputed rather than saved: GBs at training shapes)
              state_grads    dS_{c+1}, the gradient of the state leaving chunk c [b, h, c, p, n]
              scan_grads_x   dx, ddt and dA from one pass over each (chunk, head)
              scan_grads_bc  dB, dC summed over the heads of a group inside the kernel

The ``_ref`` twins take and return exactly what the kernels do (same buffers and layouts), in FP32 or
FP64 torch, so each kernel is tested alone; composed, they are a second implementation of the whole
forward and backward, held against autograd through the reference.

Shape letters: b batch, l length, h heads, p head dim, g groups, r = h/g, n state, c chunks, q chunk
length (t, s index positions inside a chunk, s <= t), L = c*q the padded length.
"""
