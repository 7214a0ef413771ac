"""The specialisation table: which kernel variants exist.

One entry per stage of the chunked algorithm (kda.h's kda_stage_* functions)
plus the decode recurrence. `axes` lists the compile-time parameters the
stage's template is rendered over; every other option of kda_problem reaches
the kernel at run time through KdaParams. A stage only gets the axes its code
depends on, so no variant is rendered that no call can reach:

  dtype   activation dtype of q/k/v/o and their gradients     f32 f16 bf16
  bt      chunk size                                          16 32 64
  bk      key-dim tile (>= K, run-time masked above K)        32 64 128 256
  bv      value-dim tile of one block (masked above V)        32 64 128 256
  gate    gate form applied to raw g                          none softplus lower_bound
  l2norm  q/k l2-normalised in the kernel                     0 1
  varlen  sequences from cu_seqlens (1) or batch rows (0)     0 1

Launch geometry (`grid`) is named, and kda.h computes it from the problem:
  rows         (ceil(B*T / ROWS), 1, 1)      ROWS tokens per block, all heads
  chunk_head   (NTmax, HV, 1)                one block per chunk and value head
  chunk_head_v (NTmax, HV, ceil(V / bv))     ... and value tile
  seq_head_v   (N, HV, ceil(V / bv))         one block per sequence, value head, value tile
  head         (HV, 1, 1)                    one block per value head
  fused        set by kda.h's fused forward: fwd_fused and fwd_fused_bounded take
               (N * pieces, HV, column blocks), varlen (pieces * column blocks * HV, 1, 1),
               and their _pairs kernels the same in clusters of 2 along the column blocks
               (z; varlen: x, as pieces * HV * column blocks);
               fwd_combine (N, HV, ceil(V / 32)); fwd_bound (pieces, HV, 1); fwd_fixup
               (ceil(V / 64) * HV * shares * pieces, 1, 1)

`threads` and `smem` (bytes of dynamic shared memory, default 0) are numbers or
expressions in the variant's axes.
"""

DTYPES = ["f32", "f16", "bf16"]
BTS = [16, 32, 64]
TILES = [32, 64, 128, 256]
GATES = ["none", "softplus", "lower_bound"]

# name: (template, axes, grid, threads)
STAGES = {
    # forward
    "prepare":     dict(axes={"dtype": DTYPES, "l2norm": [0, 1]}, grid="rows", threads=256),
    "gate_cumsum": dict(axes={"bt": BTS, "gate": GATES}, grid="chunk_head", threads=256),
    "intra":       dict(axes={"bt": BTS}, grid="chunk_head", threads=256),
    "solve":       dict(axes={"bt": BTS}, grid="chunk_head", threads=64),
    "wu":          dict(axes={"bt": BTS, "dtype": DTYPES}, grid="chunk_head", threads=256),
    "state":       dict(axes={"bt": BTS, "bk": TILES, "bv": [32]}, grid="seq_head_v", threads=256),
    "output":      dict(axes={"bt": BTS, "dtype": DTYPES, "bv": [32, 64]}, grid="chunk_head_v", threads=256),
    # the fused forward (16-token chunks, tensor cores; f16/bf16, K <= bk): the default
    # forward when no intermediates are asked for; fwd_combine joins split sequences
    # (bv/16 state warps + 2 (bv 128) or 3 (bv 64) groups of 4 factor warps, a factor buffer
    # each; dynamic shared memory: bk 128 bv 64 takes 227 KB, Hopper's most, which an A100 cannot give)
    # (varlen: pieces from kda.h's piece table, launched longest first; fixed lengths: from the
    # block index, so that what the blocks compute from it stays uniform)
    "fwd_fused":   dict(axes={"dtype": ["f16", "bf16"], "bk": [64, 128], "bv": [64, 128], "varlen": [0, 1]}, grid="fused",
                        threads="2*bv+256+128*(bv==64)", smem="1024*(34+bk) if bv == 128 else 1024*(bk*3//2+35)"),
    # its bounded split (every segment in one pass, warmed up; kda.h's kda__fused_warmup), after
    # fwd_bound's check of each piece's warm-up
    "fwd_fused_bounded": dict(axes={"dtype": ["f16", "bf16"], "bk": [64, 128], "bv": [64, 128], "varlen": [0, 1]}, grid="fused",
                        threads="2*bv+256+128*(bv==64)", smem="1024*(34+bk) if bv == 128 else 1024*(bk*3//2+35)"),
    "fwd_bound":   dict(axes={}, grid="fused", threads=512),
    "fwd_combine": dict(axes={}, grid="fused", threads=512),
    "fwd_combine_ht": dict(axes={}, grid="fused", threads=512), # ... on to ht, before fwd_fixup
    # the exact split's outputs: the start states' part added to o where the transition pass
    # stored each segment's output from a zero start (kda.h's kda__fused_fwd, p.fz_qt)
    "fwd_fixup":   dict(axes={"dtype": ["f16", "bf16"]}, grid="fused", threads=128, smem=70656),
    # ... after the transition pass of every segment, each later segment's output from its zero
    # start stored (fwd_fused.cu.j2's TRANS: kernels of their own, which leave pass 0's code as it was)
    "fwd_fused_trans": dict(axes={"dtype": ["f16", "bf16"], "bk": [64, 128], "bv": [64, 128], "varlen": [0, 1]}, grid="fused",
                        threads="2*bv+256+128*(bv==64)", smem="1024*(34+bk) if bv == 128 else 1024*(bk*3//2+35)"),
    # backward
    "bwd_dav":     dict(axes={"bt": BTS, "dtype": DTYPES}, grid="chunk_head", threads=256),
    "bwd_dhu":     dict(axes={"bt": BTS, "bk": TILES, "bv": [32], "dtype": DTYPES}, grid="seq_head_v", threads=256),
    "bwd_wy":      dict(axes={"bt": BTS, "dtype": DTYPES}, grid="chunk_head", threads=256),
    "bwd_intra":   dict(axes={"bt": BTS}, grid="chunk_head", threads=256),
    "bwd_cumsum":  dict(axes={"bt": BTS}, grid="chunk_head", threads=256),
    "bwd_gate":    dict(axes={"gate": GATES}, grid="head", threads=256),
    "bwd_qkb":     dict(axes={"dtype": DTYPES, "l2norm": [0, 1]}, grid="rows", threads=256),
    # the per-chunk states in the caller's layout (kda_fwd_outputs.h)
    "states_out":  dict(axes={}, grid="chunk_head", threads=256),
    # the chunked forward's pool form on a device: its sequences' states gathered from their
    # slots into fp32 before the forward, put back after it (a bf16 pool: rounded once)
    "pool_widen":  dict(axes={}, grid="seq_head_v", threads=256),
    "pool_narrow": dict(axes={}, grid="seq_head_v", threads=256),
    # the tensor-core fragment layout, checked on the hardware against tests/cuda_emu.h
    "selftest_mma": dict(axes={"dtype": ["f16", "bf16"]}, grid="head", threads=32),
    # decode: token-by-token recurrence with the state in shared memory
    "recurrent":   dict(axes={"dtype": DTYPES, "bk": TILES, "bv": [32], "varlen": [0, 1]},
                        grid="seq_head_v", threads=256),
    # the fused forward's exact passes and bounded split with the column blocks in pairs (sm_90a,
    # clusters of 2 sharing the factor work: V = 256); the shared memory of fwd_fused's 128
    # columns and the other block's buffers
    "fwd_fused_pairs": dict(axes={"dtype": ["f16", "bf16"], "bk": [64, 128], "bv": [128], "varlen": [0, 1]}, grid="fused",
                        threads="2*bv+256", smem="1024*(36+bk+bk//4)"),
    "fwd_fused_bounded_pairs": dict(axes={"dtype": ["f16", "bf16"], "bk": [64, 128], "bv": [128], "varlen": [0, 1]}, grid="fused",
                        threads="2*bv+256", smem="1024*(36+bk+bk//4)"),
    "fwd_fused_trans_pairs": dict(axes={"dtype": ["f16", "bf16"], "bk": [64, 128], "bv": [128], "varlen": [0, 1]}, grid="fused",
                        threads="2*bv+256", smem="1024*(36+bk+bk//4)"),
}



def _value(stage, spec, key, default):
    t = STAGES[stage].get(key, default)
    return t if isinstance(t, int) else eval(t, {}, dict(spec))


def threads(stage, spec):
    """Threads per block of a variant: a number, or an expression in the variant's axes."""
    return _value(stage, spec, "threads", None)


def smem(stage, spec):
    """Bytes of dynamic shared memory of a variant (0: static shared memory only). The
    template static_asserts that its layout fits, so too small a number fails to compile."""
    return _value(stage, spec, "smem", 0)


# tokens per block for the "rows" grid
ROWS_PER_BLOCK = 8
